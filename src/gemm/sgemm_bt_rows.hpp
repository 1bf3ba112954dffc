// One to kBtRowsMax rows against B^T read in place (see MacroBtRowsFn), written once over an xsimd
// architecture. Include only from an ISA's translation unit.
//
// Every element of C is the ordered FMA chain over the depth block that the microkernel computes,
// so the lanes must run along C's columns: B^T's rows are transposed W x W at a time in registers
// (Transpose::columns, or columns_by_inserts: see kInsertsFromRows) and consumed at once, never
// stored. With so few rows the transposes, not the FMAs, are the work, and B's reads pace them:
// one tile (W rows of B^T) is walked along its depth at a time, W streams the hardware
// prefetchers follow. Zen 5, 1 thread, a 1536 x 512 B^T from L3: its transposes took 33 us 16
// rows at a time, 44 us 32 at a time and 73 us when the panels were also stored, as packing
// does. Two or more tiles side by side (more independent FMA chains for one or two rows) ran
// 1.3-1.9x slower for the same reason, and so did prefetching the next tile's rows ahead; two
// tiles on the Xeon (AMX) too: 1x512x512 NT 0.77x, 1x768x3072 0.83x, 2x1536x512 0.88x.
// Registers: M sums, W columns and a broadcast; from 10 rows on AVX-512 they spill (10 rows 0.56x
// dnnl_sgemm, against 1.21x at 9), and macro_bt takes over.
#pragma once

#include <cstdint>
#include <utility>

#include <xsimd/xsimd.hpp>

#include "gemm/sgemm_kernels.hpp"
#include "gemm/transpose.hpp"
#include "simd/fmadd.hpp"

namespace mha::gemm {
namespace {

// From how many rows the tiles transpose B^T with columns_by_inserts where the runtime takes it (see
// transpose_variant.hpp): each block's W column vectors then feed M FMAs each, and from about 5
// rows the shuffle port, which the FMAs share, is what bounds the loop; with fewer rows on
// AVX-512 the loads are, and the inserts' 4 loads a row (2 on AVX2) cost more than their shuffles
// save. AVX2 takes the same threshold (its 4 rows gained a little, below). Intel Xeon (AMX), 1
// thread, m x 1536 x 512 NT (B^T from L3), inserts against shuffles, the median of 41
// interleaved rounds: AVX-512 1-4 rows 0.98-1.00x, 5 rows 1.15x, 6 1.19x, 7 1.34x, 8 1.26x, 9
// 1.19x (with B^T in L2, m x 512 x 512: 2 rows 0.93x, 4 rows 0.90x, 8 rows 1.19x); AVX2 1-2 rows
// 0.99-1.00x, 4 rows 1.05x, 5-8 rows 1.03-1.07x (one threshold serves both ISAs).
constexpr int kInsertsFromRows = 5;

// C[0:M, 0:cols] = A B or A B + C (accumulate) for cols <= W: B^T's rows [0, cols) at bt (ldbt
// apart, k floats each), A^T in at (k x M: at[p M + i] = A(i, p)), the depth in blocks of kc_blk
// (each block's sums from zero, added to C in order, as the other paths add theirs).
// A^T takes M floats a depth step, not padded to the lanes: the broadcasts take a line every
// W / M steps, not one every step, beside the W rows of B^T a block reads. Xeon (model 207), 1
// thread, one row against B^T in a driver, padded -> compact: 1x1536x512 112 -> 98 us,
// 1x4096x1024 762 -> 681 us.
// The tile walks every depth block before the next tile, so each row of B^T is read once from
// start to end rather than a block's part of it on each pass over the columns.
// Full: cols == W, a constant, so the blocks' row loads need no test each. Xeon (model 207), 1
// thread, m x 1536 x 512 NT, against the count at run time, the same bits: 6 rows 1.08x, 8 rows
// 1.05-1.10x, 9 rows 1.11x (AVX2: 6 rows 1.05x, 8 rows 1.03x), 4 rows level, but 1 row
// 0.94-0.96x and 2 rows 0.95x: so only from kInsertsFromRows rows.
template <class Arch, int M, bool Full>
void bt_rows_tile(int64_t cols, int64_t k, int64_t kc_blk, const float *at, const float *bt, int64_t ldbt, float *c,
                  int64_t ldc, bool accumulate, bool inserts) {
    using V = xsimd::batch<float, Arch>;
    constexpr int W = static_cast<int>(V::size), L = Transpose<Arch>::L;
    static_assert(L == W, "one transposed block is one vector per depth step");
    const int rows = Full ? W : static_cast<int>(cols);
    inserts = inserts && M >= kInsertsFromRows;
    for (int64_t pc = 0; pc < k; pc += kc_blk) {
        const int64_t end = pc + (k - pc < kc_blk ? k - pc : kc_blk);
        V acc[M];
#pragma GCC unroll 8
        for (int i = 0; i < M; ++i) acc[i] = V(0.0f);
        int64_t p0 = pc;
        for (; p0 + L <= end; p0 += L) {
            typename V::register_type col[L];  // col[q] lane r = B^T(r, p0 + q), zero past the rows
            if (inserts)
                Transpose<Arch>::columns_by_inserts(bt + p0, ldbt, rows, col);
            else
                Transpose<Arch>::columns(bt + p0, ldbt, rows, col);
            const float *ap = at + p0 * M;
#pragma GCC unroll 16
            for (int q = 0; q < L; ++q)
#pragma GCC unroll 8
                for (int i = 0; i < M; ++i) acc[i] = simd::fmadd(V(ap[q * M + i]), V(col[q]), acc[i]);
        }
        if (p0 < end) {  // the block's last steps (a whole block would read past the rows' end)
            alignas(64) float col[L * W] = {};
            for (int64_t q = 0; q < end - p0; ++q)
                for (int r = 0; r < rows; ++r) col[q * W + r] = bt[r * ldbt + p0 + q];
            for (int64_t q = 0; q < end - p0; ++q)
                for (int i = 0; i < M; ++i)
                    acc[i] = simd::fmadd(V(at[(p0 + q) * M + i]), V::load_aligned(col + q * W), acc[i]);
        }
        const bool add = accumulate || pc > 0;
        for (int i = 0; i < M; ++i) {
            float *cp = c + i * ldc;
            if (rows == W) {
                (add ? acc[i] + V::load_unaligned(cp) : acc[i]).store_unaligned(cp);
                continue;
            }
            alignas(64) float t[W];
            acc[i].store_aligned(t);
            for (int j = 0; j < rows; ++j) cp[j] = add ? t[j] + cp[j] : t[j];
        }
    }
}

// MacroBtRowsFn: the columns W at a time.
template <class Arch>
void sgemm_macro_bt_rows(int64_t m, int64_t n, int64_t k, int64_t kc_blk, const float *at, const float *bt,
                         int64_t ldbt, float *c, int64_t ldc, bool accumulate, bool inserts) {
    constexpr int W = static_cast<int>(xsimd::batch<float, Arch>::size);
    [&]<int... R>(std::integer_sequence<int, R...>) {
        (void)((m == R + 1 && (
                    [&] {
                        int64_t j = 0;
                        if constexpr (R + 1 >= kInsertsFromRows)
                            for (; j + W <= n; j += W)
                                bt_rows_tile<Arch, R + 1, true>(W, k, kc_blk, at, bt + j * ldbt, ldbt, c + j, ldc,
                                                                accumulate, inserts);
                        for (; j < n; j += W)
                            bt_rows_tile<Arch, R + 1, false>(n - j < W ? n - j : W, k, kc_blk, at, bt + j * ldbt,
                                                             ldbt, c + j, ldc, accumulate, inserts);
                    }(),
                    true)) ||
               ...);
    }(std::make_integer_sequence<int, kBtRowsMax>{});
}

} // namespace
} // namespace mha::gemm
