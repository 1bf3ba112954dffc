// The Add & Norm row kernel of each ISA (see norm_kernels.hpp).
#pragma once

#include <cstdint>

#include "mha/isa.hpp"

namespace mha::layer_detail {

// out = x + add (add NULL: x), then with norm out = LayerNorm(out) over n values; out may be x or add.
using NormRowFn = void (*)(bool norm, int64_t n, const float *x, const float *add, float *out, const float *weight,
                           const float *bias, float eps);
NormRowFn norm_row_avx2();
NormRowFn norm_row_avx512();

} // namespace mha::layer_detail
