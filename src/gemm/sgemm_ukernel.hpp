// The GEMM register microkernel and the packing routines, written once over an xsimd architecture.
// Include only from a per-ISA translation unit (kernels_<isa>.cpp), which instantiates them with
// that ISA's compiler flags.
#pragma once

#include <cstdint>

#include <xsimd/xsimd.hpp>

#include "simd/fmadd.hpp"

#include "gemm/sgemm_kernels.hpp"

namespace mha::gemm {
namespace {

// Operand layouts the microkernel reads. Packed panels have compile-time strides; strided operands
// are read where they lie (the small-problem path).
enum class Layout { packed, strided };

// C[0:MR, 0:NR] = alpha * A_panel * B_panel + beta * C, with NR = NV vectors. With a bias (the fused
// epilogue of a projection; callers pass alpha == 1): C = (A_panel * B_panel + bias[0:NR]) + beta * C.
//   A(i, p) = a[i * rs_a + p * cs_a]   (packed: rs_a = 1, cs_a = MR)
//   B(p, j) = b[p * rs_b + j]          (packed: rs_b = NR; columns are always contiguous)
// beta == 0 never reads C. Register budget: MR * NV accumulators + NV B vectors + 1 broadcast.
// NP > 1 (the few rows at the bottom edge): NP B panels at once, b_panel floats apart, for C's
// MR x NP NR tile, so a tile of two or three rows still has enough independent sums to keep the
// FMA units busy; each sum is the one NP = 1 computes.
// Resume: the sums start from resume[i * ld_resume + j] (a tile's sums over the depth before, as
// an earlier call with alpha = 1, beta = 0 stored them) instead of zero, so a tile's depth can be
// split over calls and every sum stays the one ordered FMA chain (see sgemm_sup_chained).
// PrefetchB = false leaves out the B prefetch 8 rows ahead (for calls over a few rows of B).
// RowScale (alpha == 1, no bias, NP == 1): C = (A_panel * B_panel + beta * C_in) * row_scale[i],
// the tile read from c_in (ld_in) when beta == 1 and written to c: the sum and the product are
// rounded as storing A_panel * B_panel + beta * C_in into C_in and scaling that row would round
// them (attention's last P V, written to the output already divided by the row's sum).
// CopyB (B read in place): each step's NP NV B vectors are also stored to b_copy (64-byte
// aligned), one after the other, NP NR floats a step, for the strips that follow this one over
// the same rows of B (see sgemm_sup_chunked).
// The tile's code, inlined only into the two entry points below (sgemm_ukernel, one tile, and
// sgemm_ukernel_run, a run of them), whose calls are never inlined.
template <class Arch, int MR, int NV, Layout LA, Layout LB, int NP = 1, bool Resume = false, bool PrefetchB = true,
          bool RowScale = false, bool CopyB = false>
__attribute__((always_inline)) inline void ukernel_tile(int64_t k, const float *a, int64_t rs_a, int64_t cs_a,
                                                        const float *b, int64_t rs_b, float *c, int64_t ldc, float alpha,
                                                        float beta, const float *bias, int64_t b_panel,
                                                        const float *resume, int64_t ld_resume, const float *row_scale,
                                                        const float *c_in, int64_t ld_in, float *b_copy) {
    using V = xsimd::batch<float, Arch>;
    constexpr int W = static_cast<int>(V::size);
    constexpr int NR = NV * W;
    constexpr int NT = NV * NP;  // vectors of C per row
    if constexpr (LA == Layout::packed) { rs_a = 1; cs_a = MR; }
    if constexpr (LB == Layout::packed) { rs_b = NR; }

    V acc[MR][NT];
#pragma GCC unroll 32
    for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
        for (int j = 0; j < NT; ++j)
            if constexpr (Resume)
                acc[i][j] = V::load_unaligned(resume + i * ld_resume + j * W);
            else
                acc[i][j] = V(0.0f);

    // Request every line of the C tile early, so they arrive while the k loop runs: C is usually
    // far larger than L2, and a miss per row at the end of each tile costs more than the tile's
    // own arithmetic on large matrices. Not for RowScale's tile, whose C is only written:
    // attention's output rows, written once. Xeon (AMX), 1 thread, H8, against the division after
    // P V, two interleaved runs: L128 D64 +1.2-1.6% with the prefetch, +1.8-2.2% without; D128
    // +3.5-4.8% with, +5.0-5.7% without.
    // On AVX-512 a tile at least MR deep asks for row i's lines at its k loop's step i (spread_c)
    // rather than all before the loop, where its 28 requests queued ahead of the first B rows'.
    // Xeon (model 207), 1 thread, in one process against the requests all first, the same bits:
    // 512x512x64 NT +0.5-2.4% (median 1.4%; 0.955x -> 0.97x dnnl_sgemm), 4096x1536x512 NT
    // +1.7%, 2048x2048x64 NT -1% to +4%, 1024^3 level (0.98-1.02x), attention L128/L512 level
    // (0.99-1.01x). The same requests over the last MR steps instead: 512x512x64 (C in L2)
    // 0.99-1.06x (median 1.01x) the first steps, but 2048x2048x64 and 4096x1536x512 (C from L3 or
    // memory) 5-6% slower; over steps 24 or 6 before those, or both (into L2 first, then L1):
    // level or noise.
    const bool spread_c = !RowScale && W == 16 && k >= MR;
    if (!RowScale && !spread_c)
#pragma GCC unroll 32
        for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
            for (int j = 0; j < NT; ++j) __builtin_prefetch(c + i * ldc + j * W, 1);

    // The k loop needs MR * NV + NV + 1 of the 32 (AVX-512) vector registers: 31 at 14 x 2. Left
    // alone, GCC keeps alpha (which arrives in xmm0) and a spilled C address in two of them and
    // spills a B vector instead, which costs an extra load per FMA pair (measured: the Q K^T tiles
    // of attention ran 20% slower than the P V tiles). Passing these through memory frees them.
    asm volatile("" : "+m"(alpha), "+m"(beta), "+m"(c), "+m"(ldc));
    // A read in place: row i at a + i rs_a. Addressed from one base, 14 rows need 13 offsets,
    // more than the free general registers, and GCC reloaded four of them from the stack every
    // step; from two bases (rows [0, H) and [H, MR)) the halves share H - 1 offsets. Xeon (AMX),
    // 1 thread, against one base: 512x512x64 NT +2% (0.93x -> 0.95x dnnl_sgemm), 512x64x512 +2%,
    // attention (Q K^T on Q in place, P V on P in place) L128/L512 D64/D128 +2.2-2.9%.
    constexpr int H = LA == Layout::strided && MR > 8 ? (MR + 1) / 2 : MR;
    const float *a_hi = a + H * rs_a;
    auto a_row = [&](int i) { return i < H ? a[i * rs_a] : a_hi[(i - H) * rs_a]; };
    auto step = [&] {
        V bv[NT];
#pragma GCC unroll 8
        for (int j = 0; j < NT; ++j) bv[j] = V::load_unaligned(b + j / NV * b_panel + j % NV * W);
        if constexpr (CopyB) {
#pragma GCC unroll 8
            for (int j = 0; j < NT; ++j) bv[j].store_aligned(b_copy + j * W);
            b_copy += NT * W;
        }
        // B streams from L2 past the A micro-panel, which stays in L1: fetch B ahead, every line
        // of the row (one line per step left the odd lines of a 14x32 panel to the hardware).
        if constexpr (PrefetchB) {
#pragma GCC unroll 8
            for (int q = 0; q < NP; ++q)
#pragma GCC unroll 8
                for (int l = 0; l < (NR + 15) / 16; ++l) __builtin_prefetch(b + q * b_panel + 8 * rs_b + 16 * l);
        }
        // B read in place need not start its rows on a line (a malloc'd matrix starts 16 bytes
        // into one), when the row's NR floats span one line more: ask for that one too. Zen 5, 1
        // thread, B 16 bytes into a line, against dnnl_sgemm: 4x1536x512 0.64x -> 0.69x, 8 rows
        // 0.75x -> 0.94x, 16 rows 0.93x -> 0.99x, and for the two-panel tiles 2 rows 0.99x ->
        // 1.05x, 3 rows 0.75x -> 0.83x, 5 rows 1.15x -> 1.20x; level from 32 rows; on lined-up
        // rows level but 5 rows (1.13x -> 1.07x). Not for a single row, whose loop is short of
        // load slots already: 0.65x -> 0.60x.
        if constexpr (PrefetchB && LB == Layout::strided && (NP == 1 || MR > 1))
#pragma GCC unroll 8
            for (int q = 0; q < NP; ++q) __builtin_prefetch(b + q * b_panel + 8 * rs_b + NR - 1);
#pragma GCC unroll 32
        for (int i = 0; i < MR; ++i) {
            const V ai(a_row(i));
#pragma GCC unroll 8
            for (int j = 0; j < NT; ++j) acc[i][j] = simd::fmadd(ai, bv[j], acc[i][j]);
        }
        a += cs_a;
        if constexpr (H < MR) a_hi += cs_a;
        b += rs_b;
    };
    // AVX2 (16 registers): unrolling the k loop 4 times spares its overhead; on Zen 3, timed
    // interleaved against the plain loop, 1-4% faster at 1024x2048x512, 1024x512x2048 and
    // 4096x1536x512. AVX-512 keeps the plain loop its register budget was measured with (above).
    if constexpr (W == 8) {
#pragma GCC unroll 4
        for (int64_t p = 0; p < k; ++p) step();
    } else {
        int64_t p = 0;
        if (spread_c)
            for (const float *cr = c; p < MR; ++p, cr += ldc) {
                step();
#pragma GCC unroll 8
                for (int j = 0; j < NT; ++j) __builtin_prefetch(cr + j * W, 1);
            }
        for (; p < k; ++p) step();
    }

    if constexpr (RowScale) {
        static_assert(NP == 1, "RowScale takes one B panel");
#pragma GCC unroll 32
        for (int i = 0; i < MR; ++i) {
            const V vs(row_scale[i]);
#pragma GCC unroll 8
            for (int j = 0; j < NT; ++j) {
                const V sum = beta == 0.0f ? acc[i][j] : acc[i][j] + V::load_unaligned(c_in + i * ld_in + j * W);
                (sum * vs).store_unaligned(c + i * ldc + j * W);
            }
        }
        return;
    }
    // alpha == 1 (every call from attention, most from users) skips the scaling; the bits are the
    // same as the general form's (x * 1 and fma(x, 1, y) are exact and single-rounded).
    if (bias) {
        V bv[NT];
#pragma GCC unroll 8
        for (int j = 0; j < NT; ++j) bv[j] = V::load_unaligned(bias + j * W);
#pragma GCC unroll 32
        for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
            for (int j = 0; j < NT; ++j) acc[i][j] = acc[i][j] + bv[j];
    }
    if (alpha == 1.0f && (beta == 0.0f || beta == 1.0f)) {
#pragma GCC unroll 32
        for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
            for (int j = 0; j < NT; ++j) {
                float *cp = c + i * ldc + j * W;
                (beta == 0.0f ? acc[i][j] : acc[i][j] + V::load_unaligned(cp)).store_unaligned(cp);
            }
        return;
    }
    const V va(alpha);
    if (beta == 0.0f) {
#pragma GCC unroll 32
        for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
            for (int j = 0; j < NT; ++j) (acc[i][j] * va).store_unaligned(c + i * ldc + j * W);
    } else {
        const V vb(beta);
#pragma GCC unroll 32
        for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
            for (int j = 0; j < NT; ++j) {
                float *cp = c + i * ldc + j * W;
                simd::fmadd(acc[i][j], va, vb * V::load_unaligned(cp)).store_unaligned(cp);
            }
    }
}

// Never inlined: inside a caller's loops (the small-problem path's, attention's chunk) GCC gave
// the k loop fewer registers and reloaded A's row offsets from the stack every step. Xeon (AMX), 1
// thread, against dnnl_sgemm, inlined -> a call per tile: 512x512x64 NT 0.916x -> 0.964x,
// 2048x2048x64 NT 0.950x -> 0.998x, 64^3 1.02x -> 1.10x, 100^3 0.95x -> 0.97x; the packed path
// (whose calls GCC did not inline) level.
template <class Arch, int MR, int NV, Layout LA, Layout LB, int NP = 1, bool Resume = false, bool PrefetchB = true,
          bool RowScale = false, bool CopyB = false>
__attribute__((noinline)) void sgemm_ukernel(int64_t k, const float *a, int64_t rs_a, int64_t cs_a, const float *b,
                                             int64_t rs_b, float *c, int64_t ldc, float alpha, float beta,
                                             const float *bias = nullptr, int64_t b_panel = 0,
                                             const float *resume = nullptr, int64_t ld_resume = 0,
                                             const float *row_scale = nullptr, const float *c_in = nullptr,
                                             int64_t ld_in = 0, float *b_copy = nullptr) {
    ukernel_tile<Arch, MR, NV, LA, LB, NP, Resume, PrefetchB, RowScale, CopyB>(
        k, a, rs_a, cs_a, b, rs_b, c, ldc, alpha, beta, bias, b_panel, resume, ld_resume, row_scale, c_in, ld_in, b_copy);
}

// A run of `tiles` whole tiles along one strip of MR rows, in one call: tile t reads B's panel at
// b + t b_next and writes C's columns [t NR, t NR + NR) (and adds the bias from there), each
// exactly as sgemm_ukernel computes it. The call's own cost (saving registers, A's row offsets,
// the caller's dispatch on the strip's rows and its edge test) then comes once a strip instead of
// once a tile, which shows where tiles are shallow. Only whole strips take it: a run for every
// row count of the edge strips (73 more kernels in attention's AVX-512 object alone) cost
// tools/test a minute of compiling for the few tiles at the bottom edge. Xeon (model 207), 1
// thread, in one process against a call per tile, the same bits, medians of 11-21 paired rounds:
// 512x512x64 NT +1.0-1.8%, 2048x2048x64 NT +1.9%; 1024^3, 4096x1536x512 NT, attention L128/L512
// and the layer level (0.99-1.01x); AVX2 (6x16) on the same core 512x512x64 NT +4.3%, 1024^3
// +2.9%.
template <class Arch, int MR, int NV, Layout LA, Layout LB>
__attribute__((noinline)) void sgemm_ukernel_run(int64_t tiles, int64_t b_next, int64_t k, const float *a,
                                                 int64_t rs_a, int64_t cs_a, const float *b, int64_t rs_b, float *c,
                                                 int64_t ldc, float alpha, float beta, const float *bias) {
    constexpr int64_t NR = NV * static_cast<int64_t>(xsimd::batch<float, Arch>::size);
    for (int64_t t = 0; t < tiles; ++t)
        ukernel_tile<Arch, MR, NV, LA, LB>(k, a, rs_a, cs_a, b + t * b_next, rs_b, c + t * NR, ldc, alpha, beta,
                                           bias ? bias + t * NR : nullptr, 0, nullptr, 0, nullptr, nullptr, 0, nullptr);
}

} // namespace
} // namespace mha::gemm
