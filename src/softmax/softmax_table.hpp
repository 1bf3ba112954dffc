// The softmax kernels of each ISA, resolved once per runtime.
#pragma once

#include <cstdint>

#include "mha/isa.hpp"

namespace mha::softmax_detail {

struct SoftmaxKernels {
    Isa isa;
    // y[r, :] = softmax(x[r, :]) for r in [0, rows); x == y is allowed.
    void (*rows)(int64_t rows, int64_t cols, const float *x, int64_t ldx, float *y, int64_t ldy);
    // The online step and its finish; see mha/softmax.hpp.
    void (*online_fold)(int64_t rows, int64_t cols, float *s, int64_t lds, float *m, float *l, float *acc,
                        int64_t ldacc, int64_t acc_cols);
    void (*online_finish)(int64_t rows, const float *l, float *acc, int64_t ldacc, int64_t acc_cols);
    // y[i] = exp(x[i]): the vector exp on its own, for tests and benchmarks.
    void (*exp)(int64_t n, const float *x, float *y);
    // The same for x <= 0 (or -inf, NaN) only: soft-capping's tanh's, and AVX2's softmax's.
    void (*exp_nonpositive)(int64_t n, const float *x, float *y);
    // y[i] = 2^x[i] for x <= 0 (or -inf, NaN): the exp that AVX-512's softmax and online fold use
    // (NULL on AVX2, whose stay in base e).
    void (*exp2_nonpositive)(int64_t n, const float *x, float *y);
};

const SoftmaxKernels &softmax_kernels_avx2();
const SoftmaxKernels &softmax_kernels_avx512();
const SoftmaxKernels &softmax_kernels(Isa isa);

} // namespace mha::softmax_detail
