// The GEMM register microkernel and the packing routines, written once over an xsimd architecture.
// Include only from a per-ISA translation unit (kernels_<isa>.cpp), which instantiates them with
// that ISA's compiler flags.
#pragma once

#include <cstdint>

#include <xsimd/xsimd.hpp>

#include "gemm/sgemm_kernels.hpp"

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
        // Row-major A: MR sequential read streams, one sequential write stream.
        const float *rows[MR];
        for (int i = 0; i < MR; ++i) rows[i] = a + i * rs;
        for (int64_t p = 0; p < kc; ++p)
#pragma GCC unroll 32
            for (int i = 0; i < MR; ++i) out[p * MR + i] = rows[i][p];
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

// Packs an mc x kc block of op(A) into consecutive MR-row micro-panels.
template <int MR>
void pack_a_block(int64_t mc, int64_t kc, const float *a, int64_t rs, int64_t cs, float *out) {
    for (int64_t ir = 0; ir < mc; ir += MR)
        pack_a_panel<MR>(mc - ir < MR ? mc - ir : MR, kc, a + ir * rs, rs, cs, out + ir * kc);
}

// Packs a kc x nc block of op(B) into consecutive NR-column micro-panels.
template <int NR>
void pack_b_block(int64_t nc, int64_t kc, const float *b, int64_t rs, int64_t cs, float *out) {
    for (int64_t jr = 0; jr < nc; jr += NR)
        pack_b_panel<NR>(nc - jr < NR ? nc - jr : NR, kc, b + jr * cs, rs, cs, out + jr * kc);
}

// One MR x NR tile of C. A tile cut by the matrix edge is computed whole into a local buffer and
// only its valid part is merged, so the microkernel itself never branches on the edge.
template <int MR, int NR, class Kernel>
inline void sgemm_tile(const Kernel &kernel, int64_t mr, int64_t nr, float *c, int64_t ldc, float beta) {
    if (mr == MR && nr == NR) return kernel(c, ldc, beta);
    alignas(64) float tmp[MR * NR];
    kernel(tmp, int64_t{NR}, 0.0f);
    for (int64_t i = 0; i < mr; ++i) {
        float *row = c + i * ldc;
        const float *t = tmp + i * NR;
        if (beta == 0.0f)
            for (int64_t j = 0; j < nr; ++j) row[j] = t[j];
        else
            for (int64_t j = 0; j < nr; ++j) row[j] = t[j] + beta * row[j];
    }
}

// The two innermost loops (JR, IR) over a packed mc x kc block of A and kc x nc block of B,
// for NR-column panels [jr0, jr1) of the block.
template <class Arch, int MR, int NV>
void sgemm_macro_packed(int64_t mc, int64_t nc, int64_t kc, int64_t jr0, int64_t jr1, const float *ap,
                        const float *bp, float *c, int64_t ldc, float alpha, float beta) {
    constexpr int NR = NV * static_cast<int>(xsimd::batch<float, Arch>::size);
    for (int64_t jr = jr0; jr < jr1; ++jr) {                 // JR: NR columns
        const int64_t j = jr * NR, nr = nc - j < NR ? nc - j : NR;
        const float *bpanel = bp + j * kc;
        for (int64_t i = 0; i < mc; i += MR) {                 // IR: MR rows
            const float *apanel = ap + i * kc;
            sgemm_tile<MR, NR>([&](float *ct, int64_t ld, float b) {
                sgemm_ukernel<Arch, MR, NV, Layout::packed, Layout::packed>(kc, apanel, 1, MR, bpanel, NR, ct, ld, alpha, b);
            }, mc - i < MR ? mc - i : MR, nr, c + i * ldc + j, ldc, beta);
        }
    }
}

// The small-problem tiles (see SupArgs).
template <class Arch, int MR, int NV>
void sgemm_macro_sup(const SupArgs &s) {
    constexpr int NR = NV * static_cast<int>(xsimd::batch<float, Arch>::size);
    for (int64_t i = 0; i < s.mc; i += MR) {                  // IR: MR rows, in place
        const int64_t mr = s.mc - i < MR ? s.mc - i : MR;
        const float *a = s.a + i * s.rs_a;
        int64_t rs_a = s.rs_a, cs_a = s.cs_a;
        if (mr < MR) {
            pack_a_panel<MR>(mr, s.k, a, rs_a, cs_a, s.a_edge);
            a = s.a_edge, rs_a = 1, cs_a = MR;
        }
        for (int64_t jr = s.jr0; jr < s.jr1; ++jr) {          // JR: NR columns
            const int64_t j = jr * NR, nr = s.nc - j < NR ? s.nc - j : NR;
            sgemm_tile<MR, NR>([&](float *ct, int64_t ld, float beta) {
                if (s.b && nr == NR)
                    sgemm_ukernel<Arch, MR, NV, Layout::strided, Layout::strided>(s.k, a, rs_a, cs_a, s.b + j, s.rs_b, ct,
                                                                                  ld, s.alpha, beta);
                else
                    sgemm_ukernel<Arch, MR, NV, Layout::strided, Layout::packed>(s.k, a, rs_a, cs_a, s.bp + j * s.k, NR,
                                                                                 ct, ld, s.alpha, beta);
            }, mr, nr, s.c + i * s.ldc + j, s.ldc, s.beta);
        }
    }
}

} // namespace
} // namespace mha::gemm
