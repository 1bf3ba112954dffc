// Single-precision GEMM, row-major: C = alpha * op(A) * op(B) + beta * C.
#pragma once

#include <cstdint>

#include "mha/runtime.hpp"

namespace mha {

enum class Trans : char { N = 'N', T = 'T' };

// op(A) is m x k, op(B) is k x n. beta == 0 never reads C. Throws mha::Error on bad arguments
// (before anything is written). The result is bitwise identical for any thread count.
void sgemm(Runtime &rt, Trans transa, Trans transb, int64_t m, int64_t n, int64_t k, float alpha,
           const float *a, int64_t lda, const float *b, int64_t ldb, float beta, float *c, int64_t ldc);

} // namespace mha
