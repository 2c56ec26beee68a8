// Element types that cross the native boundary. The numbering is part of the ABI
// between src/trainstream/ops and the module: keep it in sync with ops/_dtypes.py.
#pragma once

namespace trainstream {

enum class DType : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2, kNone = -1 };

}  // namespace trainstream
