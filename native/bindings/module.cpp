// trainstream._C: integers and floats in, no logic. Python (src/trainstream/ops) has
// validated every tensor and passes data pointers; host work runs without the GIL.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "trainstream/adamw.h"
#include "trainstream/common.h"
#include "trainstream/grad.h"
#include "trainstream/quant.h"
#include "trainstream/thread_pool.h"
#include "bindings.h"

namespace py = pybind11;
using namespace trainstream;

namespace {

SimdLevel simd_from_name(const std::string& name) {
  if (name == "avx512") return SimdLevel::kAVX512;
  if (name == "avx2") return SimdLevel::kAVX2;
  if (name == "scalar") return SimdLevel::kScalar;
  throw ArgumentError("SIMD level must be 'scalar', 'avx2' or 'avx512', got '" + name + "'");
}

AdamWConfig hyper_config(double lr, double beta1, double beta2, double eps, double weight_decay,
                         double grad_scale) {
  AdamWConfig cfg;
  cfg.lr = lr;
  cfg.beta1 = beta1;
  cfg.beta2 = beta2;
  cfg.eps = eps;
  cfg.weight_decay = weight_decay;
  cfg.grad_scale = grad_scale;
  return cfg;
}

std::shared_ptr<Job> adamw_queue_py(ThreadPool& pool, const std::vector<int64_t>& params,
                                    const std::vector<int64_t>& grads,
                                    const std::vector<int64_t>& exp_avgs,
                                    const std::vector<int64_t>& exp_avg_sqs,
                                    const std::vector<int64_t>& copies,
                                    const std::vector<int64_t>& numels,
                                    const std::vector<int64_t>& steps,
                                    const std::vector<uint64_t>& seeds, double lr, double beta1,
                                    double beta2, double eps, double weight_decay,
                                    double grad_scale, bool decoupled, int grad_dtype,
                                    int moment_dtype, int copy_dtype, int64_t priority) {
  const size_t n = params.size();
  TS_CHECK_ARG(grads.size() == n && exp_avgs.size() == n && exp_avg_sqs.size() == n &&
                   copies.size() == n && numels.size() == n && steps.size() == n &&
                   seeds.size() == n,
               "adamw_queue: every per-tensor list must have the same length");
  AdamWConfig cfg = hyper_config(lr, beta1, beta2, eps, weight_decay, grad_scale);
  cfg.decoupled = decoupled;
  cfg.grad_dtype = static_cast<DType>(grad_dtype);
  cfg.moment_dtype = static_cast<DType>(moment_dtype);
  cfg.copy_dtype = static_cast<DType>(copy_dtype);
  std::vector<AdamWTensor> tensors(n);
  for (size_t i = 0; i < n; ++i) {
    tensors[i] = AdamWTensor{as_ptr<float>(params[i]), as_ptr<const void>(grads[i]),
                             as_ptr<void>(exp_avgs[i]), as_ptr<void>(exp_avg_sqs[i]),
                             as_ptr<void>(copies[i]), numels[i], steps[i], seeds[i]};
  }
  return adamw_queue(pool, cfg, std::move(tensors), priority);
}

// The scalars one tensor's update uses (AdamWScalars), so the CUDA path packs exactly the
// values the host path computes.
py::tuple adamw_scalars_py(double lr, double beta1, double beta2, double eps, double weight_decay,
                           double grad_scale, int64_t step, uint64_t seed) {
  AdamWConfig cfg = hyper_config(lr, beta1, beta2, eps, weight_decay, grad_scale);
  AdamWTensor t{};
  t.step = step;
  t.seed = seed;
  AdamWScalars s = make_scalars(cfg, t);
  py::list floats;
  for (float f : {s.decay, s.weight_decay, s.one_minus_beta1, s.beta2, s.one_minus_beta2,
                  s.bias_correction2_sqrt, s.eps, s.neg_step_size, s.grad_scale})
    floats.append(f);
  return py::make_tuple(floats, s.rng_key);
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "TrainStream native core (host AdamW, CUDA kernels). Use trainstream.ops, not this.";
  py::register_exception<ArgumentError>(m, "ArgumentError", PyExc_ValueError);

  py::class_<ThreadPool, std::shared_ptr<ThreadPool>>(m, "ThreadPool")
      .def(py::init<int>(), py::arg("threads"))
      .def_property_readonly("threads", &ThreadPool::threads);

  py::class_<Job, std::shared_ptr<Job>>(m, "Job")
      .def("wait", &Job::wait, py::call_guard<py::gil_scoped_release>())
      .def("done", &Job::done);

  m.def("available_cores", &ThreadPool::available_cores);
  m.def("simd_level", [] { return std::string(simd_name(active_simd_level())); });
  m.def("best_simd_level", [] { return std::string(simd_name(best_simd_level())); });
  m.def("set_simd_level", [](const std::string& name) { set_simd_level(simd_from_name(name)); });

  m.def("adamw_queue", &adamw_queue_py, py::call_guard<py::gil_scoped_release>(),
        py::arg("pool"), py::arg("params"), py::arg("grads"), py::arg("exp_avgs"),
        py::arg("exp_avg_sqs"), py::arg("copies"), py::arg("numels"), py::arg("steps"),
        py::arg("seeds"), py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"),
        py::arg("weight_decay"), py::arg("grad_scale"), py::arg("decoupled"),
        py::arg("grad_dtype"), py::arg("moment_dtype"), py::arg("copy_dtype"),
        py::arg("priority") = 0);

  m.def(
      "accumulate_queue",
      [](ThreadPool& pool, const std::vector<int64_t>& dsts, const std::vector<int64_t>& srcs,
         const std::vector<int64_t>& numels, int src_dtype) {
        std::vector<float*> d;
        std::vector<const void*> s;
        for (int64_t p : dsts) d.push_back(as_ptr<float>(p));
        for (int64_t p : srcs) s.push_back(as_ptr<const void>(p));
        return accumulate_queue(pool, d, s, numels, static_cast<DType>(src_dtype));
      },
      py::call_guard<py::gil_scoped_release>(), py::arg("pool"), py::arg("dsts"), py::arg("srcs"),
      py::arg("numels"), py::arg("src_dtype"));

  m.def(
      "quant_queue",
      [](ThreadPool& pool, bool dequantize, int format, int64_t numel, int64_t block_size, int dtype,
         int64_t values, int64_t codes, int64_t absmax) {
        QuantArgs a{static_cast<QuantFormat>(format), numel, block_size, static_cast<DType>(dtype),
                    as_ptr<void>(values), as_ptr<void>(codes), as_ptr<float>(absmax)};
        return dequantize ? dequantize_queue(pool, a) : quantize_queue(pool, a);
      },
      py::call_guard<py::gil_scoped_release>(), py::arg("pool"), py::arg("dequantize"), py::arg("format"),
      py::arg("numel"), py::arg("block_size"), py::arg("dtype"), py::arg("values"), py::arg("codes"),
      py::arg("absmax"));

  m.def("adamw_scalars", &adamw_scalars_py, py::arg("lr"), py::arg("beta1"), py::arg("beta2"),
        py::arg("eps"), py::arg("weight_decay"), py::arg("grad_scale"), py::arg("step"), py::arg("seed"));

  py::dict build;
  build["compiler"] = TS_COMPILER_ID;
#ifdef TS_WITH_CUDA
  build["cuda"] = true;
  build["cuda_version"] = TS_CUDA_VERSION;
  build["cuda_archs"] = TS_CUDA_ARCHS;
  bind_cuda(m);
#else
  build["cuda"] = false;
  build["cuda_version"] = py::none();
  build["cuda_archs"] = "";
#endif
  m.attr("build_info") = build;
}
