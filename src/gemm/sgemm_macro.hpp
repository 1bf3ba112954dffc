// The loops right around the microkernel (JR, IR) for both GEMM paths, written once and compiled
// per ISA (include only from an ISA's translation unit).
#pragma once

#include "gemm/sgemm_kernels.hpp"
#include "gemm/sgemm_pack.hpp"
#include "gemm/sgemm_ukernel.hpp"

#include <algorithm>
#include <cmath>
#include <utility>

namespace mha::gemm {
namespace {

// Bottom-edge rows too few for the FMA units (mr NV sums, fewer than kWideSums): the tile spans two
// B panels, doubling its independent sums, where the registers allow it. kWideRows rows at most;
// the caller checks wide_edge().
constexpr int kWideSums = 8;
template <class Arch, int MR, int NV>
constexpr int kWideRows = [] {
    constexpr int regs = xsimd::batch<float, Arch>::size == 16 ? 32 : 16;
    int r = 0;
    while (r + 1 < MR && (r + 1) * NV < kWideSums && (r + 1) * 2 * NV + 2 * NV + 1 <= regs) ++r;
    return r;
}();
template <class Arch, int MR, int NV>
constexpr bool wide_edge(int64_t mr) { return mr <= kWideRows<Arch, MR, NV>; }
// With B read where it lies (the small-problem path), a strip of a few rows is short of B's bytes
// rather than of FMAs: two panels a tile while its sums take at most 5/8 of the registers, so each
// B row is read 2 NR floats at a time. Zen 5, 1 thread, against dnnl_sgemm (B 16 bytes into a
// line / on a line): 4x1536x512 0.72x -> 1.09x / 0.78x -> 0.92x, 5 rows 0.76x -> 1.12x / 0.81x ->
// 1.13x, 4x512x512 0.94x -> 1.30x; 6 rows (24 sums of 32 registers) lost: 0.80x -> 0.75x.
template <class Arch, int MR, int NV>
constexpr int kWideRowsDirect = [] {
    constexpr int regs = xsimd::batch<float, Arch>::size == 16 ? 32 : 16;
    int r = kWideRows<Arch, MR, NV>;
    while (r + 1 < MR && 8 * (r + 1) * 2 * NV <= 5 * regs) ++r;
    return r;
}();
// And the fewest of those rows read more panels still, as many as their sums and B vectors leave
// registers for (r NP NV sums, NP NV B vectors and a broadcast), at most 4: on AVX-512 with 14x32,
// 4 panels for 1-2 rows, 3 for 3-4 rows, 2 for 5. Zen 5, 1 thread, against dnnl_sgemm, x 1536 x 512
// NN, two panels -> these: 1 row 0.65x -> 0.90x, 2 rows 1.05x -> 1.42x, 3 rows 0.80x -> 0.88x, 4
// rows 1.11x -> 1.25x; wider lost (1 row 5 panels 0.60x, 2 rows 5 panels 0.72x, 5 rows 3 panels 0.70x).
template <class Arch, int MR, int NV>
constexpr int direct_panels(int r) {
    constexpr int regs = xsimd::batch<float, Arch>::size == 16 ? 32 : 16;
    if (r > kWideRowsDirect<Arch, MR, NV>) return 1;
    const int np = (regs - 2) / ((r + 1) * NV);
    return np < 2 ? 2 : np > 4 ? 4 : np;
}

// The microkernel with MR rows, or, for the rows left at the bottom edge, the same kernel
// instantiated with exactly that many rows (reading A with its packed strides 1 and MR).
// NP = 2: C[0:mr, 0:2 NR] from two B panels b_panel floats apart (packed panels, or B's columns in
// place: b_panel = NR), for mr <= kWideRows.
template <class Arch, int MR, int NV, Layout LB, int NP = 1>
inline void sgemm_ukernel_rows(int64_t mr, int64_t k, const float *a, int64_t rs_a, int64_t cs_a, const float *b,
                               int64_t rs_b, float *c, int64_t ldc, float alpha, float beta,
                               const float *bias = nullptr, int64_t b_panel = 0) {
    if constexpr (NP == 1)
        if (mr == MR)
            return sgemm_ukernel<Arch, MR, NV, Layout::strided, LB>(k, a, rs_a, cs_a, b, rs_b, c, ldc, alpha, beta, bias);
    [&]<int... R>(std::integer_sequence<int, R...>) {
        (void)((mr == R + 1 &&
                (sgemm_ukernel<Arch, R + 1, NV, Layout::strided, LB, NP>(k, a, rs_a, cs_a, b, rs_b, c, ldc, alpha, beta,
                                                                        bias, b_panel),
                 true)) ||
               ...);
    }(std::make_integer_sequence<int, NP == 1 ? MR - 1 : kWideRowsDirect<Arch, MR, NV>>{});
}

// One tile of C, mr x nr. A tile cut by the right edge is computed whole into a local buffer and
// only its valid columns are merged, so the microkernel never branches on the edge. kernel(c, ldc,
// alpha, beta, bias) computes a whole tile. An edge tile's sums come back as they are (alpha = 1,
// beta = 0) and are merged here with the microkernel's own arithmetic in its general form (bias
// added first, then C = sum x alpha, or fma(sum, alpha, beta C); its fast cases for alpha = 1 give
// the same bits), so a column rounds alike whether its tile was whole, narrow or cut: which of
// those it is may follow the path, and the path the thread count.
template <int MR, int NR, class Kernel>
inline void sgemm_tile(const Kernel &kernel, int64_t mr, int64_t nr, float *c, int64_t ldc, float alpha, float beta,
                       const float *bias = nullptr) {
    if (nr == NR) return kernel(c, ldc, alpha, beta, bias);
    alignas(64) float tmp[MR * NR];
    kernel(tmp, int64_t{NR}, 1.0f, 0.0f, nullptr);
    for (int64_t i = 0; i < mr; ++i) {
        float *row = c + i * ldc;
        float *t = tmp + i * NR;
        if (bias)
            for (int64_t j = 0; j < nr; ++j) t[j] += bias[j];
        if (beta == 0.0f)  // C is not read
            for (int64_t j = 0; j < nr; ++j) row[j] = t[j] * alpha;
        else
            for (int64_t j = 0; j < nr; ++j) row[j] = std::fma(t[j], alpha, beta * row[j]);
    }
}

// A tile cut by the right edge to nr <= (NV - 1) W columns: the microkernel with only the vectors
// those columns need (the same sums), B's panel read at its stride rs_b, so the FLOPs of the
// zero-padded columns past the edge are not spent. Attention at Dv = 80 (two whole 32-column
// panels and half of one): the third panel's P V costs half. Returns false (nothing done) for a
// wider cut.
template <class Arch, int MR, int NV>
inline bool sgemm_narrow_tile(int64_t mr, int64_t nr, int64_t k, const float *a, int64_t rs_a, int64_t cs_a,
                              const float *b, int64_t rs_b, float *c, int64_t ldc, float alpha, float beta,
                              const float *bias) {
    constexpr int W = static_cast<int>(xsimd::batch<float, Arch>::size);
    return [&]<int... V>(std::integer_sequence<int, V...>) {
        return ((nr <= (V + 1) * W &&
                 (sgemm_tile<MR, (V + 1) * W>([&](float *ct, int64_t ld, float al, float bt, const float *bs) {
                      sgemm_ukernel_rows<Arch, MR, V + 1, Layout::strided>(mr, k, a, rs_a, cs_a, b, rs_b, ct, ld, al, bt,
                                                                            bs);
                  }, mr, nr, c, ldc, alpha, beta, bias),
                  true)) ||
                ...);
    }(std::make_integer_sequence<int, NV - 1>{});
}

// One strip of mr rows of the packed path: its A micro-panel (MR x kc, in L1; LA = packed), or
// its rows where they lie (LA = strided: element (i, p) at a[i rs_a + p cs_a]), against every
// NR-column panel of the packed kc x nc block of B; C's rows from c. The microkernels' sums are
// the same ordered chains either way.
template <class Arch, int MR, int NV, Layout LA = Layout::packed>
inline void sgemm_strip_packed(int64_t mr, int64_t nc, int64_t kc, const float *a, int64_t rs_a, int64_t cs_a,
                               const float *bp, float *c, int64_t ldc, float alpha, float beta, const float *bias) {
    constexpr int NR = NV * static_cast<int>(xsimd::batch<float, Arch>::size);
    int64_t j = 0;
    if (mr < MR && wide_edge<Arch, MR, NV>(mr))           // two B panels a tile (see kWideSums)
        for (; j + 2 * NR <= nc; j += 2 * NR)
            sgemm_ukernel_rows<Arch, MR, NV, Layout::packed, 2>(mr, kc, a, rs_a, cs_a, bp + j * kc, NR, c + j, ldc, alpha,
                                                                beta, bias ? bias + j : nullptr, NR * kc);
    // IR: NR columns of B. A whole strip's whole panels in one run (see sgemm_ukernel_run); an
    // edge strip's (a few rows, once a block) a call each, which spares compiling a run for every
    // row count.
    if (const int64_t whole = (nc - j) / NR; mr == MR && whole > 0) {
        sgemm_ukernel_run<Arch, MR, NV, LA, Layout::packed>(whole, NR * kc, kc, a, rs_a, cs_a, bp + j * kc, NR, c + j, ldc,
                                                            alpha, beta, bias ? bias + j : nullptr);
        j += whole * NR;
    }
    for (; j < nc; j += NR) {                              // the edge panel, or an edge strip's panels
        const float *bpanel = bp + j * kc;
        if (nc - j < NR && sgemm_narrow_tile<Arch, MR, NV>(mr, nc - j, kc, a, rs_a, cs_a, bpanel, NR, c + j, ldc, alpha,
                                                           beta, bias ? bias + j : nullptr))
            continue;
        sgemm_tile<MR, NR>([&](float *ct, int64_t ld, float al, float b, const float *bs) {
            if (mr == MR)
                sgemm_ukernel<Arch, MR, NV, LA, Layout::packed>(kc, a, rs_a, cs_a, bpanel, NR, ct, ld, al, b, bs);
            else
                sgemm_ukernel_rows<Arch, MR, NV, Layout::packed>(mr, kc, a, rs_a, cs_a, bpanel, NR, ct, ld, al, b, bs);
        }, mr, nc - j < NR ? nc - j : NR, c + j, ldc, alpha, beta, bias ? bias + j : nullptr);
    }
}

// The two innermost loops over a packed mc x kc block of A (in strips: see strip_start) and kc x
// nc block of B. The A micro-panel (MR x kc) stays in L1 while the B micro-panels stream past it
// from L2.
// bias: NULL, or nc values added to every row.
template <class Arch, int MR, int NV>
void sgemm_macro_packed(int64_t mc, int64_t nc, int64_t kc, const float *ap, const float *bp, float *c, int64_t ldc,
                        float alpha, float beta, const float *bias = nullptr) {
    for (int64_t q = 0, n_strips = strip_count(mc, MR); q < n_strips; ++q) {  // JR: a strip of A's rows
        const int64_t i = strip_start(mc, MR, q), mr = strip_start(mc, MR, q + 1) - i;
        sgemm_strip_packed<Arch, MR, NV>(mr, nc, kc, ap + q * MR * kc, 1, MR, bp, c + i * ldc, ldc, alpha, beta, bias);
    }
}

// The same loops with A's rows where they lie (element (i, p) at a[i rs_a + p cs_a], cs_a = 1),
// read by the microkernel itself, a strip of MR rows at a time against every B panel; the strip's
// rows (MR x kc floats, 28 KiB at 14 x 512) stay in L1 across its tiles as a packed panel would.
template <class Arch, int MR, int NV>
void sgemm_macro_in_place(int64_t mc, int64_t nc, int64_t kc, const float *a, int64_t rs_a, int64_t cs_a,
                          const float *bp, float *c, int64_t ldc, float alpha, float beta, const float *bias) {
    for (int64_t q = 0, n_strips = strip_count(mc, MR); q < n_strips; ++q) {  // JR: a strip of A's rows
        const int64_t i = strip_start(mc, MR, q), mr = strip_start(mc, MR, q + 1) - i;
        sgemm_strip_packed<Arch, MR, NV, Layout::strided>(mr, nc, kc, a + i * rs_a, rs_a, cs_a, bp, c + i * ldc, ldc,
                                                          alpha, beta, bias);
    }
}

// The most rows sgemm_sup_chained takes: 12 sums at most (6 rows of 14x32), whose reload every
// chunk costs less than the misses it saves. Zen 5, 1 thread, against dnnl_sgemm, tile by tile ->
// chained: 6x1024x1024 0.67x -> 0.79x; 8 rows lost (0.68x -> 0.62x), 14 rows more (1.01x -> 0.69x).
template <int MR, int NV>
constexpr int kChainRows = 12 / NV < MR ? 12 / NV : MR;

// A strip of R <= kChainRows rows against B in place, its depth in chunks of s.chain_depth
// rows, each taken across all the strip's tiles before the next: B is read a few rows at a time
// across the block's width, each row a run the prefetchers follow, not a tile's whole depth at
// the stride of B's rows (which, a multiple of 4 KiB, maps all its lines to one L1 set). The sums
// wait in s.chain between chunks as the floats they are in the registers, and resume from there,
// so each is the ordered FMA chain the tile loop computes; the last chunk ends as a tile does
// (alpha, beta, the edge). The tiles are those of sgemm_macro_sup (direct_panels, then 2, then 1).
// When it pays: see sgemm_sup.
template <class Arch, int MR, int NV, int R>
void sgemm_sup_chained(const SupArgs &s, int64_t i) {
    constexpr int NR = NV * static_cast<int>(xsimd::batch<float, Arch>::size);
    constexpr int NP = direct_panels<Arch, MR, NV>(R);
    const float *a = s.a + i * s.rs_a;
    float *c = s.c + i * s.ldc;
    for (int64_t p0 = 0; p0 < s.k; p0 += s.chain_depth) {
        const int64_t kq = std::min(s.chain_depth, s.k - p0);
        const bool first = p0 == 0, last = p0 + kq == s.k;
        const float *ap = a + p0 * s.cs_a;
        // P panels from jr: B in place (b, rs_b) or the packed edge panel.
        auto tile = [&]<int P, Layout LB>(int64_t jr, const float *b, int64_t rs_b) {
            float *t = s.chain + jr * NR;
            const int64_t nr = std::min<int64_t>(P * NR, s.nc - jr * NR);
            auto run = [&](float *out, int64_t ld, float alpha, float beta) {
                if (first)
                    sgemm_ukernel<Arch, R, NV, Layout::strided, LB, P, false, false>(kq, ap, s.rs_a, s.cs_a, b, rs_b, out,
                                                                                     ld, alpha, beta, nullptr, NR);
                else
                    sgemm_ukernel<Arch, R, NV, Layout::strided, LB, P, true, false>(
                        kq, ap, s.rs_a, s.cs_a, b, rs_b, out, ld, alpha, beta, nullptr, NR, t, s.ld_chain);
            };
            if (!last)
                run(t, s.ld_chain, 1.0f, 0.0f);
            else if (nr == P * NR)
                run(c + jr * NR, s.ldc, s.alpha, s.beta);
            else  // the edge panel (P = 1): its valid columns only
                sgemm_tile<R, NR>([&](float *ct, int64_t ld, float al, float bt, const float *) { run(ct, ld, al, bt); }, R,
                                  nr, c + jr * NR, s.ldc, s.alpha, s.beta);
        };
        int64_t jr = s.jr0;
        if constexpr (NP > 2)
            for (; jr + NP - 1 < s.jr1 && (jr + NP) * NR <= s.nc; jr += NP)
                tile.template operator()<NP, Layout::strided>(jr, s.b + p0 * s.rs_b + jr * NR, s.rs_b);
        if constexpr (R <= kWideRowsDirect<Arch, MR, NV>)
            for (; jr + 1 < s.jr1 && (jr + 2) * NR <= s.nc; jr += 2)
                tile.template operator()<2, Layout::strided>(jr, s.b + p0 * s.rs_b + jr * NR, s.rs_b);
        for (; jr < s.jr1; ++jr) {
            if ((jr + 1) * NR <= s.nc)
                tile.template operator()<1, Layout::strided>(jr, s.b + p0 * s.rs_b + jr * NR, s.rs_b);
            else
                tile.template operator()<1, Layout::packed>(jr, s.panel(jr * NR) + p0 * NR, NR);
        }
    }
}

// Strips of 6 to 9 rows against B in place on a 32-column kernel take tiles three vectors (48
// columns) wide, two to every three panels (see sgemm_macro_sup and sgemm_sup_chunked).
template <int NR>
constexpr bool tile48(int64_t mr) {
    return NR == 32 && mr >= 6 && mr <= 9;
}
// Calls f.template operator()<R>() with R = mr, for tile48's heights.
template <class F>
void with_tile48_rows(int64_t mr, const F &f) {
    [&]<int... R>(std::integer_sequence<int, R...>) {
        (void)((mr == R + 6 && (f.template operator()<R + 6>(), true)) || ...);
    }(std::make_integer_sequence<int, 4>{});
}

// One tile of sgemm_sup_chunked: R rows over kq depth steps, from zero (first) or resuming from
// the sums in t; B in place and copied to b_copy (from = 0), the copy (1) or a packed panel (2).
// NP = 3 (with NV = 1): 48 columns, three vectors b_panel floats apart, the copy rs_b = 48 wide.
// The copying tile of one panel asks for B's rows 8 steps ahead (the microkernel's B prefetch),
// which its L1 misses on rows 4 KiB apart otherwise wait for. Xeon (model 207), 1 thread, NN, in
// one process, the same bits, medians of 15 paired rounds, twice: 32x1024x512 1.08-1.11x,
// 32x1024x1024 1.04-1.07x, 24x1024x1024 1.10x, 32x4096x1024 1.07x, 48x1024x1024 and 32x2048x512
// level. The 48-column tiles (two strips of 6 to 9 rows) lost by it: 16x1024x64 0.85x.
template <class Arch, int R, int NV, int NP = 1>
void sgemm_chunk_tile(bool first, int from, int64_t kq, const float *a, int64_t rs_a, int64_t cs_a, const float *b,
                      int64_t rs_b, float *c, int64_t ldc, float alpha, float beta, const float *t, int64_t ld_t,
                      float *b_copy, int64_t b_panel = 0) {
    constexpr Layout copy = NP == 1 ? Layout::packed : Layout::strided;
    auto run = [&]<bool Resume>() {
        if (from == 0)
            sgemm_ukernel<Arch, R, NV, Layout::strided, Layout::strided, NP, Resume, NP == 1, false, true>(
                kq, a, rs_a, cs_a, b, rs_b, c, ldc, alpha, beta, nullptr, b_panel, t, ld_t, nullptr, nullptr, 0, b_copy);
        else
            sgemm_ukernel<Arch, R, NV, Layout::strided, copy, NP, Resume, false>(kq, a, rs_a, cs_a, b, rs_b, c, ldc, alpha,
                                                                                beta, nullptr, b_panel, t, ld_t);
    };
    if (first)
        run.template operator()<false>();
    else
        run.template operator()<true>();
}

// Every strip of the call against B in place, its depth in chunks of s.chain_depth rows, each
// chunk taken across all the call's columns before the next (as sgemm_sup_chained does for one
// strip): B is read a few rows at a time along its rows, runs the hardware prefetchers follow,
// where a tile walking its whole depth jumps a row of B each step (on this Xeon a pass over 4 MiB
// of B by 32-column tiles 512 rows deep read 21 GB/s, by chunks of 8-32 rows across 30 GB/s, as
// fast as a sequential read). The first strip copies the chunk of B it reads into b_copy
// (chain_depth x 2 NR floats, in L1), from which the others read it. The sums wait in s.chain
// (row i at chain + i ld_chain) between chunks as the floats they are in the registers, so each
// is the ordered FMA chain the tile loop computes, and the last chunk ends as a tile does. Strips
// of 6 to 9 rows all take 48-column tiles where three whole panels allow (as sgemm_macro_sup's;
// Xeon, 1 thread, 32 -> 48 columns: 16x1024x200 0.046 -> 0.042 ms, 15x1024x1024 0.265 -> 0.258,
// 16x1024x1024, 16x2048x2048 and 16x1024x64 level).
template <class Arch, int MR, int NV>
void sgemm_sup_chunked(const SupArgs &s) {
    constexpr int W = static_cast<int>(xsimd::batch<float, Arch>::size), NR = NV * W;
    const int64_t n_strips = strip_count(s.mc, MR);
    bool wide = true;
    for (int64_t q = 0; q < n_strips; ++q) wide = wide && tile48<NR>(strip_start(s.mc, MR, q + 1) - strip_start(s.mc, MR, q));
    for (int64_t p0 = 0; p0 < s.k; p0 += s.chain_depth) {
        const int64_t kq = std::min(s.chain_depth, s.k - p0);
        const bool first = p0 == 0, last = p0 + kq == s.k;
        // The tile of `width` columns from column j (a whole 48, or one panel of NR), every strip.
        auto tile = [&](int64_t j, int64_t width) {
            const int64_t nr = std::min<int64_t>(width, s.nc - j);
            for (int64_t q = 0; q < n_strips; ++q) {
                const int64_t i = strip_start(s.mc, MR, q), mr = strip_start(s.mc, MR, q + 1) - i;
                const int from = nr < NR ? 2 : q == 0 ? 0 : 1;
                const float *b = from == 0 ? s.b + p0 * s.rs_b + j : from == 1 ? s.b_copy : s.panel(j) + p0 * NR;
                const int64_t rs_b = from == 0 ? s.rs_b : width;
                const float *t = s.chain + i * s.ld_chain + j, *ap = s.a + i * s.rs_a + p0 * s.cs_a;
                // Inlined: as a function of its own (GCC's choice), each tile's call read this
                // lambda's captures with 32-byte loads from the stack, where they had been stored 8
                // bytes at a time: a store-forwarding stall, each waiting until every older store,
                // the last tile's sums among them, had left for L1 (`perf`: 10-13% of a 32x1024x1024
                // call at that one load). Xeon (model 207), 1 thread, NN, against the call, the
                // same bits: 16x1024x1024 1.11x, 24x1024x1024 1.09x, 32x1024x1024 1.08-1.13x,
                // 48x1024x1024 1.09x, 16x2048x2048 1.11x, 32x4096x1024 1.08x, 32x1024x4096 1.15x.
                auto run = [&](float *out, int64_t ld, float alpha, float beta) __attribute__((always_inline)) {
                    if constexpr (NR == 32)
                        if (width != NR)  // the 48-column tile
                            return with_tile48_rows(mr, [&]<int R>() {
                                sgemm_chunk_tile<Arch, R, 1, 3>(first, from, kq, ap, s.rs_a, s.cs_a, b, rs_b, out, ld,
                                                                alpha, beta, t, s.ld_chain, s.b_copy, W);
                            });
                    [&]<int... R>(std::integer_sequence<int, R...>) {
                        (void)((mr == R + 1 && (sgemm_chunk_tile<Arch, R + 1, NV>(first, from, kq, ap, s.rs_a, s.cs_a, b,
                                                                                  rs_b, out, ld, alpha, beta, t,
                                                                                  s.ld_chain, s.b_copy),
                                                true)) ||
                               ...);
                    }(std::make_integer_sequence<int, MR>{});
                };
                if (!last)
                    run(s.chain + i * s.ld_chain + j, s.ld_chain, 1.0f, 0.0f);
                else if (nr == width)
                    run(s.c + i * s.ldc + j, s.ldc, s.alpha, s.beta);
                else  // the edge panel: its valid columns only
                    sgemm_tile<MR, NR>([&](float *ct, int64_t ld, float al, float bt, const float *) { run(ct, ld, al, bt); },
                                       mr, nr, s.c + i * s.ldc + j, s.ldc, s.alpha, s.beta);
            }
        };
        for (int64_t jr = s.jr0; jr < s.jr1;) {
            if (wide && jr + 2 < s.jr1 && (jr + 3) * NR <= s.nc) {
                tile(jr * NR, 48);
                tile(jr * NR + 48, 48);
                jr += 3;
                continue;
            }
            tile(jr * NR, NR);
            ++jr;
        }
    }
}

// The small-problem tiles (see SupArgs).
template <class Arch, int MR, int NV>
void sgemm_macro_sup(const SupArgs &s) {
    constexpr int NR = NV * static_cast<int>(xsimd::batch<float, Arch>::size);
    if (s.b && s.b_copy) return sgemm_sup_chunked<Arch, MR, NV>(s);
    // JR: a strip of A's rows, in place or packed (SupArgs::a_panel)
    for (int64_t q = 0, n_strips = strip_count(s.mc, MR); q < n_strips; ++q) {
        const int64_t i = strip_start(s.mc, MR, q), mr = strip_start(s.mc, MR, q + 1) - i;
        const float *a = s.a_panel ? s.a + q * s.a_panel : s.a + i * s.rs_a;
        if (s.b && s.chain && mr <= kChainRows<MR, NV> && s.k > s.chain_depth) {
            [&]<int... R>(std::integer_sequence<int, R...>) {
                (void)((mr == R + 1 && (sgemm_sup_chained<Arch, MR, NV, R + 1>(s, i), true)) || ...);
            }(std::make_integer_sequence<int, kChainRows<MR, NV>>{});
            continue;
        }
        int64_t jr = s.jr0;
        if (s.b && mr < MR)  // B in place: direct_panels(mr) panels a tile
            [&]<int... R>(std::integer_sequence<int, R...>) {
                (void)((mr == R + 1 && ([&] {
                            constexpr int NP = direct_panels<Arch, MR, NV>(R + 1);
                            if constexpr (NP > 2)
                                for (; jr + NP - 1 < s.jr1 && (jr + NP) * NR <= s.nc; jr += NP)
                                    sgemm_ukernel<Arch, R + 1, NV, Layout::strided, Layout::strided, NP>(
                                        s.k, a, s.rs_a, s.cs_a, s.b + jr * NR, s.rs_b, s.c + i * s.ldc + jr * NR, s.ldc,
                                        s.alpha, s.beta, nullptr, NR);
                        }(), true)) ||
                       ...);
            }(std::make_integer_sequence<int, kWideRowsDirect<Arch, MR, NV>>{});
        // 6 to 9 rows against B in place on a 32-column kernel: tiles three vectors (48 columns)
        // wide, two to every three panels, so each broadcast of A feeds three FMAs instead of
        // two (9 x 3 sums + 3 B vectors + 1 broadcast fit the 32 registers). Xeon (AMX), 1
        // thread, NN, 32 -> 48 columns a tile, against dnnl_sgemm: 8x1000x200 0.82x -> 0.89x,
        // 16x1000x200 (two strips of 8) 0.82x -> 0.90x, 16x1000x512 0.86x -> 0.95x, 16x1536x512
        // 0.94x -> 1.00x, 16x2000x1000 0.92x -> 0.98x, 15x1000x512 0.90x -> 1.00x, 7x1000x512
        // 0.99x -> 1.11x, 6x2000x1000 1.05x -> 1.11x, 9x2000x1000 1.30x -> 1.37x. Each sum is
        // the same ordered chain in any tile.
        if constexpr (NR == 32)
            if (s.b && tile48<NR>(mr))
                with_tile48_rows(mr, [&]<int R>() {
                    for (; jr + 2 < s.jr1 && (jr + 3) * NR <= s.nc; jr += 3)
                        for (int h = 0; h < 2; ++h)
                            sgemm_ukernel<Arch, R, 1, Layout::strided, Layout::strided, 3>(
                                s.k, a, s.rs_a, s.cs_a, s.b + jr * NR + 48 * h, s.rs_b, s.c + i * s.ldc + jr * NR + 48 * h,
                                s.ldc, s.alpha, s.beta, nullptr, NR / NV);
                });
        if (mr < MR && (s.b ? mr <= kWideRowsDirect<Arch, MR, NV> : wide_edge<Arch, MR, NV>(mr)))  // two B panels a tile
            for (; jr + 1 < s.jr1 && (jr + 2) * NR <= s.nc; jr += 2) {
                const int64_t j = jr * NR;
                float *ct = s.c + i * s.ldc + j;
                if (s.b)
                    sgemm_ukernel_rows<Arch, MR, NV, Layout::strided, 2>(mr, s.k, a, s.rs_a, s.cs_a, s.b + j, s.rs_b, ct,
                                                                         s.ldc, s.alpha, s.beta, nullptr, NR);
                else
                    sgemm_ukernel_rows<Arch, MR, NV, Layout::packed, 2>(mr, s.k, a, s.rs_a, s.cs_a, s.panel(j),
                                                                        NR, ct, s.ldc, s.alpha, s.beta, nullptr,
                                                                        NR * s.bp_depth);
            }
        // IR: NR columns of B; a whole strip's whole panels in one run (B in place, or its packed
        // panels), as in sgemm_strip_packed
        if (const int64_t whole = std::min(s.jr1, s.nc / NR) - jr; mr == MR && whole > 0) {
            const int64_t j = jr * NR;
            if (s.b)
                sgemm_ukernel_run<Arch, MR, NV, Layout::strided, Layout::strided>(
                    whole, NR, s.k, a, s.rs_a, s.cs_a, s.b + j, s.rs_b, s.c + i * s.ldc + j, s.ldc, s.alpha, s.beta,
                    nullptr);
            else
                sgemm_ukernel_run<Arch, MR, NV, Layout::strided, Layout::packed>(
                    whole, NR * s.bp_depth, s.k, a, s.rs_a, s.cs_a, s.panel(j), NR, s.c + i * s.ldc + j, s.ldc, s.alpha,
                    s.beta, nullptr);
            jr += whole;
        }
        for (; jr < s.jr1; ++jr) {                             // the edge panel, or an edge strip's panels
            const int64_t j = jr * NR, nr = s.nc - j < NR ? s.nc - j : NR;
            if (nr < NR && sgemm_narrow_tile<Arch, MR, NV>(mr, nr, s.k, a, s.rs_a, s.cs_a, s.panel(j), NR,
                                                           s.c + i * s.ldc + j, s.ldc, s.alpha, s.beta, nullptr))
                continue;
            sgemm_tile<MR, NR>([&](float *ct, int64_t ld, float alpha, float beta, const float *) {
                if (s.b && nr == NR)
                    sgemm_ukernel_rows<Arch, MR, NV, Layout::strided>(mr, s.k, a, s.rs_a, s.cs_a, s.b + j, s.rs_b, ct, ld,
                                                                      alpha, beta);
                else
                    sgemm_ukernel_rows<Arch, MR, NV, Layout::packed>(mr, s.k, a, s.rs_a, s.cs_a, s.panel(j), NR, ct,
                                                                     ld, alpha, beta);
            }, mr, nr, s.c + i * s.ldc + j, s.ldc, s.alpha, s.beta);
        }
    }
}

// Few rows against B^T (see MacroBtFn): MR rows of B^T at a time are the broadcast operand, read
// in place, and A^T's one packed panel (NV vectors wide) the vector one, so the weight is read
// once and never transposed; the MR x NV lanes tile of C^T goes through a local buffer into C's
// columns, one depth block at a time (each block's sums added to C in order). A tile walks every
// depth block before the next, so each row of B^T is read from start to end in one go.
// NV = 1 up to the lanes (macro_bt), the kernel's NV up to its NR (macro_bt_wide).
template <class Arch, int MR, int NV = 1>
void sgemm_macro_bt(int64_t m, int64_t n, int64_t k, int64_t kc_blk, const float *bt, int64_t ldbt, const float *at,
                    float *c, int64_t ldc, bool accumulate) {
    constexpr int P = NV * static_cast<int>(xsimd::batch<float, Arch>::size);
    for (int64_t j = 0; j < n; j += MR) {
        const int64_t mr = n - j < MR ? n - j : MR;
        for (int64_t pc = 0; pc < k; pc += kc_blk) {
            const int64_t kc = k - pc < kc_blk ? k - pc : kc_blk;
            alignas(64) float t[MR * P];
            sgemm_ukernel_rows<Arch, MR, NV, Layout::packed>(mr, kc, bt + j * ldbt + pc, ldbt, 1, at + pc * P, P, t, P,
                                                             1.0f, 0.0f);
            const bool add = accumulate || pc > 0;
            for (int64_t i = 0; i < m; ++i) {
                float *row = c + i * ldc + j;
                if (add)
                    for (int64_t r = 0; r < mr; ++r) row[r] = t[r * P + i] + row[r];
                else
                    for (int64_t r = 0; r < mr; ++r) row[r] = t[r * P + i];
            }
        }
    }
}

} // namespace
} // namespace mha::gemm
