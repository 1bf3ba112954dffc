// Add & Norm: the residual add and LayerNorm over rows, the pass right after a sub-block's output
// projection (its output is still in cache).
#pragma once

#include <cstdint>

namespace mha::detail {
struct RuntimeState;
}

namespace mha::layer_detail {

// One row pass, on the runtime's threads (rows in fixed blocks, so the bits do not depend on the
// thread count): with `norm`, out[r] = LayerNorm(x[r] + add[r]) (post-norm); without, out[r] =
// x[r] + add[r] (pre-norm's residual). add may be NULL (LayerNorm of x alone). out may be x or
// add. LayerNorm(v) = (v - mean) / sqrt(var + eps) * weight + bias over the row's n values, with
// the mean and the variance in two passes; weight and bias NULL mean 1 and 0. A row of equal
// values gives bias; a NaN stays in its row.
void add_norm_rows(detail::RuntimeState &st, bool norm, int64_t rows, int64_t n, const float *x, int64_t ldx,
                   const float *add, int64_t ld_add, float *out, int64_t ldo, const float *weight, const float *bias,
                   float eps);

} // namespace mha::layer_detail
