// Bindings of the CUDA side: device queries and kernel launchers. Pointers and the stream
// arrive as integers; the launch is asynchronous on that stream.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "bindings.h"
#include "trainstream/adamw_gpu.h"
#include "trainstream/common.h"
#include "trainstream/cuda_info.h"
#include "trainstream/grad_gpu.h"
#include "trainstream/loss_gpu.h"
#include "trainstream/quant.h"

namespace py = pybind11;

namespace trainstream {

void bind_cuda(py::module_& m) {
  m.def("cuda_info", [] {
    CudaInfo info = cuda_info();
    py::dict d;
    d["runtime_version"] = info.runtime_version;
    d["driver_version"] = info.driver_version;
    d["device_count"] = info.device_count;
    d["error"] = info.error;
    return d;
  });

  m.def(
      "adamw_gpu_launch",
      [](int64_t tensors, int64_t scalars, int64_t grad_scale, int num_tensors, int64_t num_chunks,
         bool decoupled, int grad_dtype, int moment_dtype, int param_dtype, int device, int64_t stream,
         int64_t max_blocks, int64_t skip_flag, int64_t tensor_skip) {
        GpuAdamWLaunch L;
        L.tensors = as_ptr<const GpuAdamWTensor>(tensors);
        L.scalars = as_ptr<const float>(scalars);
        L.grad_scale = as_ptr<const float>(grad_scale);
        L.skip_flag = as_ptr<const int32_t>(skip_flag);
        L.tensor_skip = as_ptr<const int32_t>(tensor_skip);
        L.num_tensors = num_tensors;
        L.num_chunks = num_chunks;
        L.decoupled = decoupled;
        L.grad_dtype = static_cast<DType>(grad_dtype);
        L.moment_dtype = static_cast<DType>(moment_dtype);
        L.param_dtype = static_cast<DType>(param_dtype);
        L.device = device;
        L.stream = stream;
        L.max_blocks = max_blocks;
        adamw_gpu_launch(L);
      },
      py::arg("tensors"), py::arg("scalars"), py::arg("grad_scale"), py::arg("num_tensors"),
      py::arg("num_chunks"), py::arg("decoupled"), py::arg("grad_dtype"), py::arg("moment_dtype"),
      py::arg("param_dtype"), py::arg("device"), py::arg("stream"), py::arg("max_blocks") = 0,
      py::arg("skip_flag") = 0, py::arg("tensor_skip") = 0);
  m.attr("GPU_ADAMW_CHUNK") = kGpuAdamWChunk;

  m.def(
      "grad_sq_norms_launch",
      [](int64_t tensors, int num_tensors, int64_t num_chunks, int dtype, int64_t partials, int64_t out,
         int device, int64_t stream) {
        grad_sq_norms_launch(as_ptr<const SqNormTensor>(tensors), num_tensors, num_chunks,
                             static_cast<DType>(dtype), as_ptr<float>(partials), as_ptr<float>(out), device,
                             stream);
      },
      py::arg("tensors"), py::arg("num_tensors"), py::arg("num_chunks"), py::arg("dtype"),
      py::arg("partials"), py::arg("out"), py::arg("device"), py::arg("stream"));
  m.attr("SQ_NORM_CHUNK") = kSqNormChunk;

  m.def(
      "mark_nonfinite_launch",
      [](int64_t tensors, int num_tensors, int64_t num_chunks, int dtype, int64_t found, int64_t flag,
         int64_t max_blocks, int device, int64_t stream) {
        mark_nonfinite_launch(as_ptr<const SqNormTensor>(tensors), num_tensors, num_chunks,
                              static_cast<DType>(dtype), as_ptr<int32_t>(found), as_ptr<int32_t>(flag), max_blocks,
                              device, stream);
      },
      py::arg("tensors"), py::arg("num_tensors"), py::arg("num_chunks"), py::arg("dtype"), py::arg("found"),
      py::arg("flag"), py::arg("max_blocks"), py::arg("device"), py::arg("stream"));

  m.def(
      "cross_entropy_rows_launch",
      [](int64_t logits, int64_t row_stride, int64_t rows, int64_t vocab, int dtype, int64_t column, int64_t valid,
         int64_t scale, int64_t loss, bool write_dlogits, int device, int64_t stream) {
        CrossEntropyRows a{as_ptr<void>(logits), row_stride, rows, vocab, static_cast<DType>(dtype),
                           as_ptr<const int64_t>(column), as_ptr<const uint8_t>(valid), as_ptr<const float>(scale),
                           as_ptr<float>(loss), write_dlogits};
        cross_entropy_rows_launch(a, device, stream);
      },
      py::arg("logits"), py::arg("row_stride"), py::arg("rows"), py::arg("vocab"), py::arg("dtype"),
      py::arg("column"), py::arg("valid"), py::arg("scale"), py::arg("loss"), py::arg("write_dlogits"),
      py::arg("device"), py::arg("stream"));

  m.def(
      "quant_cuda",
      [](bool dequantize, int format, int64_t numel, int64_t block_size, int dtype, int64_t values,
         int64_t codes, int64_t absmax, int device, int64_t stream) {
        QuantArgs a{static_cast<QuantFormat>(format), numel, block_size, static_cast<DType>(dtype),
                    as_ptr<void>(values), as_ptr<void>(codes), as_ptr<float>(absmax)};
        if (dequantize) dequantize_cuda(a, device, stream);
        else quantize_cuda(a, device, stream);
      },
      py::arg("dequantize"), py::arg("format"), py::arg("numel"), py::arg("block_size"), py::arg("dtype"),
      py::arg("values"), py::arg("codes"), py::arg("absmax"), py::arg("device"), py::arg("stream"));

  m.def(
      "dequantize_batch_cuda",
      [](int format, int dtype, const std::vector<int64_t>& codes, const std::vector<int64_t>& absmax,
         const std::vector<int64_t>& values, const std::vector<int64_t>& numels,
         const std::vector<int64_t>& block_sizes, int device, int64_t stream) {
        const size_t n = codes.size();
        TS_CHECK_ARG(absmax.size() == n && values.size() == n && numels.size() == n && block_sizes.size() == n,
                     "dequantize_batch_cuda: codes, absmax, values, numels and block_sizes must have one entry "
                     "per tensor");
        std::vector<DequantTensor> tensors(n);
        for (size_t i = 0; i < n; ++i)
          tensors[i] = DequantTensor{as_ptr<const void>(codes[i]), as_ptr<const float>(absmax[i]),
                                     as_ptr<void>(values[i]), numels[i], block_sizes[i]};
        dequantize_batch_cuda(static_cast<QuantFormat>(format), static_cast<DType>(dtype), tensors.data(),
                              static_cast<int>(n), device, stream);
      },
      py::arg("format"), py::arg("dtype"), py::arg("codes"), py::arg("absmax"), py::arg("values"),
      py::arg("numels"), py::arg("block_sizes"), py::arg("device"), py::arg("stream"));
}

}  // namespace trainstream
