// The GEMM register microkernel and the packing routines, written once over an xsimd architecture.
// Include only from a per-ISA translation unit (kernels_<isa>.cpp), which instantiates them with
// that ISA's compiler flags.
#pragma once

#include <cstdint>

#include <xsimd/xsimd.hpp>

namespace mha::gemm {
namespace {

// Operand layouts the microkernel reads. Packed panels have compile-time strides; strided operands
// are read where they lie (the small-problem path).
enum class Layout { packed, strided };

// C[0:MR, 0:NR] = alpha * A_panel * B_panel + beta * C, with NR = NV vectors.
//   A(i, p) = a[i * rs_a + p * cs_a]   (packed: rs_a = 1, cs_a = MR)
//   B(p, j) = b[p * rs_b + j]          (packed: rs_b = NR; columns are always contiguous)
// beta == 0 never reads C. Register budget: MR * NV accumulators + NV B vectors + 1 broadcast.
template <class Arch, int MR, int NV, Layout LA, Layout LB>
void sgemm_ukernel(int64_t k, const float *a, int64_t rs_a, int64_t cs_a, const float *b,
                   int64_t rs_b, float *c, int64_t ldc, float alpha, float beta) {
    using V = xsimd::batch<float, Arch>;
    constexpr int W = static_cast<int>(V::size);
    constexpr int NR = NV * W;
    if constexpr (LA == Layout::packed) { rs_a = 1; cs_a = MR; }
    if constexpr (LB == Layout::packed) { rs_b = NR; }

    V acc[MR][NV];
#pragma GCC unroll 32
    for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
        for (int j = 0; j < NV; ++j) acc[i][j] = V(0.0f);

    // Touch the C tile now so its lines arrive while the k loop runs.
#pragma GCC unroll 32
    for (int i = 0; i < MR; ++i) __builtin_prefetch(c + i * ldc, 1);

    for (int64_t p = 0; p < k; ++p) {
        V bv[NV];
#pragma GCC unroll 8
        for (int j = 0; j < NV; ++j) bv[j] = V::load_unaligned(b + j * W);
        if constexpr (LB == Layout::packed) __builtin_prefetch(b + 8 * NR);
#pragma GCC unroll 32
        for (int i = 0; i < MR; ++i) {
            const V ai(a[i * rs_a]);
#pragma GCC unroll 8
            for (int j = 0; j < NV; ++j) acc[i][j] = xsimd::fma(ai, bv[j], acc[i][j]);
        }
        a += cs_a;
        b += rs_b;
    }

    const V va(alpha);
    if (beta == 0.0f) {
#pragma GCC unroll 32
        for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
            for (int j = 0; j < NV; ++j) (acc[i][j] * va).store_unaligned(c + i * ldc + j * W);
    } else {
        const V vb(beta);
#pragma GCC unroll 32
        for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
            for (int j = 0; j < NV; ++j) {
                float *cp = c + i * ldc + j * W;
                xsimd::fma(acc[i][j], va, vb * V::load_unaligned(cp)).store_unaligned(cp);
            }
    }
}

// Packs rows [0, mr_valid) x depth [0, kc) of op(A) into one MR-row micro-panel, zero-padding the
// rows past mr_valid:  out[p * MR + i] = A(i, p), where A(i, p) = a[i * rs + p * cs].
template <int MR>
void pack_a_panel(int64_t mr_valid, int64_t kc, const float *a, int64_t rs, int64_t cs, float *out) {
    if (cs == 1 && mr_valid == MR) {
        // Row-major A: read each row contiguously, write with stride MR.
        for (int i = 0; i < MR; ++i) {
            const float *row = a + i * rs;
            for (int64_t p = 0; p < kc; ++p) out[p * MR + i] = row[p];
        }
        return;
    }
    for (int64_t p = 0; p < kc; ++p) {
        const float *col = a + p * cs;
        int64_t i = 0;
        for (; i < mr_valid; ++i) out[p * MR + i] = col[i * rs];
        for (; i < MR; ++i) out[p * MR + i] = 0.0f;
    }
}

// Packs depth [0, kc) x columns [0, nr_valid) of op(B) into one NR-column micro-panel, zero-padding
// the columns past nr_valid:  out[p * NR + j] = B(p, j), where B(p, j) = b[p * rs + j * cs].
template <int NR>
void pack_b_panel(int64_t nr_valid, int64_t kc, const float *b, int64_t rs, int64_t cs, float *out) {
    if (cs == 1 && nr_valid == NR) {
        for (int64_t p = 0; p < kc; ++p)
            for (int j = 0; j < NR; ++j) out[p * NR + j] = b[p * rs + j];
        return;
    }
    if (rs == 1 && nr_valid == NR) {
        // Transposed B: each column is contiguous in memory.
        for (int j = 0; j < NR; ++j) {
            const float *col = b + j * cs;
            for (int64_t p = 0; p < kc; ++p) out[p * NR + j] = col[p];
        }
        return;
    }
    for (int64_t p = 0; p < kc; ++p) {
        int64_t j = 0;
        for (; j < nr_valid; ++j) out[p * NR + j] = b[p * rs + j * cs];
        for (; j < NR; ++j) out[p * NR + j] = 0.0f;
    }
}

} // namespace
} // namespace mha::gemm
