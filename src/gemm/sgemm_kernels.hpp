// The table of GEMM microkernels: one entry per line of kernel_list.inc, each instantiated in the
// translation unit of its ISA.
#pragma once

#include <cstdint>
#include <span>
#include <string_view>

#include "mha/isa.hpp"

namespace mha::gemm {

// The small-problem tiles: rows [0, mc) of op(A) read in place (a, rs_a, cs_a), or from its
// packed strips (a_panel, below); the NR-column panels [jr0, jr1) of op(B) read in place from b
// (rs_b, columns contiguous) when b is not NULL, else from the packed panels bp, each bp_depth
// (>= k) deep. The panel cut by the column edge always comes packed (in bp), from column bp_j0
// on. chain (optional, with b and one strip of at most chain_rows rows; ld_chain >= jr1 NR floats
// a row): room for the strip's sums, and the strip then reads B's depth in chunks of chain_depth
// rows across all its tiles (see sgemm_sup_chained). b_copy (optional, with b and chain;
// chain_depth x 2 NR floats, 64-byte aligned): every strip of the call takes each chunk in turn,
// the sums of row i at chain + i ld_chain, the first strip copying the chunk of B it reads there
// for the others (see sgemm_sup_chunked).
struct SupArgs {
    int64_t mc, nc, k, jr0, jr1;
    const float *a;
    int64_t rs_a, cs_a;
    const float *b;
    int64_t rs_b;
    const float *bp;
    int64_t bp_depth;
    float *c;
    int64_t ldc;
    float alpha, beta;
    float *chain = nullptr;
    int64_t ld_chain = 0, chain_depth = 0;
    int64_t bp_j0 = 0;  // the first column bp holds (its panels start there)
    float *b_copy = nullptr;
    // A packed (pack_a's strips): strip q's panel at a + q * a_panel, rs_a = 1 and cs_a = MR; 0: A
    // in place, row i at a + i * rs_a. Not with chain or b_copy.
    int64_t a_panel = 0;
    const float *panel(int64_t j) const { return bp + (j - bp_j0) * bp_depth; }
};

// The row strips a block of mc rows is cut into for the microkernel, MR rows each, except that
// when the last strip would have fewer than MR / 2 rows, the last two share their rows evenly (16
// rows with MR = 14: 8 + 8, not 14 + 2). A strip of a few rows has too few independent sums to
// keep the FMA units busy, and it streams as much of B as a full one: Zen 5, 1 thread, 16 x 1536
// x 512 ran at 0.82x dnnl_sgemm cut 14 + 2. Strip p (p in [0, strip_count]) starts at row
// strip_start(mc, MR, p), and A's packed panel for it is the p-th, MR x kc floats apart. A run of
// whole strips [p0, p1) of a block, taken as a block of its own, is cut the same way, so callers
// may share a block out at strip boundaries. A row's sums never depend on its strip.
inline int64_t strip_count(int64_t mc, int64_t mr) { return (mc + mr - 1) / mr; }
inline int64_t strip_start(int64_t mc, int64_t mr, int64_t p) {
    const int64_t n = strip_count(mc, mr), last = mc - (n - 1) * mr;
    if (p >= n) return mc;
    if (p < n - 1 || n < 2 || 2 * last >= mr) return p * mr;
    return (n - 2) * mr + (mr + last + 1) / 2;
}

// Packs a count x kc operand into panels of W (MR for A, NR for B) along its first dimension:
// element (x, p) = src[x * sx + p * sp] goes to out[(x / W) * W * kc + p * W + x % W], zero-padded.
// B: x = column, sx = cs_b, sp = rs_b. A (x = row, sx = rs_a, sp = cs_a) goes in strips instead:
// the rows of strip q (see strip_start) to panel q, out[q * W * kc + p * W + x - strip_start(q)].
// inserts: the register transpose of a source contiguous along depth (TileConfig::transpose).
using PackBlockFn = void (*)(int64_t count, int64_t kc, const float *src, int64_t sx, int64_t sp, float *out,
                             bool inserts);
// The JR and IR loops over a packed mc x kc block of A and kc x nc block of B:
// C[0:mc, 0:nc] = alpha * A * B + beta * C; with a bias (NULL, or nc values; alpha must be 1),
// C = (A * B + bias) + beta * C.
using MacroPackedFn = void (*)(int64_t mc, int64_t nc, int64_t kc, const float *ap, const float *bp, float *c,
                               int64_t ldc, float alpha, float beta, const float *bias);
// The same loops with A read where it lies by the microkernel (element (i, p) at
// a[i * rs_a + p * cs_a]), never packed.
using MacroInPlaceFn = void (*)(int64_t mc, int64_t nc, int64_t kc, const float *a, int64_t rs_a, int64_t cs_a,
                                const float *bp, float *c, int64_t ldc, float alpha, float beta, const float *bias);
using MacroSupFn = void (*)(const SupArgs &args);
// Few rows against B^T, as C^T = B^T A^T: C[0:m, 0:n] = A B (alpha = 1), or A B + C (beta = 1),
// for m <= lanes() rows: bt holds B^T's rows (n x k, row i at bt + i * ldbt, read in place as the
// microkernel's broadcast operand) and at A^T packed (k x lanes(), lane i = row i of A, zeros past
// m). The depth goes in blocks of kc_blk, each C element's block sums added to it in order: the
// same ordered FMA chains and additions as on the other paths (the product's operands swap,
// which changes no rounding).
// macro_bt_wide: the same for lanes() < m <= nr rows, A^T packed k x nr (lane i = row i of A).
using MacroBtFn = void (*)(int64_t m, int64_t n, int64_t k, int64_t kc_blk, const float *bt, int64_t ldbt,
                           const float *at, float *c, int64_t ldc, bool accumulate);
// One to kBtRowsMax (9) rows against B^T, read in place and transposed in registers on the way:
// C[0:m, 0:n] = A B, or A B + C (accumulate); B^T's rows at bt (n x k, row j at bt + j * ldbt) and
// A^T k x m (at[p m + i] = A(i, p): a single row of A is itself). The depth goes in blocks of
// kc_blk, each C element's block sums added to it in order: the same ordered FMA chains and
// additions as on the other paths. inserts: B^T's blocks go through Transpose's inserts (from 5
// rows; see sgemm_bt_rows.hpp), else its shuffles (TileConfig::transpose; the same floats).
inline constexpr int kBtRowsMax = 9;
using MacroBtRowsFn = void (*)(int64_t m, int64_t n, int64_t k, int64_t kc_blk, const float *at, const float *bt,
                               int64_t ldbt, float *c, int64_t ldc, bool accumulate, bool inserts);
// An elementwise activation applied to a finished block of C (the GEMM epilogue of linear1).
enum class Epilogue { none = 0, relu = 1, gelu = 2 };
using ActivateFn = void (*)(Epilogue act, int64_t rows, int64_t cols, float *c, int64_t ldc);

struct SgemmKernel {
    const char *name;  // "<isa>_<MR>x<NR>"
    Isa isa;
    int mr, nr;
    PackBlockFn pack_a;
    PackBlockFn pack_b;
    MacroPackedFn macro_packed;
    MacroSupFn macro_sup;
    MacroBtFn macro_bt;
    int lanes;  // floats in one vector of the ISA (the rows macro_bt takes at most)
    MacroBtRowsFn macro_bt_rows;
    ActivateFn activate;
    int chain_rows;  // a strip of at most this many rows may take SupArgs::chain (kChainRows)
    MacroInPlaceFn macro_in_place;
    MacroBtFn macro_bt_wide;
    PackBlockFn pack_lanes;  // pack_b's packing into panels `lanes` wide (A^T for macro_bt)
};

std::span<const SgemmKernel> sgemm_kernels_avx2();
std::span<const SgemmKernel> sgemm_kernels_avx512();

// Every kernel compiled in, in kernel_list.inc order.
std::span<const SgemmKernel> all_sgemm_kernels();
// The kernel of that name, or nullptr.
const SgemmKernel *find_sgemm_kernel(std::string_view name);
// The default kernel of an ISA.
const SgemmKernel &default_sgemm_kernel(Isa isa);

} // namespace mha::gemm
