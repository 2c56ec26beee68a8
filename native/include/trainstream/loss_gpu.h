// The fused cross-entropy rows of the chunked loss (src/trainstream/loss.py, through
// src/trainstream/ops/loss_rows.py): each row's loss and, in place, its logit gradients.
#pragma once

#include <cstdint>

#include "trainstream/dtype.h"

namespace trainstream {

// One block of logit rows, as Python passes it (every pointer on one CUDA device).
//   logits: rows x vocab elements of dtype (float32, bfloat16 or float16); row r starts
//           row_stride elements after row r - 1, its elements are contiguous.
//   column: int64[rows], each row's target column, in [0, vocab) (a row whose column is
//           outside gets a NaN loss and, with write_dlogits, NaN gradients: nothing is read
//           outside the row).
//   valid:  bool (one byte)[rows]: whether the row's target is subtracted from its gradients.
//   scale:  float32[rows], each row's factor on its gradients.
//   loss:   float32[rows], written: log(sum_j exp(z_j - m)) - (z_c - m), m the row's max.
// With write_dlogits the logits are overwritten by
//   (exp(z_j - m) - (valid && j == c ? s : 0)) * (scale / s),  s = sum_j exp(z_j - m),
// computed in fp32 and rounded once to dtype: the pure-torch twin's formula and order
// (loss.py's _loss_and_dlogits).
struct CrossEntropyRows {
  void* logits;
  int64_t row_stride;
  int64_t rows;
  int64_t vocab;
  DType dtype;
  const int64_t* column;
  const uint8_t* valid;
  const float* scale;
  float* loss;
  bool write_dlogits;
};

// One launch on `stream`, asynchronous; nothing is launched for rows == 0 or vocab == 0.
void cross_entropy_rows_launch(const CrossEntropyRows& rows, int device, int64_t stream);

}  // namespace trainstream
