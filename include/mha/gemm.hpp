// Single-precision GEMM, row-major: C = alpha * op(A) * op(B) + beta * C.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "mha/runtime.hpp"

namespace mha {

enum class Trans : char { N = 'N', T = 'T' };

// op(A) is m x k, op(B) is k x n. beta == 0 never reads C. Throws mha::Error on bad arguments
// (before anything is written). The result is bitwise identical for any thread count.
void sgemm(Runtime &rt, Trans transa, Trans transb, int64_t m, int64_t n, int64_t k, float alpha,
           const float *a, int64_t lda, const float *b, int64_t ldb, float beta, float *c, int64_t ldc);

namespace gemm { struct PackedB; }

// op(B) (k x n; transb and ldb as for sgemm) packed once into the panels the runtime's GEMM
// microkernel reads, for any number of products against it (a weight): each product then packs
// only what it must of A, never B. Tied to the microkernel and depth blocking of the runtime that
// packed it: a runtime with another ISA or tile config refuses it with mha::Error. Immutable once
// built, so many host threads may use one at the same time; it copies B and keeps no pointer to it.
class SgemmPackedB {
public:
    SgemmPackedB(Runtime &rt, Trans transb, int64_t k, int64_t n, const float *b, int64_t ldb);
    ~SgemmPackedB();
    SgemmPackedB(SgemmPackedB &&) noexcept;
    SgemmPackedB &operator=(SgemmPackedB &&) noexcept;
    // A moved-from SgemmPackedB throws mha::Error from these and from sgemm.
    int64_t k() const;
    int64_t n() const;
    size_t bytes() const;  // the packed copy's size
    const gemm::PackedB &packed() const;

private:
    std::unique_ptr<gemm::PackedB> packed_;
};

// C = alpha * op(A) * B + beta * C with B packed by SgemmPackedB: op(A) is m x B.k(), C m x B.n().
// The same bits as sgemm with the same arguments and B as it was stored, for any thread count, and
// a row of C the same bits whatever m is. Throws mha::Error on bad arguments (before anything is
// written), as sgemm does.
void sgemm(Runtime &rt, Trans transa, int64_t m, float alpha, const float *a, int64_t lda, const SgemmPackedB &b,
           float beta, float *c, int64_t ldc);

} // namespace mha
