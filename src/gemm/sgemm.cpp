// The blocked GEMM driver (Goto & van de Geijn 2008; the BLIS five-loop structure), its
// small-problem path, and the public entry point.
#include <tbb/parallel_for.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>

#include "gemm/prepacked.hpp"
#include "runtime/validate.hpp"
#include "mha/gemm.hpp"
#include "runtime/runtime_state.hpp"

namespace mha {
namespace gemm {
namespace {

using detail::RuntimeState;
using detail::check_matrix;
using detail::check_size;

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
int64_t round_up(int64_t a, int64_t b) { return ceil_div(a, b) * b; }

// The depth blocks of a product k deep: as few as KC allows, of equal depth (a multiple of 8 when
// that still fits KC). K = 512 with KC = 368 runs as 2 x 256, not 368 + 144: a shallow last block
// pays the C tile's load and store over fewer FMAs. Depends on k and the tile config only, so
// never on the thread count.
int64_t depth_block(const TileConfig &t, int64_t k) {
    const int64_t even = ceil_div(k, ceil_div(k, t.kc));
    return std::min(t.kc, round_up(even, 8));
}

// A matrix operand as the kernels see it: element (i, j) = p[i * rs + j * cs].
struct Operand {
    const float *p;
    int64_t rs, cs;
    const float *at(int64_t i, int64_t j) const { return p + i * rs + j * cs; }
};

struct Output {
    float *p;
    int64_t ld;
    float alpha, beta;
    const float *bias = nullptr;  // NULL, or n values added to every row (alpha == 1)
    Epilogue act = Epilogue::none;  // applied to each block of C once its whole depth is summed
};

// Columns [j0, ...) of a B packed ahead of time, read in place of packing B per call.
struct Prepacked {
    const PackedB *b = nullptr;
    int64_t j0 = 0;
};

// Runs `fn(item)` for item in [0, count) on the arena the caller is in, one task per item; on the
// calling thread alone, in order, for threads == 1 (work that pays for one thread only, or one
// thread's share of a product split by on_threads).
template <class Fn>
void parallel_items(int64_t count, int64_t threads, const Fn &fn) {
    if (count == 1 || threads == 1) {
        for (int64_t i = 0; i < count; ++i) fn(i);
        return;
    }
    tbb::parallel_for(tbb::blocked_range<int64_t>(0, count, 1),
                      [&](const tbb::blocked_range<int64_t> &r) {
                          for (int64_t i = r.begin(); i != r.end(); ++i) fn(i);
                      },
                      tbb::simple_partitioner());
}

// Splits [0, count) into at most `chunks` contiguous ranges and runs fn(begin, end) on each.
template <class Fn>
void parallel_chunks(int64_t count, int64_t chunks, const Fn &fn) {
    chunks = std::max<int64_t>(1, std::min(chunks, count));
    const int64_t per = ceil_div(count, chunks);
    parallel_items(ceil_div(count, per), chunks, [&](int64_t i) { fn(i * per, std::min(count, (i + 1) * per)); });
}

// The packed path: Goto's five loops around the microkernel. A row-major C = A B is, to BLIS's
// column-major loops, C^T = B^T A^T, so the loops below carry BLIS's names for that product: our A
// is BLIS's B (broadcast by the microkernel, its micro-panel in L1: packed a strip at a time by
// the work item that runs it, or, transposed, a block shared by all threads) and our B is BLIS's
// A (vector loads; each thread packs its own block into its L2).
// Threads split the JC/IC work, never PC, so every element of C sums its products in the same
// order for any thread count.
// T: the threads it runs on (product_threads).
void sgemm_packed(RuntimeState &s, int64_t T, int64_t m, int64_t n, int64_t k, Operand a, Operand b, Output c,
                  Prepacked pre = {}) {
    const SgemmKernel &uk = *s.sgemm;
    const TileConfig &t = s.tiles;
    const int64_t MR = uk.mr, NR = uk.nr;
    const int64_t kc_blk = pre.b ? pre.b->kc : depth_block(t, k), kc_max = std::min(k, kc_blk);
    // Row blocks of equal height too (a multiple of MR), so no block is a sliver: m = 4096 with
    // MC = 4092 would pack every B block a second time for 4 rows.
    const int64_t mc_blk = std::min(t.mc, round_up(ceil_div(m, ceil_div(m, t.mc)), MR));
    const int64_t mc_max = std::min(round_up(m, MR), mc_blk);
    // NC only sizes the work items (columns start at multiples of NR either way), so it may follow
    // the thread count: round the number of B blocks up to a multiple of T so the threads finish together.
    int64_t n_blocks = std::min(ceil_div(n, NR), round_up(ceil_div(n, t.nc), T));
    const int64_t nc = round_up(ceil_div(n, n_blocks), NR);
    n_blocks = ceil_div(n, nc);
    // With fewer B blocks than threads (a narrow C), also split the rows of the A block.
    const int64_t row_split = n_blocks >= T ? 1 : std::min(ceil_div(mc_max, MR), ceil_div(T, n_blocks));

    // A's rows contiguous (A not transposed): the microkernel reads each strip of A where it lies
    // (macro_in_place), and A is never packed. Packing each strip first, right before its tiles
    // (into a panel that stayed in L1), was a pass over A per B block. Xeon (AMX), 1 thread, strips
    // packed -> in place, one interleaved run each, the same bits: 1000^3 1.036-1.046x, 1536^3
    // 1.036x, 1500^3 1.037x, 600x700x1500 1.044x, 3000x1000x800 1.014x, 4096x1536x1024 NT 1.026x;
    // rows a multiple of 4 KiB apart, where a strip's 14 rows share one L1 set of 12 ways: 1024^3
    // 1.012-1.015x, 2048^3 0.993-1.012x, 2048x1024x2048 1.021x, 1024x3072x1024 NT 1.009x,
    // 4096x4096x1024 NT 1.006x (the same code either way; between two builds, whose code lies
    // differently, 1024^3 read 0.98-1.00x and 2048^3 0.97-1.02x); 2 threads 1024^3 1.007x, 2048^3
    // 1.019x; AVX2 (6x16) 1024^3 0.997x, 1000^3 1.006x. On packed weights (the layer's projections,
    // A = the activations): 1024x1536x512 1.022-1.023x, 1024x512x512 1.024x, 4096x1536x512 1.030x,
    // 200x2048x512 1.027x, 64 rows 1.037x, 16 rows 1.083x, 1 row 1.038x; rows 4 KiB apart
    // (x3072x1024) 1-64 rows 1.011-1.055x, 256 rows 1.002x; 2 threads 1024x1536x512 1.058x,
    // 1024x512x512 1.061x; AVX2 1.006-1.022x; the E512 H8 layer B8 L128 1.015x, B4 L512 1.021x, B1
    // L2048 1.040x (2 threads, B8 L128: 1.008x).
    // Before the strips, the whole A block was packed first, which left the FMA units idle while A
    // came from memory (Xeon, 1 thread, against dnnl_sgemm, block -> strips: 1024^3 0.968x ->
    // 1.000x, 2048^3 0.948x -> 0.958x, 2048x1536x1024 NT 0.940x -> 0.983x).
    // A transposed keeps the block: a strip of it is kc runs of MR floats, each run a page apart,
    // and packing it strip by strip lost (1024^3 TN 1.031x -> 0.961x).
    const bool a_in_place = a.cs == 1;
    const int64_t b_size = pre.b ? 0 : kc_max * nc, a_size = a_in_place ? 0 : mc_max * kc_max;
    // B's blocks: one a slot of the arena, or one for a call on a single thread (slot 0, see below).
    auto scratch = s.pool.borrow(static_cast<size_t>(a_size + (T == 1 ? 1 : s.slots) * b_size));
    float *ap = scratch.data(), *b_packs = ap + a_size;
    for (int64_t ic = 0; ic < m; ic += mc_blk) {                 // JC: MC rows of A
        const int64_t mc = std::min(mc_blk, m - ic), n_ir = ceil_div(mc, MR);
        const int64_t ir_per = ceil_div(n_ir, row_split);
        for (int64_t pc = 0; pc < k; pc += kc_blk) {             // PC: KC deep; pack A^T's block
            const int64_t kc = std::min(kc_blk, k - pc);
            if (!a_in_place)
                parallel_chunks(n_ir, T, [&](int64_t ir0, int64_t ir1) {  // whole strips, so each is cut as in the block
                    const int64_t i0 = strip_start(mc, MR, ir0), rows = strip_start(mc, MR, ir1) - i0;
                    uk.pack_a(rows, kc, a.at(ic + i0, pc), a.rs, a.cs, ap + ir0 * MR * kc, s.inserts);
                });
            const float beta = pc == 0 ? c.beta : 1.0f;
            const float *bias = pc == 0 ? c.bias : nullptr;
            parallel_items(n_blocks * row_split, T, [&](int64_t item) { // IC: NC columns of B; pack B
                const int64_t jc = item / row_split * nc, ncur = std::min(nc, n - jc);
                const int64_t ir0 = item % row_split * ir_per, ir1 = std::min(n_ir, ir0 + ir_per);
                if (ir0 >= ir1) return;
                const float *bp = pre.b ? pre.b->block(pc, pre.j0 + jc) : nullptr;
                // On one thread the call may run outside the arena (see on_threads): slot 0.
                const int64_t slot = T == 1 ? 0 : RuntimeState::this_thread_slot();
                if (!bp) {
                    float *own = b_packs + slot * b_size;
                    uk.pack_b(ncur, kc, b.at(pc, jc), b.cs, b.rs, own, s.inserts);
                    bp = own;
                }
                // JR and IR run inside the ISA's translation unit, on whole strips of the block.
                const int64_t i0 = strip_start(mc, MR, ir0), rows = strip_start(mc, MR, ir1) - i0;
                float *cb = c.p + (ic + i0) * c.ld + jc;
                if (a_in_place)
                    uk.macro_in_place(rows, ncur, kc, a.at(ic + i0, pc), a.rs, a.cs, bp, cb, c.ld, c.alpha, beta,
                                      bias ? bias + jc : nullptr);
                else
                    uk.macro_packed(rows, ncur, kc, ap + ir0 * MR * kc, bp, cb, c.ld, c.alpha, beta,
                                    bias ? bias + jc : nullptr);
                if (c.act != Epilogue::none && pc + kc == k) uk.activate(c.act, rows, ncur, cb, c.ld);
            });
        }
    }
}

// The small-problem path (after BLIS's "sup"): A is read where it lies, and B too when its columns
// are contiguous; only B^T and the edge panels are packed. A deep product is cut into KC-deep
// blocks as the packed path does (C accumulates them in order, so the sums are the same for any
// thread count): the MR rows of A the microkernel reads stay in L1 and the KC x NC block of B in L2.
// The most rows against B whose rows lie a multiple of 4 KiB apart that sgemm_sup reads B for in
// place in chunks (sgemm_sup_chunked), every strip from the one pass over B; more rows take the
// packed path, whose copy of B they share. Xeon (AMX), NN, against dnnl_sgemm, packed -> chunked,
// 1 thread: 16x1024x1024 0.69x -> 1.04x, 32x1024x1024 0.93x (in place, tile by tile) -> 1.07x,
// 48x1024x1024 0.98x -> 1.03x, 16x2048x2048 0.70x -> 1.07x, 32x4096x1024 0.89x -> 0.98x, but 64
// rows 0.94x -> 0.88x and 96 rows 1.20x -> 1.03x. AVX2 (6x16), 1 thread: 16x1024x1024 0.53x ->
// 0.70x, 32x1024x1024 0.71x -> 0.73x. One strip stays tile by tile (8 rows 0.96x -> 0.94x, 12
// rows 1.24x -> 1.13x), and so do B rows at other strides, which the tiles already read as fast
// (32x2000x1000 0.94x -> 0.76x chunked).
// These few strips are also what several threads split by B's columns at the top (on_threads),
// each share on the one-thread path: in the paths' own splits on 2 threads, the chunks had lost
// from 32 rows (32x1024x1024 1.11x -> 0.98x, 48 rows 1.14x -> 0.93x against the packed path).
int64_t few_strips_rows(const SgemmKernel &uk) { return uk.lanes == 16 ? 4 * uk.mr - 1 : 32; }

// Whether a k x n B is larger than the packed block (KC x NC, half of L2), so that it comes from
// memory on every call: the chunks pay only there (see sgemm_sup).
bool b_past_block(const TileConfig &t, int64_t n, int64_t k) {
    return detail::past_packed_block(t, static_cast<double>(k) * static_cast<double>(n));
}

// n_b: the whole B's width, of which these n columns are a share (on_threads): whether B comes from
// memory is the whole B's matter.
void sgemm_sup(RuntimeState &s, int64_t T, int64_t m, int64_t n, int64_t k, Operand a, Operand b, Output c,
               int64_t n_b) {
    const SgemmKernel &uk = *s.sgemm;
    const TileConfig &t = s.tiles;
    const int64_t MR = uk.mr, NR = uk.nr;
    const int64_t kc_blk = depth_block(t, k), kc_max = std::min(k, kc_blk);
    // The kc x NC block of B takes the packed path's B footprint (KC x NC, half of L2).
    int64_t nc_blk = std::clamp(t.nc * t.kc / kc_max / NR * NR, NR, round_up(n, NR));
    // B is read in place only when few rows of A reuse it: its rows lie n apart, a stride that
    // maps a panel's lines onto few L1 sets (n = 128: 8 of 64), so when it is read many times the
    // packed copy pays. Zen 3, 1 thread: 2048x64x2048 63 GF/s packed vs 54 in place, 1024x128x1024
    // 72 vs 62; at 64x64x64 the in-place read stayed ahead (59 vs 55).
    const bool b_in_place = b.cs == 1 && m < 8 * MR;
    const int64_t n_ir = ceil_div(m, MR);
    // B's rows a multiple of 4 KiB apart put a tile's column of lines all in one set of L1 (64
    // sets of 64 bytes on every x86 core), so a strip of a few rows, which reads B in place once,
    // would miss on every row walking a tile's depth. It takes the depth 8 rows at a time across
    // as many columns as its sums fit in 16 KiB of L1 instead (SupArgs::chain). Zen 5, 1 thread,
    // against dnnl_sgemm, NN, tile by tile -> chained: 1x1024x1024 0.68x -> 0.80x, 1x2048x2048
    // 0.65x -> 0.83-0.86x, 1x1024x4096 0.66x -> 0.88x, 1x4096x1024 0.67x -> 0.88x, 1x3072x1024
    // 0.72x -> 0.84x, 2x2048x2048 1.27x -> 1.54x, 3x2048x2048 0.80x -> 0.97x, 5x4096x1024 1.01x ->
    // 1.04x. Other strides lose by it (the chunks' reloads of their sums, with no aliasing to
    // undo): 1x2000x2000 1.10x -> 0.95x, 1x2560x1024 0.95x -> 0.84x, 1x512x4096 (2 KiB) 0.89x ->
    // 0.80x; 16 rows a chunk were 3-8% slower than 8, 4 rows 5-15%; the B prefetch 8 rows ahead
    // (a chunk's end: rows read much later) is left out.
    // On Intel's cores, one to a few rows against a B from memory gain by the chain at any stride
    // (TileConfig::sup_chain_rows; see tile_config.cpp).
    constexpr int64_t chain_depth = 8, chain_bytes = 16 << 10;
    const bool any_stride = m <= t.sup_chain_rows && k * n_b >= 2 * t.kc * t.nc;
    const bool chained = b_in_place && m <= uk.chain_rows && kc_max > chain_depth && (b.rs % 1024 == 0 || any_stride);
    if (chained) nc_blk = std::clamp(chain_bytes / 4 / m / NR * NR, NR, round_up(n, NR));
    const int64_t ld_chain = chained ? round_up(nc_blk, NR) : 0;

    // A few strips against such B read it in place in chunks of rows across the block, every
    // strip per chunk (sgemm_sup_chunked), up to few_strips_rows: the sums of all the strips' rows
    // wait between chunks in 128 KiB, one B copy of a chunk per work item. Only a B larger than
    // the packed block (KC x NC, half of L2), which comes from memory: one that stays in L2 from
    // call to call is read as fast tile by tile (Xeon, 1 thread, tile by tile -> chunked:
    // 20x1024x128 NN 0.036 -> 0.038 ms, 32x1024x200 0.082 -> 0.090, 48x1024x200 0.120 -> 0.124;
    // 16x1024x256, 1 MiB, 0.080 -> 0.059), except by two strips of 8 rows (16 rows on 14x32),
    // whose tiles each take a B line from L2 for 16 FMAs: 16x1024x200 0.069 -> 0.053 ms,
    // 16x2048x100 0.072 -> 0.059, 16x1024x64 0.022 -> 0.016 (dnnl_sgemm 0.037, 0.039, 0.012).
    // Once the tile call was inlined (sgemm_sup_chunked), a B in L2 whose depth takes one or two
    // chunks gains by them too: the copy serves the other strips, and the sums go out and back
    // once at most. Model-207 Xeon, 1 thread, NN, in one process, tile by tile -> chunked, the
    // same bits, medians of 11-15 paired rounds on a calm host: 20x1024x64 1.25-1.33x, 24x1024x64
    // 1.27x, 32x1024x64 1.16-1.18x, 40x1024x64 1.13x, 48x1024x64 1.14-1.15x (against B packed,
    // below), 55x1024x64 1.09x; 20x1024x128 1.14x, 24x1024x128 1.15-1.20x, 32x1024x128 1.10x,
    // 40x1024x128 0.97-1.05x, 48x1024x128 1.06x, 55x1024x128 1.01x. Deeper, level or lost (four
    // chunks: 20-55 x 1024 x 256 0.98-1.04x, 20-55 x 2048 x 128 0.96-1.00x, 55x1024x200 0.95x).
    // 2 threads: 20x1024x64 1.32x, 24x1024x128 1.19x; AVX2 (6x16): 20x1024x64 1.14x, 30x1024x64
    // 1.11x, 24x1024x128 1.06x.
    // A chunk is 32 rows deep, or 64 where one block spans B's whole width. Each chunk's tiles
    // resume their sums from L2 and store them back, a fixed cost that 64 steps halve; but where
    // a block takes part of each row, 64 rows lost (why, not found). Xeon (model
    // 207), 1 thread, NN, in one process, 64 against 32 (both with sgemm_sup_chunked's tile call
    // inlined), the same bits, two runs: whole rows 16x1024x48 +17%, 16x1024x64 +14-16%,
    // 16x1024x256 +8-9%, 32x1024x512 +4-9%, 24x1024x1024 +10%, 32x1024x1024 +2-5%; 16x1024x1024,
    // 48x1024x1024 and 16x2048x2048 level (-3% to +4%); part of each row 32x2048x512 -2.5%,
    // 24x2048x512 -2%, 32x2048x1024 -5%, 32x4096x1024 -6%, 32x4096x512 -28% (the same code read
    // +-6% apart on this host). Depths of 96 and 128 were 5-10% slower than 64 at 32x1024x1024;
    // AVX2 (6x16) level. Depths of 33-64 (one chunk) are still chunked, for the copy the other
    // strips read.
    constexpr int64_t chunk_min_depth = 32, chunk_bytes = 128 << 10;
    const int64_t chunk_cols = std::clamp(chunk_bytes / 4 / m / NR * NR, NR, round_up(n, NR));
    const int64_t chunk_depth = chunk_cols >= n ? 2 * chunk_min_depth : chunk_min_depth;
    const bool chunked = b_in_place && !chained && b.rs % 1024 == 0 && n_ir >= 2 && m <= few_strips_rows(uk) &&
                         kc_max > chunk_min_depth &&
                         (b_past_block(t, n_b, k) || (uk.lanes == 16 && m <= 16) || kc_max <= 2 * chunk_depth);
    if (chunked) nc_blk = chunk_cols;
    // Four strips or more that take B tile by tile where its rows lie a multiple of 4 KiB apart
    // (a B under the packed block, in L2 from call to call) pack each block of it first: in place,
    // a tile's column of B lines falls on two sets of L1 and each strip reads it from L2 again.
    // Xeon (model 207), 1 thread, NN, in one process, in place -> packed, the same bits, medians
    // of 21 paired rounds: 48x1024x64 1.15x (since chunked, above), 56x1024x256 1.05x,
    // 80x1024x128 1.15x, 96x2048x128 1.13x; but three strips level (40x1024x256 1.01x) and two
    // lost (24x1024x256 0.97x, 28x1024x128 0.91x).
    const bool b_direct = b_in_place && !(b.rs % 1024 == 0 && !chained && !chunked && n_ir >= 4);
    // B in place packs only the panel cut by the edge (bp then holds that one panel).
    const int64_t bp_cols = b_direct ? NR : nc_blk;
    // The sums' buffer (rows ld_sums apart) and the depth of a chunk, of either kind.
    const int64_t ld_sums = chunked ? round_up(nc_blk, NR) : ld_chain, sums_depth = chunked ? chunk_depth : chain_depth;
    // A stored transposed (A^T row-major) has a strip's MR values of a depth step side by side and
    // the next step a row of A^T further: read in place, a strip takes a line a step, for every
    // tile again, on few L1 sets when the rows lie a multiple of 1 KiB apart. Its strips are
    // packed once per depth block instead (a copy of MR floats a step, for at most MC rows, the
    // packed path's A block: taller products keep to the old walk), where A^T's rows lie a multiple
    // of 1 KiB apart, or at least 64 floats apart in a product of 2^22 multiply-adds or more (a
    // smaller one does not pay the copy back). Xeon (AMX), 1 thread, in place -> packed,
    // the same bits, TN unless noted: 512^3 1.15x (TT 1.17x), 768x512x512 1.20x, 256x512x512
    // 1.10x, 1000x300x200 1.16x, 1024x64x512 1.35x, 2048x2048x64 1.22x, 96x1024x512 1.07x,
    // 300x500x400 1.03x, TT 1024x1024x512 1.72x; A^T's rows 4 KiB apart: 8x1536x512 1.19x,
    // 16x768x768 1.24x, 64x512x512 1.78x. Left in place: 128^3 (0.91x packed), 16x768x768 with
    // A^T's rows 64 bytes apart (0.90x).
    const int64_t lda_t = a.cs;  // A^T's row stride, when a.rs == 1
    const bool pack_a = a.rs == 1 && lda_t != 1 && !chained && !chunked && m <= t.mc &&
                        (lda_t % 256 == 0 || (lda_t >= 64 && static_cast<double>(m) * n * k >= 4194304.0));
    const int64_t ap_floats = pack_a ? n_ir * MR * kc_max : 0;
    const int64_t copy_floats = chunked ? chunk_depth * 2 * NR * n_ir * T + 16 : 0;  // items: at most n_ir x T
    auto scratch = s.pool.borrow(static_cast<size_t>(kc_max * bp_cols + m * ld_sums + copy_floats + ap_floats));
    float *bp = scratch.data(), *chain = chained || chunked ? bp + kc_max * bp_cols : nullptr;
    float *ap = pack_a ? bp + kc_max * bp_cols + m * ld_sums + copy_floats : nullptr;
    float *b_copy = chunked ? reinterpret_cast<float *>((reinterpret_cast<std::uintptr_t>(chain + m * ld_sums) + 63) / 64 * 64)
                            : nullptr;
    // One block of B, columns [jc, jc + NC) and depth [pc, pc + KC), against all the strips.
    auto block = [&](int64_t jc, int64_t pc) {
        const int64_t nc = std::min(nc_blk, n - jc);                // JC: a block of B that stays in L2
        const int64_t n_jr = ceil_div(nc, NR);
        const int64_t edge_nr = nc % NR;
        const int64_t kc = std::min(kc_blk, k - pc);                // PC: KC deep
        if (!b_direct)
            parallel_chunks(n_jr, T, [&](int64_t jr0, int64_t jr1) {
                const int64_t j0 = jr0 * NR, cols = std::min(nc, jr1 * NR) - j0;
                uk.pack_b(cols, kc, b.at(pc, jc + j0), b.cs, b.rs, bp + j0 * kc, s.inserts);
            });
        else if (edge_nr)  // only the panel cut by the edge: reading it in place would overrun B
            uk.pack_b(edge_nr, kc, b.at(pc, jc + (n_jr - 1) * NR), b.cs, b.rs, bp, s.inserts);

        const float beta = pc == 0 ? c.beta : 1.0f;
        // A few strips that do not divide among the threads (3 on 2), or any few strips
        // against B read in place tile by tile: the threads split the columns instead, each
        // taking every strip over its share of B, which it then reads once from memory and
        // keeps in its own L2. Xeon, 2 threads, B in place, GFLOP/s: strips shared out 2 + 1
        // -> strip x column-half items (B's halves moving between the cores) -> columns only:
        // 32x2000x1000 188 -> 215 -> 262 (dnnl_sgemm 240), 40x1536x512 279 -> 297 (items ->
        // columns), 32x640x640 284 -> 305, 96x2000x1000 292 -> 298. Strips that divide evenly,
        // one per thread (each reading all of B) -> columns: 16x1536x512 214 -> 250 (with the
        // 48-column tiles of 8-row strips; level before them), 16x2000x1000 186 -> 226,
        // 24x2000x1000 216 -> 269, 28x1536x512 273 -> 309, 16x640x640 level; but B in chunks
        // lost (16x1024x1024 202 -> 162: half the width a chunk row), so those keep a strip a
        // thread. AVX2 (6x16) on the same Xeon: 12x1536x512 125 -> 149, 12x2000x256, 24x2000x200
        // and 18x1000x300 level. With few columns to share (under 4 panels a thread) the items
        // stay strip x column share, whose count balances better. (Products of up to
        // few_strips_rows come here on one thread only now: on several, on_threads splits their
        // columns at the top. The measurements above chose for them before that.)
        const bool uneven = n_ir >= T && n_ir < 4 * T && (n_ir % T != 0 || (T > 1 && b_direct && !chunked));
        const bool by_columns = uneven && n_jr >= 4 * T;
        const int64_t ir_split = by_columns || (chunked && T == 1) ? 1 : std::min(n_ir, 4 * T);
        const int64_t jr_split = uneven ? std::min(n_jr, T) : n_ir < T ? std::min(n_jr, ceil_div(T, n_ir)) : 1;
        const int64_t ir_per = ceil_div(n_ir, ir_split), jr_per = ceil_div(n_jr, jr_split);
        parallel_items(ir_split * jr_split, T, [&](int64_t item) {
            const int64_t ir0 = item / jr_split * ir_per, ir1 = std::min(n_ir, ir0 + ir_per);
            const int64_t jr0 = item % jr_split * jr_per, jr1 = std::min(n_jr, jr0 + jr_per);
            if (ir0 >= ir1 || jr0 >= jr1) return;
            const int64_t i0 = strip_start(m, MR, ir0), rows = strip_start(m, MR, ir1) - i0;  // whole strips
            SupArgs args{rows, nc, kc, jr0, jr1, a.at(i0, pc), a.rs, a.cs, b_direct ? b.at(pc, jc) : nullptr,
                         b.rs, bp, kc, c.p + i0 * c.ld + jc, c.ld, c.alpha, beta,
                         chain ? chain + i0 * ld_sums : nullptr, ld_sums, sums_depth,
                         b_direct ? (n_jr - 1) * NR : 0, b_copy ? b_copy + item * chunk_depth * 2 * NR : nullptr};
            if (pack_a) {
                args.a = ap + ir0 * MR * kc;
                args.rs_a = 1;
                args.cs_a = MR;
                args.a_panel = MR * kc;
            }
            uk.macro_sup(args);
        });
    };
    if (pack_a) {
        // The depth blocks outermost, so A's strips are packed once for all the blocks of columns;
        // every element still takes its depth blocks in order.
        for (int64_t pc = 0; pc < k; pc += kc_blk) {
            const int64_t kc = std::min(kc_blk, k - pc);
            parallel_chunks(n_ir, T, [&](int64_t q0, int64_t q1) {
                const int64_t r0 = strip_start(m, MR, q0);
                uk.pack_a(strip_start(m, MR, q1) - r0, kc, a.at(r0, pc), a.rs, a.cs, ap + q0 * MR * kc, s.inserts);
            });
            for (int64_t jc = 0; jc < n; jc += nc_blk) block(jc, pc);
        }
        return;
    }
    for (int64_t jc = 0; jc < n; jc += nc_blk)
        for (int64_t pc = 0; pc < k; pc += kc_blk) block(jc, pc);
}

// Few rows against B^T (m <= the kernel's NR, or two full panels; alpha = 1, beta 0 or 1), B^T
// read in place and never packed: up to 9 rows on AVX-512 (8 on AVX2) B^T's rows are transposed
// in registers as they are read (macro_bt_rows); from 10 rows they are the microkernel's broadcast
// operand against A^T as packed panels, C^T = B^T A^T (macro_bt, one vector wide; macro_bt_wide
// past the lanes).
// Depth blocks as the other paths cut them, each added to C in order, so every element has the
// bits the other paths give it.
// Zen 5, 1 thread, against dnnl_sgemm, x 1536 x 512 NT, the transposing pack before -> macro_bt:
// 12 rows 1.08x -> 1.31x, 16 rows 1.19x -> 1.68x (16 x 4096 x 512 1.18x -> 1.71x); before ->
// macro_bt_rows: 1 row 0.41x -> 0.67x, 2 rows 0.34x -> 0.54x, 4 rows 0.63x -> 0.92x, 6 rows 0.74x
// -> 0.99x, 8 rows 0.92x -> 1.37x, 9 rows (macro_bt) 1.00x -> 1.21x; 1 x 4096 x 1024 0.25x ->
// 0.51x, 8 x 512 x 512 0.83x -> 1.18x. From 10 rows macro_bt_rows spills its registers (10 rows
// 0.56x). AVX2 (oneDNN on AVX2 too), 3-8 rows 1.01-1.22x faster than the transposing pack or
// macro_bt, 1-2 rows level: AVX2's 8 lanes all take macro_bt_rows, and its macro_bt is not reached.
// Past the lanes, up to the kernel's NR rows, A^T is one panel of NR (macro_bt_wide: the kernel's
// own MR x NR tile on B^T's rows), where the packed path would make a pass over B^T to transpose
// it; and NR + lanes or 2 NR rows (48 or 64 with 14x32) take two full panels, B^T read once for
// each. Intel Xeon (AMX), GFLOP/s packed -> wide (dnnl_sgemm), 1 thread: 24x1536x512 92 -> 107
// (96), 32x1536x512 105 -> 140 (107), 32x4096x1024 93 -> 135 (92), 32x1024x4096 93 -> 134 (93),
// 20x2048x2048 70 -> 85 (69), 17x1536x512 level (78 -> 79); 2 threads: 17x1536x512 77 -> 163,
// 24x1536x512 103 -> 222, 32x1536x512 110 -> 289, 32x4096x1024 180 -> 265. AVX2 (6x16), 1
// thread: 9x1536x512 50 -> 58, 12x1536x512 60 -> 77, 16x1536x512 66 -> 102, 16x4096x1024 56 -> 89.
// Two full panels, packed -> two passes, 1 thread: 48x1536x512 137 -> 145 (dnnl_sgemm 144),
// 48x4096x1024 125 -> 140 (127), 48x1024x4096 115 -> 130 (116), 64x1536x512 153 -> 171 (158),
// 64x4096x1024 132 -> 154 (135); 2 threads 48x1536x512 161 -> 291, 64x1536x512 268 -> 306; AVX2
// 24x1536x512 84 -> 97, 32x1536x512 88 -> 112. A part-used second panel lost (40 rows 130 -> 124,
// 56 rows 151 -> 148), and so did more panels (96 rows level, 128 rows 142 -> 139).
// A small B^T is another matter: packed, it stays in cache, and the pass costs little beside C^T's
// tiles, each stored across C's rows, whose number grows with n while the depth they share shrinks.
// So past the rows path, B^T of at most 64 x 64 (unless A^T's panel is one whole vector of rows),
// and two panels of depth 64 or less over a B^T of at most 128 KiB, take the usual paths. Intel
// Xeon (AMX), 1 thread, the usual path against this one, the same bits: 10x32x32 1.29x, 12x64x64
// 1.14x, 17x64x64 1.46x, 20x48x48 1.27x, 24x64x64 1.27x, 32^3 1.11x, 48^3 1.11x, 64^3 1.21x,
// 64x128x64 1.12x, 64x512x64 1.16x; AVX2 10x32x32 1.26x, 12x64x64 1.17x, 24x64x64 1.15x, 32^3
// 1.16x. Left here (the usual path's ratio): 16x64x64 0.94x (AVX2 0.92x), 16^3 0.86x, 32x128x64
// 0.92x, AVX2's 32x1536x64 0.92x, 64x256x256 0.93x; and, where the rule is coarse, 64x1536x64
// 1.09x and 64x64x128 1.12x.
bool sgemm_bt(RuntimeState &s, int64_t T, int64_t m, int64_t n, int64_t k, Operand a, Operand b, const Output &c) {
    const SgemmKernel &uk = *s.sgemm;
    // Past NR rows a second panel, so a second pass over B^T: only when its lanes are all used.
    const bool two_full = m - uk.nr == uk.lanes || m == 2 * uk.nr;
    if (b.rs != 1 || (m > uk.nr && !two_full) || c.alpha != 1.0f || (c.beta != 0.0f && c.beta != 1.0f)) return false;
    const bool rows_path = m <= (uk.lanes == 16 ? kBtRowsMax : 8);
    auto b_at_most = [&](int64_t floats) { return n <= floats && k <= floats && n * k <= floats; };  // (no overflow)
    if (!rows_path && m != uk.lanes && (b_at_most(64 * 64) || (m > uk.nr && k <= 64 && b_at_most(32 * 1024)))) return false;
    const int64_t kc_blk = depth_block(s.tiles, k);
    if (rows_path) {
        // A^T k x m, m floats a depth step (see bt_rows_tile): where A already lies so (one row of
        // A along k, or A^T with rows m apart), else copied. Each tile takes every depth block.
        const bool in_place = m == 1 ? a.cs == 1 : a.rs == 1 && a.cs == m;
        auto scratch = s.pool.borrow(static_cast<size_t>(in_place ? 1 : k * m));
        const float *at = a.p;
        if (!in_place) {
            float *dst = scratch.data();
            for (int64_t p = 0; p < k; ++p)
                for (int64_t i = 0; i < m; ++i) dst[p * m + i] = *a.at(i, p);
            at = dst;
        }
        const int64_t W = uk.lanes;
        parallel_chunks(ceil_div(n, W), T, [&](int64_t q0, int64_t q1) {
            const int64_t j0 = q0 * W, cols = std::min(n, q1 * W) - j0;
            uk.macro_bt_rows(m, cols, k, kc_blk, at, b.at(0, j0), b.cs, c.p + j0, c.ld, c.beta == 1.0f, s.inserts);
        });
        return true;
    }
    const int64_t MR = uk.mr;
    // A^T's panels: NR wide past the lanes, else one of the lanes; a second one (full) past NR rows.
    struct Panel {
        int64_t row = 0, rows = 0, width = 0;
        float *at = nullptr;
    } panels[2];
    const int64_t first = m > uk.lanes ? uk.nr : uk.lanes;
    panels[0] = {0, std::min(m, first), first};
    if (m > first) panels[1] = {first, m - first, m - first};
    const int count = m > first ? 2 : 1;
    // A^T's panels for the whole depth (a small multiple of A's size), so each tile walks every
    // depth block before the next and reads its rows of B^T from start to end in one go.
    auto scratch = s.pool.borrow(static_cast<size_t>(k * (panels[0].width + panels[1].width)));
    float *at = scratch.data();
    for (int q = 0; q < count; ++q) {
        Panel &pq = panels[q];
        pq.at = at;
        // One panel of A^T, its lanes past the rows zero: the packing's register transposes.
        (pq.width == uk.nr ? uk.pack_b : uk.pack_lanes)(pq.rows, k, a.at(pq.row, 0), a.rs, a.cs, at, s.inserts);
        at += k * pq.width;
    }
    parallel_chunks(ceil_div(n, MR), T, [&](int64_t q0, int64_t q1) {
        const int64_t j0 = q0 * MR, cols = std::min(n, q1 * MR) - j0;
        for (int q = 0; q < count; ++q) {
            const Panel &pq = panels[q];
            (pq.width > uk.lanes ? uk.macro_bt_wide : uk.macro_bt)(pq.rows, cols, k, kc_blk, b.at(0, j0), b.cs, pq.at,
                                                                   c.p + pq.row * c.ld + j0, c.ld, c.beta == 1.0f);
        }
    });
    return true;
}

// C = beta * C, for k == 0 or alpha == 0 (A and B are not read, as in BLAS).
void scale_c(int64_t m, int64_t n, float beta, float *c, int64_t ldc) {
    for (int64_t i = 0; i < m; ++i) {
        float *row = c + i * ldc;
        if (beta == 0.0f)
            std::fill(row, row + n, 0.0f);
        else
            for (int64_t j = 0; j < n; ++j) row[j] *= beta;
    }
}

// Up to how many rows of A a product reads B (not transposed, ldb floats a row) in place on the
// small-problem path rather than packing it first: one strip always (see sgemm). A few strips more
// read a large B once from memory and then from L2, where the packed path's pass over B (a
// memory stream with no arithmetic beside it) costs as much as the product at these heights.
// Intel Xeon (AMX), 1 thread, GFLOP/s packed -> in place (dnnl_sgemm), NN: 16x2000x1000 69 ->
// 100 (108), 32x2000x1000 99 -> 131 (131), 64x2000x1000 122 -> 140 (140), 96x2000x1000 136 ->
// 153 (144), 32x1536x512 103 -> 134 (130), 96x1536x512 150 -> 160 (147); narrower and shallower B
// alike: 64x128x2048 132 -> 157 (156), 96x384x768 147 -> 163 (155), 64x768x768 127 -> 147 (148),
// 100x640x640 138 -> 151 (139); A's rows 4 KiB apart too: 64x2000x1024 129 -> 143 (148),
// 32x1000x4096 102 -> 131 (142), 28x2000x2048 97 -> 135 (124), but 96x1536x2048 142 -> 136 (122).
// On 2 threads, up to 32 rows (strips that do not divide among the threads shared out by
// sgemm_sup): 16x2000x1000 142 -> 173, 16x1536x512 141 -> 189, 32x128x2048 165 -> 233,
// 24x768x768 182 -> 250, 32x640x640 207 -> 253, 32x2000x1000 198 -> 262 (dnnl_sgemm 240). AVX2
// (6x16) on the same Xeon, 1 thread: 16x2000x1000 59 -> 74, 32x2000x1000 78 -> 83, 32x1536x512 76
// -> 77, level at 64-96 rows.
// B's rows a multiple of 4 KiB apart map a panel's lines onto few sets of L1 and L2, and a tile
// walking its depth jumps a page a step; there the CPUs disagreed on tiles in place against the
// packed copy (this Xeon 16x1024x1024 68 -> 83 GFLOP/s, Zen 5 16x2048x2048 153 packed against 129
// in place, AVX2 on the Xeon 59 -> 45), so those rows read B in chunks of depth instead, up to
// few_strips_rows. Every path gives the same bits. These are the rows of a product on one thread,
// or of a share on one: on more threads, a product of up to few_strips_rows is split at the top
// (on_threads), and past them only a short depth or a narrow B takes the small-problem path.
int64_t in_place_rows(const RuntimeState &s, int64_t n, int64_t k, int64_t ldb) {
    const SgemmKernel &uk = *s.sgemm;
    if (ldb % 1024 == 0)  // rows a multiple of 4 KiB apart: in chunks, from memory (see sgemm_sup)
        return b_past_block(s.tiles, n, k) ? few_strips_rows(uk) : uk.mr;
    return uk.lanes == 16 ? 8 * uk.mr - 1 : std::max<int64_t>(uk.mr, 32);
}

} // namespace

PackedB pack_b(RuntimeState &s, int64_t k, int64_t n, const float *b, int64_t rs, int64_t cs) {
    const SgemmKernel &uk = *s.sgemm;
    PackedB p;
    p.kernel = uk.name;
    p.kc = k > 0 ? depth_block(s.tiles, k) : 0;
    p.k = k;
    p.n = n;
    p.nr = uk.nr;
    p.n_padded = round_up(n, uk.nr);
    p.data = detail::AlignedBuffer(static_cast<size_t>(std::max<int64_t>(1, k * p.n_padded)));
    if (k == 0 || n == 0) return p;  // nothing to pack
    s.arena->execute([&] {
        for (int64_t pc = 0; pc < k; pc += p.kc) {
            const int64_t kc = std::min(p.kc, k - pc), panels = p.n_padded / uk.nr;
            parallel_chunks(panels, s.num_threads, [&](int64_t j0, int64_t j1) {
                const int64_t col = j0 * uk.nr, cols = std::min(n, j1 * uk.nr) - col;
                uk.pack_b(cols, kc, b + pc * rs + col * cs, cs, rs, p.data.data() + pc * p.n_padded + col * kc, s.inserts);
            });
        }
    });
    return p;
}

// How many of the arena's threads a product of m x n x k pays for: its multiply-adds, 2 m n k
// FLOPs, or the time of B's stream where B comes from past L2 (RuntimeState::work_with_stream).
// That stream splits cleanly where each thread's share of the columns is a stretch of memory of
// its own (whole_rows: B^T's rows, or the packed panels). A B not transposed has every row cut
// between the threads, and there a second thread paid only for a larger B: it counts a quarter of
// its floats (a second thread from about 2.8 million of them, 11 MiB, for one row).
// Xeon (model 207), 2 threads against 1 (the multiply-adds alone), in one process, alternating
// calls, the same bits; back to back / after a 32 MiB pass on the calling thread / after 300 us of
// spinning (the worker asleep): 1x1536x512 NT 1.34-1.70x / 0.83-1.26x / 1.17-1.21x, packed
// 1.40-2.02x / 1.22-1.28x / 0.82-1.12x, 2x1024x1024 NT 1.89x / 1.44x / 1.53x; the suite's rows
// (mha-bench, 2 threads against 1): 1x1536x512 NT 1.23x, 8x1536x512 NT 1.46x, packed 1x1536x512
// 1.68x. Below the threshold (3/4 of a million floats of B, 2.7 MiB, for one row), 1x768x768
// packed 0.78-1.17x and 1x512x512 0.59x (waking the worker costs 30-50 us in this guest). B not
// transposed, one row, three processes each after the 32 MiB pass / after the spin: from 3M
// floats 1x1024x4096 1.40-1.46x / 1.38-1.42x, 1x4096x1024 1.72x / 1.73x, 1x2048x2048 1.67-1.69x /
// 1.64-1.67x, 1x1536x2048 1.42-1.44x / 1.48-1.49x, 1x3072x1024 1.64x / 1.44-1.62x; below it
// 1x1024x2048 0.77-1.31x / 0.77x, 1x2048x1024 0.82-1.43x / 1.47-1.48x, 1x1536x1024 1.16-1.25x /
// 1.09-1.20x, 1x1536x512 0.75-1.12x / 0.90-0.94x, 4x1536x512 0.78-1.37x.
int64_t product_threads(const RuntimeState &s, int64_t m, int64_t n, int64_t k, bool whole_rows) {
    const double b_floats = static_cast<double>(n) * static_cast<double>(k);
    const double flops = 2.0 * static_cast<double>(m) * b_floats;
    return s.threads_for(s.work_with_stream(flops, whole_rows ? b_floats : b_floats / 4), s.tiles.parallel_min_flops);
}

// Runs a product of m rows and n columns on T threads: fn(j0, cols, threads) computes columns
// [j0, j0 + cols) on that many. On one thread it runs right here on the calling thread, which
// saves entering the arena (several microseconds on a call of a few). A few strips (m <=
// few_strips_rows: 55 rows with 14x32, 32 with 6x16) on more threads are split by B's columns
// here, NR at a time, each thread taking its share over the whole depth on the one-thread path:
// the paths' own splits would fork and join once a depth block, and every thread would read all
// of a B that comes from memory, or share out three strips 2 + 1. A row's columns are
// independent, and every path gives an element the same bits. Xeon (model 207), 2 threads, the
// paths' splits -> these, in one process, back to back, the same bits: a strip, 6x2048x2048 NN
// 1.87x, 8x4096x4096 NN 1.15x, 14x2048x2048 NN 1.10x, 14x1536x512 NN 1.08x, 9x2048x2048 NT
// 1.04x, 4x4096x4096 NT 1.02x, 12x1536x512 NT 1.01x, 14x4096x1024 NT 1.01x; a few strips, paired
// medians back to back / after a 32 MiB pass: 16x1024x1024 NN 1.42x / 1.12x, 32x1024x1024 NN
// 1.16x / 1.11x, 48x1024x1024 NN 1.08x / 1.04x, 20x2048x2048 NN 1.26x / 1.22x, 32x2000x1000 NN
// 1.10x / 1.08x, 40x512x1024 NN 1.18x / 1.19x, 48x640x640 NN 1.18x / 1.15x, 16x1536x512 NN 1.05x /
// 1.10x, 55x1536x512 NT 1.27x / 1.17x, 32x1024x4096 NT 1.07x / 1.06x, 16x768x768 NT 1.04x / 1.08x,
// 16-32 x 1536 x 512 NT and packed B (16-55 rows) level (0.99-1.05x); AVX2 (6x16): 12x1536x512
// NN 1.12x, 24x1024x1024 NN 1.16x, 18x2000x1000 NN 1.33x, 32x1024x1024 NN level. Past them it
// stopped paying: 64x1536x512 NN 1.04-1.07x but 64x1024x1024 NN 0.98-1.02x, 112x1536x512 NT
// 0.96-0.99x, 128x1536x512 NN 0.96-1.00x, 256x512x512 NT 0.95-1.00x. (More chunks than threads,
// 4 a thread, gained nothing for a strip: 1x1536x512 NT and packed level, NN 0.86-0.94x.)
template <class Fn>
void on_threads(RuntimeState &s, int64_t T, int64_t m, int64_t n, const Fn &fn) {
    if (T == 1) return fn(int64_t{0}, n, int64_t{1});
    s.arena->execute([&] {
        if (m > few_strips_rows(*s.sgemm)) return fn(int64_t{0}, n, T);
        const int64_t NR = s.sgemm->nr;
        parallel_chunks(ceil_div(n, NR), T, [&](int64_t q0, int64_t q1) {
            fn(q0 * NR, std::min(n, q1 * NR) - q0 * NR, int64_t{1});
        });
    });
}

// Refuses a B packed for another microkernel or depth blocking than the runtime's (`what`: the
// operand in the message, `remedy`: what to do about it).
void check_packed_for(const RuntimeState &s, const PackedB &b, const char *what, const char *remedy) {
    if (b.kernel != s.sgemm->name || (b.k > 0 && b.kc != depth_block(s.tiles, b.k)))
        invalid_argument(std::string(what) + " were packed for microkernel " + b.kernel + " with depth blocks of " +
                         std::to_string(b.kc) + ", but this runtime uses " + s.sgemm->name + " with " +
                         std::to_string(depth_block(s.tiles, std::max<int64_t>(b.k, 1))) + " (kc = " +
                         std::to_string(s.tiles.kc) + "); " + remedy);
}

void sgemm_prepacked(RuntimeState &s, int64_t m, int64_t n, const float *a, int64_t lda, const PackedB &b, int64_t j0,
                     const float *bias, float *c, int64_t ldc, Epilogue act, bool one_thread) {
    check_packed_for(s, b, "the weights", "build the layer with a runtime of the same ISA and tile config");
    if (m == 0 || n == 0) return;
    on_threads(s, one_thread ? 1 : product_threads(s, m, n, b.k, true), m, n, [&](int64_t j, int64_t cols, int64_t T) {
        sgemm_packed(s, T, m, cols, b.k, Operand{a, lda, 1}, Operand{nullptr, 0, 0},
                     Output{c + j, ldc, 1.0f, 0.0f, bias ? bias + j : nullptr, act}, Prepacked{&b, j0 + j});
    });
}

// The leading dimension to step a stored matrix by, op(X) being rows x cols (X stored as is for
// N, transposed for T). A stored matrix of one row never uses its leading dimension, which may
// then be anything up to INT64_MAX / 4; but the kernels step their pointers by it (past the end
// after the last row), and such a step overflows the address space. The row's width serves the
// same (same bits).
int64_t stored_ld(Trans t, int64_t rows, int64_t cols, int64_t ld) {
    const bool n = t == Trans::N;
    return (n ? rows : cols) == 1 ? (n ? cols : rows) : ld;
}

void check_trans(const char *name, Trans t) {
    if (t != Trans::N && t != Trans::T)
        invalid_argument(std::string(name) + " must be 'N' or 'T', got '" + std::string(1, static_cast<char>(t)) + "'");
}

void check_sgemm_args(Trans transa, Trans transb, int64_t m, int64_t n, int64_t k, const float *a,
                      int64_t lda, const float *b, int64_t ldb, const float *c, int64_t ldc) {
    check_trans("transa", transa);
    check_trans("transb", transb);
    check_size("m", m);
    check_size("n", n);
    check_size("k", k);
    const bool ta = transa == Trans::T, tb = transb == Trans::T;
    const bool reads_ab = m > 0 && n > 0;  // with m or n zero, nothing is computed
    check_matrix("a", "lda", a, ta ? k : m, ta ? m : k, lda, reads_ab);
    check_matrix("b", "ldb", b, tb ? n : k, tb ? k : n, ldb, reads_ab);
    check_matrix("c", "ldc", c, m, n, ldc);
}

} // namespace gemm

void sgemm(Runtime &rt, Trans transa, Trans transb, int64_t m, int64_t n, int64_t k, float alpha,
           const float *a, int64_t lda, const float *b, int64_t ldb, float beta, float *c, int64_t ldc) {
    using namespace gemm;
    check_sgemm_args(transa, transb, m, n, k, a, lda, b, ldb, c, ldc);
    if (m == 0 || n == 0) return;
    if (k == 0 || alpha == 0.0f) return scale_c(m, n, beta, c, ldc);
    lda = stored_ld(transa, m, k, lda);
    ldb = stored_ld(transb, k, n, ldb);
    ldc = stored_ld(Trans::N, m, n, ldc);
    auto &s = rt.state();
    const Operand A = transa == Trans::N ? Operand{a, lda, 1} : Operand{a, 1, lda};
    const Operand B = transb == Trans::N ? Operand{b, ldb, 1} : Operand{b, 1, ldb};
    // One strip of rows (m <= MR) streams B exactly once: read in place, not packed first (the
    // packing would be a pass of its own over all of B). Zen 5, 1 thread, packed -> in place:
    // 1x1000x1000 19 -> 41 GFLOP/s, 8x1000x1000 121 -> 237, 8x1536x1536 124 -> 244, 1x4096x1024
    // 18 -> 31, 4x4096x1024 68 -> 105, 12x4096x1024 136 -> 182, 12x2048x2048 136 -> 169; with two
    // strips each reads B again, and there the packed copy can win (16x2048x2048 153 vs 129).
    // AVX2 (MR 6) too, since B rows 4 KiB apart are read in chunks (see sgemm_sup), against
    // dnnl_sgemm on AVX2: 2x1000x1000 0.53x -> 0.98x, 6x1000x1000 0.62x -> 0.98x, 4x3000x1000
    // 0.56x -> 0.99x, 3x2000x2000 0.46x -> 0.73x, 2x2048x2048 1.45x -> 3.6x, 6x2048x2048 1.10x ->
    // 1.56x, level at 2-6x1536x512 (before the chunks, 3 and 6 rows at an 8 KiB stride lost).
    // A few strips more read B in place too, on this Xeon's measurements (in_place_rows): the
    // second strip finds B in L2, where packing it would be the pass over memory all the same.
    // A short depth (k <= KC) alone picks the small-problem path for a call on one thread. For a
    // call that takes more, only attention's depths (k <= 128) or a few strips (under 8) do: its
    // B block is packed by all the threads together and read by all of them, each core fetching
    // the other's half, where the packed path gives each thread a B block of its own. Xeon (AMX),
    // 2 threads, the same bits, small-problem -> packed path: 128x1536x512 NT 1.41x (NN 1.30x),
    // 112x1536x512 1.27x, 256x1536x512 NT 1.16x, 512x1536x512 1.16x, 1024x1536x512 NT 1.11x,
    // 4096x1536x512 NT 1.03x, 1024x1024x512 1.11x, 512^3 1.08x, 384^3 1.15x, 256^3 1.09x,
    // 200x300x256 1.19x, 1024x1024x256 1.03x, TN 1024x1536x512 1.06x, TT 512^3 1.03x, TN 512^3
    // level; but k <= 128 0.97-1.00x (512x512x64 NT, 2048x2048x64 NT, 1024x1024x128 NT) and 96 or
    // 64 rows 0.98-1.02x. AVX2 (6x16), 2 threads: 128x1536x512 1.26x, 4096x512x512 NT 1.12x,
    // 512x1536x512 NT 1.06x, 384^3 1.06x, 1024x1024x256 1.06x, 512^3 1.05x. One thread: level
    // (AVX-512 0.995-1.006x, AVX2 1.01-1.02x), so it keeps the rule.
    on_threads(s, product_threads(s, m, n, k, transb == Trans::T), m, n, [&](int64_t j, int64_t cols, int64_t T) {
        const bool one_thread = T == 1;
        const bool short_depth = k <= s.tiles.sup_max_k && (one_thread || k <= 128 || m < 8 * s.sgemm->mr);
        const bool sup = cols <= s.tiles.sup_max_n || short_depth ||
                         (transb == Trans::N && one_thread && m <= in_place_rows(s, n, k, ldb));
        const Operand Bj{B.at(0, j), B.rs, B.cs};
        const Output Cj{c + j, ldc, alpha, beta};
        if (transb == Trans::T && sgemm_bt(s, T, m, cols, k, A, Bj, Cj)) return;
        sup ? sgemm_sup(s, T, m, cols, k, A, Bj, Cj, n) : sgemm_packed(s, T, m, cols, k, A, Bj, Cj);
    });
}

SgemmPackedB::SgemmPackedB(Runtime &rt, Trans transb, int64_t k, int64_t n, const float *b, int64_t ldb) {
    using namespace gemm;
    check_trans("transb", transb);
    check_size("k", k);
    check_size("n", n);
    const bool tb = transb == Trans::T;
    check_matrix("b", "ldb", b, tb ? n : k, tb ? k : n, ldb, k > 0 && n > 0);
    auto &s = rt.state();
    // The packed copy holds k x round_up(n, NR) floats: refuse what no allocation could hold.
    int64_t floats = 0;
    if (n > INT64_MAX - s.sgemm->nr || __builtin_mul_overflow(k, round_up(n, s.sgemm->nr), &floats) ||
        floats > INT64_MAX / 8)
        invalid_argument("b: " + std::to_string(k) + " x " + std::to_string(n) + " packed overflows the address space");
    ldb = stored_ld(transb, k, n, ldb);
    packed_ = std::make_unique<PackedB>(pack_b(s, k, n, b, tb ? 1 : ldb, tb ? ldb : 1));
}

SgemmPackedB::~SgemmPackedB() = default;
SgemmPackedB::SgemmPackedB(SgemmPackedB &&) noexcept = default;
SgemmPackedB &SgemmPackedB::operator=(SgemmPackedB &&) noexcept = default;
const gemm::PackedB &SgemmPackedB::packed() const {
    if (!packed_) invalid_argument("the SgemmPackedB was moved from: it holds no packed B");
    return *packed_;
}
int64_t SgemmPackedB::k() const { return packed().k; }
int64_t SgemmPackedB::n() const { return packed().n; }
size_t SgemmPackedB::bytes() const { return packed().data.size() * sizeof(float); }

void sgemm(Runtime &rt, Trans transa, int64_t m, float alpha, const float *a, int64_t lda, const SgemmPackedB &b,
           float beta, float *c, int64_t ldc) {
    using namespace gemm;
    const PackedB &p = b.packed();
    const int64_t n = p.n, k = p.k;
    check_trans("transa", transa);
    check_size("m", m);
    const bool ta = transa == Trans::T;
    check_matrix("a", "lda", a, ta ? k : m, ta ? m : k, lda, m > 0 && n > 0);
    check_matrix("c", "ldc", c, m, n, ldc);
    auto &s = rt.state();
    check_packed_for(s, p, "B's panels", "pack B with a runtime of the same ISA and tile config");
    if (m == 0 || n == 0) return;
    if (k == 0 || alpha == 0.0f) return scale_c(m, n, beta, c, ldc);
    lda = stored_ld(transa, m, k, lda);
    ldc = stored_ld(Trans::N, m, n, ldc);
    const Operand A = ta ? Operand{a, 1, lda} : Operand{a, lda, 1};
    on_threads(s, product_threads(s, m, n, k, true), m, n, [&](int64_t j, int64_t cols, int64_t T) {
        sgemm_packed(s, T, m, cols, k, A, Operand{nullptr, 0, 0}, Output{c + j, ldc, alpha, beta}, Prepacked{&p, j});
    });
}

} // namespace mha
