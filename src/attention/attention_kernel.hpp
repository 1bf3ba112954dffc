// The fused attention of one work item, written once over an xsimd architecture and the GEMM
// microkernel shape (FlashAttention, Dao et al. 2022, on the GEMM microkernels and the online
// softmax). Include only from an ISA's translation unit.
//
// The rows of every head that shares one KV head are stacked into one block of M rows, so each
// packed K and V tile serves the whole group (GQA/MQA without copies). For each key tile, K^T
// is packed (V too, or see pv_copy), then each register panel of MR rows goes through
//   S = scale (Q K^T)        the GEMM microkernel (alpha = scale) on Q's rows (see q_in_place)
//                            or Q's panels (see q_panels), and K^T's packed panels
//   masks -> -inf            causal, valid length and the boolean mask, from their compact forms
//   online softmax fold      S becomes P; running max/sum; the accumulator is rescaled
//   acc += P V               the microkernel again, P read in place (V's rows not yet in its
//                            packed tile read in place and copied there; see pv_copy)
// while its MR x block_k scores are still in L1. Keys that no row of a panel can see are never
// computed, nor whole tiles that no row of the item can see. The Lq x Lk matrix never exists.
// Items with few rows per KV head (Item::direct: decode) hold every KV head of their sequence and
// walk K and V a few tokens at a time (see DirectTiles), packing no V.
//
// One arithmetic for every path, so a row's bits depend on nothing but its own inputs: a score is
// the microkernel's ordered FMA chain over the head dimension (K read from a packed panel: packed
// here, or as the KV cache stores it), times the scale; key tiles start at multiples of block_k
// and chunks at multiples of kv_chunk (absolute positions); the fold's sums ignore -inf past a
// row's keys (see RowKernels::exp_store_sum); and P V adds each tile's ordered FMA chain, started
// from zero, to the rescaled accumulator. K and V come from dense tensors (ragged or not) or from
// the paged cache (Shape::kv_cache).
//
// In place (out == q, see attention.hpp): an item writes a query row's output only after its last
// read of that row's Q (a panel's output after its last key tile's Q K^T, or finish() after every
// chunk; Q packed or copied before any output otherwise), and an item's output columns are its
// own heads' Q columns, which no other item reads. The weights' pass, which reads Q again after
// finish(), is refused in place.
#pragma once

#include <algorithm>
#include <utility>
#include <cmath>
#include <limits>
#include <numeric>

#include "attention/attention_shape.hpp"
#include "attention/cache_i8.hpp"
#include "attention/direct_tiles.hpp"
#include "attention/score_modifiers.hpp"
#include "gemm/sgemm_macro.hpp"
#include "softmax/softmax_kernels.hpp"

namespace mha::attention_detail {
namespace {

inline int64_t round_up_to(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// The scratch layout of one item: the larger of what a packed and a direct item need.
struct ItemScratch {
    float *q_rows, *q_packed, *k_packed, *v_packed, *s, *m, *l, *acc, *cm, *cl, *cacc, *t;
    // Where Q K^T reads the item's Q rows (set by pack_q): the caller's Q in place, or q_rows; or
    // NULL: from q_packed, one MR-row panel per register panel of the item (see q_panels).
    const float *q_read = nullptr;
    int64_t q_ld = 0;
    static constexpr int kParts = 12;
    static void kind_sizes(const Shape &s, bool direct, int mr, int nr, int64_t out[kParts]) {
        const int64_t BK = s.block_k, D = s.head_dim, Dv = s.value_dim;
        // Rows: a query block of the group's heads, or every KV head's rows of a direct item.
        const int64_t M = direct ? s.kv_heads * kDirectRows : s.group() * s.block_q;
        // every tile of a strip, a window's ring of them, or one
        const int64_t tiles = s.cache_kv ? (s.kv_ring ? s.kv_ring : (s.kv_len + BK - 1) / BK) : 1;
        out[0] = M * D;                                                   // q_rows: Q rows, row-major
        // q_packed: MR-row panels (per KV head), or a direct item's Q^T, rows padded to 16
        out[1] = direct ? s.kv_heads * round_up_to(kDirectRows, std::max(mr, 16)) * D : round_up_to(M, mr) * D;
        out[2] = direct ? 0 : tiles * round_up_to(BK, nr) * D;            // k_packed: K^T in NR-column panels
        out[3] = direct ? 0 : tiles * BK * round_up_to(Dv, nr);           // v_packed: V in NR-column panels
        out[4] = M * BK;                                                  // s: scores, then probabilities
        out[5] = out[6] = M;                                              // m, l: running max and sum
        out[7] = M * Dv;                                                  // acc: output accumulator
        out[8] = out[9] = M;                                              // cm, cl, cacc: the state of one key chunk
        out[10] = M * Dv;
        out[11] = direct ? M * Dv : 0;                                    // t: a direct tile's P V
    }
    static int64_t sizes(const Shape &s, int mr, int nr, int64_t out[kParts]) {
        int64_t packed[kParts], direct[kParts];
        kind_sizes(s, false, mr, nr, packed);
        kind_sizes(s, true, mr, nr, direct);
        int64_t total = 0;
        for (int i = 0; i < kParts; ++i) {
            out[i] = std::max(packed[i], direct[i]);
            total += round_up_to(out[i], 16);  // keep each part 64-byte aligned
        }
        return total;
    }
    ItemScratch(const Shape &s, int mr, int nr, float *base) {
        int64_t sz[kParts];
        sizes(s, mr, nr, sz);
        float **parts[kParts] = {&q_rows, &q_packed, &k_packed, &v_packed, &this->s, &m, &l, &acc, &cm, &cl, &cacc, &t};
        for (int i = 0; i < kParts; ++i) {
            *parts[i] = base;
            base += round_up_to(sz[i], 16);
        }
    }
};

template <class Arch, int MR, int NV>
struct FusedAttention {
    static constexpr int W = static_cast<int>(xsimd::batch<float, Arch>::size);
    static constexpr int NR = NV * W;
    using Rows = softmax_detail::RowKernels<Arch>;
    static constexpr float kNegInf = -std::numeric_limits<float>::infinity();

    using Mods = ScoreModifiers<Arch>;
    using I8 = CacheI8<Arch, MR, NV>;

    // Packed K and V tiles of a packed item. Without the strip cache each key step packs its tiles
    // again; with it (one strip = all query blocks of a (batch, KV head) on one thread) each tile is
    // packed once, the first time a query block needs it, and reused by the later blocks; with a
    // window only the tiles its blocks' windows span, in a ring (Shape::kv_ring, TileRing). From
    // the paged KV cache, K is read where it lies (already in panels) and only V is packed.
    struct KVTiles {
        int64_t end = 0;             // strip cache: keys the strip needs at most; tiles are packed this wide
        TileRing k_tiles, v_tiles;   // strip cache: the tiles held
        int64_t width(const Shape &s, int64_t j0, int64_t n) const {
            return s.cache_kv ? std::min(s.block_k, end - j0) : n;
        }
        const float *k(const Shape &s, const float *k, const Item &it, int64_t j0, int64_t n, const ItemScratch &w) {
            if (s.kv_cache && !s.kv_cache->i8) return nullptr;  // panel_scores reads the cache's panels
            if (s.kv_cache) {  // int8: the tile's panels widened once, block by block
                for (int64_t j = 0, run; j < n; j += run) {
                    run = std::min(n - j, s.kv_cache->run(j0 + j));
                    I8::widen_k(*s.kv_cache, it.b, it.g, j0 + j, run, s.head_dim, w.k_packed + j * s.head_dim);
                }
                return w.k_packed;
            }
            const int64_t D = s.head_dim, t = j0 / s.block_k;
            float *dst = w.k_packed + (s.cache_kv ? TileRing::slot(s.kv_ring, t) * round_up_to(s.block_k, NR) * D : 0);
            if (!s.cache_kv || !k_tiles.holds(t)) {
                gemm::pack_panels<Arch, NR>(width(s, j0, n), D, k + s.kv_row(it.b, j0) * s.ldk + it.g * D, s.ldk, 1,
                                            dst, s.inserts);
                k_tiles.packed(s.kv_ring, t);
            }
            return dst;
        }
        // A V tile left to the register panels' P V, which copy it as they read V in place (see
        // chunk and pv_copy): a dense tile of whole NR-column panels that must be packed now (not
        // held by the strip cache), marked held. Where its panels go, their depth, and its rows
        // in V; dst = nullptr for any other tile (see v()).
        struct VTile {
            float *dst = nullptr;
            int64_t depth = 0;
            const float *rows = nullptr;
        };
        VTile v_deferred(const Shape &s, const float *v, const Item &it, int64_t j0, int64_t n, const ItemScratch &w) {
            const int64_t Dv = s.value_dim, t = j0 / s.block_k;
            if (s.kv_cache || Dv % NR != 0 || (s.cache_kv && v_tiles.holds(t))) return {};
            v_tiles.packed(s.kv_ring, t);
            return {v_slot(s, t, w), width(s, j0, n), v + s.kv_row(it.b, j0) * s.ldv + it.g * Dv};
        }
        // Where key tile t's packed V goes: its ring slot with the strip cache, else the one tile.
        static float *v_slot(const Shape &s, int64_t t, const ItemScratch &w) {
            return w.v_packed + (s.cache_kv ? TileRing::slot(s.kv_ring, t) * s.block_k * round_up_to(s.value_dim, NR) : 0);
        }
        // The packed V tile and the depth its panels were packed with (their stride).
        std::pair<const float *, int64_t> v(const Shape &s, const float *v, const Item &it, int64_t j0, int64_t n,
                                            const ItemScratch &w) {
            const int64_t Dv = s.value_dim, t = j0 / s.block_k, depth = width(s, j0, n);
            float *dst = v_slot(s, t, w);
            if (s.kv_cache) {
                const CacheView &c = *s.kv_cache;
                for (int64_t j = 0, run; j < depth; j += run) {  // the cache's panels, block by block
                    run = std::min(depth - j, c.run(j0 + j));
                    if (c.i8) {
                        I8::widen_v(c, it.b, it.g, j0 + j, run, Dv, depth, j, dst);
                        continue;
                    }
                    const float *src = c.v_panels(it.b, it.g, j0 + j);
                    for (int64_t p = 0; p < Dv; p += NR)
                        std::copy(src + p / NR * c.v_panel, src + p / NR * c.v_panel + run * NR, dst + p * depth + j * NR);
                }
            } else if (!s.cache_kv || !v_tiles.holds(t)) {
                gemm::pack_panels<Arch, NR>(Dv, depth, v + s.kv_row(it.b, j0) * s.ldv + it.g * Dv, 1, s.ldv, dst, s.inserts);
                v_tiles.packed(s.kv_ring, t);
            }
            return {dst, depth};
        }
    };

    // The rows of a packed item in register panels of nearly equal height (128 rows: 8 x 13 + 2 x
    // 12, not 9 x 14 + 2): a panel of a few rows has too few independent sums to keep the FMA
    // units busy. A row's sums do not depend on the panel it is in.
    struct Panels {
        int64_t count, base, tall;  // panels; rows in each; how many of them (the first) have one more
        explicit Panels(int64_t M)
            : count(std::max<int64_t>(1, (M + MR - 1) / MR)), base(M / count), tall(M % count) {}
        int64_t rows(int64_t p) const { return base + (p < tall ? 1 : 0); }
    };

    // A panel's first computed key within a tile is a multiple of this: a K panel's start, and a
    // whole group of the fold's four sum vectors, so each visible key's exp joins the same
    // partial sum as when the panel starts at the tile's first key.
    static constexpr int64_t kFirstAlign = std::lcm(int64_t{NR}, int64_t{4 * W});

    // How many keys of the tile [j0, j0 + n) any row of the register panel starting at row r0 may
    // see. Past it a panel's scores are never computed and its P is zero, so the products skip
    // it: on causal diagonals that is most of the triangle. `first` (if asked): the keys before
    // it, rounded down to kFirstAlign, are before every row's window, and are skipped alike (their
    // P would be 0, adding exact zeros to the sums and to P V's chains).
    static int64_t panel_keys(const Shape &s, const Item &it, int64_t rows_per_head, int64_t r0, int64_t r1, int64_t j0,
                              int64_t n, int64_t *first_key = nullptr) {
        int64_t lim = 0, first = n;
        for (int64_t r = r0; r < r1; ++r) {
            const int64_t i = it.i0 + r % rows_per_head;
            lim = std::max(lim, s.key_limit(it.b, i) - j0);
            first = std::min(first, s.key_start(it.b, i) - j0);
        }
        lim = std::min(lim, n);
        if (first_key) *first_key = first >= lim || first <= 0 ? 0 : first / kFirstAlign * kFirstAlign;
        // A tile wholly before every row's window shows the panel nothing either.
        return first >= lim ? 0 : lim;
    }

    // S[0:M, 0:n] = scores of keys [j0, j0 + n) for the item's rows, masked (-inf where unseen).
    static void scores(const Shape &s, const float *k, const Item &it, int64_t M, int64_t rows_per_head, int64_t j0,
                       int64_t n, const ItemScratch &w, KVTiles &kv) {
        if (it.direct) {
            const int64_t cols = direct_scores(s, k, it, M, rows_per_head, j0, n, w);
            for (int64_t r = 0; r < M; ++r) std::fill(w.s + r * s.block_k + cols, w.s + r * s.block_k + n, kNegInf);
            return;
        }
        const float *kp = kv.k(s, k, it, j0, n, w);
        for (int64_t r0 = 0; r0 < M; r0 += MR) {
            int64_t first = 0;
            const int64_t r1 = std::min(M, r0 + MR), cols = panel_scores(s, kp, it, r0, r1, rows_per_head, j0, n, w, w.s + r0 * s.block_k, first);
            for (int64_t r = r0; r < r1; ++r) {
                std::fill(w.s + r * s.block_k, w.s + r * s.block_k + first, kNegInf);
                std::fill(w.s + r * s.block_k + cols, w.s + r * s.block_k + n, kNegInf);
            }
        }
    }

    // Tokens per step of a direct item: on dense K and V, a few tokens' rows whole (see
    // kDirectKeys); from the cache, what is left of the block.
    static int64_t direct_step(const Shape &s, int64_t j, int64_t left) {
        return std::min(left, s.kv_cache ? s.kv_cache->run(j) : kDirectKeys);
    }

    // Floats per row of a direct item's transposed Q (dense K): its rows, padded to whole vectors.
    static int64_t direct_ldqt(int64_t Mg) { return round_up_to(Mg, W); }

    // The direct path's scores, masked: per KV head, its G x rows_per_head rows against the keys,
    // K read in place (dense: DirectTiles; cache: the microkernel on the cache's K panels). Returns
    // how many of the tile's keys the rows may see (every head's rows see the same keys); scores
    // past them are not written.
    static int64_t direct_scores(const Shape &s, const float *k, const Item &it, int64_t M, int64_t rows_per_head,
                                 int64_t j0, int64_t n, const ItemScratch &w) {
        const int64_t D = s.head_dim, Mg = s.group() * rows_per_head;
        const int64_t cols = panel_keys(s, it, rows_per_head, 0, rows_per_head, j0, n);
        for (int64_t j = 0, step; j < cols; j += step) {
            step = direct_step(s, j0 + j, cols - j);
            for (int64_t h = 0; h < it.kv_heads; ++h) {
                float *sh = w.s + h * Mg * s.block_k + j;
                if (s.kv_cache && s.kv_cache->i8) {
                    const CacheView &c = *s.kv_cache;
                    const float *qh = w.q_packed + h * round_up_to(Mg, MR) * D;
                    // After the tile's last K, its first V.
                    const int8_t *next = next_i8(it, h, j0 + j, step, j0 + cols,
                                                 [&](int64_t g, int64_t key) { return c.k_panels_i8(it.b, g, key, D); },
                                                 c.v_panels_i8(it.b, it.g, j0));
                    for (int64_t q = 0, n_strips = gemm::strip_count(Mg, MR); q < n_strips; ++q) {  // as pack_q packed them
                        const int64_t r0 = gemm::strip_start(Mg, MR, q);
                        I8::scores_i8(gemm::strip_start(Mg, MR, q + 1) - r0, step, D, s.scale, qh + q * MR * D,
                                  c.k_panels_i8(it.b, it.g + h, j0 + j, D), c.k_scales(it.b, it.g + h, j0 + j),
                                  sh + r0 * s.block_k, s.block_k, next);
                    }
                } else if (s.kv_cache) {
                    gemm::sgemm_macro_packed<Arch, MR, NV>(Mg, step, D, w.q_packed + h * round_up_to(Mg, MR) * D,
                                                           s.kv_cache->k_panels(it.b, it.g + h, j0 + j, D), sh,
                                                           s.block_k, s.scale, 0.0f);
                }
                else
                    DirectTiles<Arch>::scores(Mg, step, D, s.scale, w.q_packed + h * direct_ldqt(Mg) * D, direct_ldqt(Mg),
                                              k + s.kv_row(it.b, j0 + j) * s.ldk + (it.g + h) * D, s.ldk, sh,
                                              s.block_k);
            }
        }
        mask_rows(s, it, 0, M, rows_per_head, j0, 0, cols, w.s);
        return cols;
    }

    // Where the int8 read after KV head h's step of keys [key, key + step) starts (cols_end: the
    // tile's end): the same block's next KV head, else the next block's first (panels(g, key)
    // gives a head's K or V there), else `after`. The direct path asks for its lines one call ahead.
    template <class Panels>
    static const int8_t *next_i8(const Item &it, int64_t h, int64_t key, int64_t step, int64_t cols_end,
                                 const Panels &panels, const int8_t *after) {
        return h + 1 < it.kv_heads ? panels(it.g + h + 1, key) : key + step < cols_end ? panels(it.g, key + step) : after;
    }

    // acc += P V for a direct item's tile of `cols` keys: the tile's sum runs from zero, keys in
    // order, V rows read in place a step of tokens at a time for every KV head (between steps in
    // t), and the last step adds it to acc. The next tile (if any) starts at key `next_tile`; an
    // int8 cache's reads are asked for one call ahead across the jumps between heads, blocks and
    // tiles (see CacheI8::scores_i8_rows).
    static void direct_accumulate(const Shape &s, const float *v, const Item &it, int64_t rows_per_head, int64_t j0,
                                  int64_t cols, int64_t next_tile, int64_t end, const ItemScratch &w, float *acc) {
        const int64_t Dv = s.value_dim, Mg = s.group() * rows_per_head;
        for (int64_t j = 0, step; j < cols; j += step) {
            step = direct_step(s, j0 + j, cols - j);
            const bool fresh = j == 0, last = j + step == cols;
            for (int64_t h = 0; h < it.kv_heads; ++h) {
                float *into = last ? acc + h * Mg * Dv : nullptr;
                // Dense V rows (columns contiguous), or the cache's NR-column panels.
                const CacheView *c = s.kv_cache;
                float *ph = w.s + h * Mg * s.block_k + j;
                if (c && c->i8) {  // P times the values' scales, against the stored integers
                    I8::scale_keys_i8(*c, true, it.b, it.g + h, j0 + j, step, ph, 0, Mg, s.block_k);
                    const typename DirectTiles<Arch>::Columns cols_of{NR, NR, c->v_panel};
                    // After the tile's last V, the next tile's first K (if any).
                    const int8_t *here = c->v_panels_i8(it.b, it.g + h, j0 + j);
                    const int8_t *next = next_i8(it, h, j0 + j, step, j0 + cols,
                                                 [&](int64_t g, int64_t key) { return c->v_panels_i8(it.b, g, key); },
                                                 next_tile < end ? c->k_panels_i8(it.b, it.g, next_tile, s.head_dim) : here);
                    DirectTiles<Arch>::accumulate(Mg, step, Dv, ph, s.block_k, here, cols_of, w.t + h * Mg * Dv, fresh,
                                                  into, next);
                    continue;
                }
                const float *vr = c ? c->v_panels(it.b, it.g + h, j0 + j)
                                    : v + s.kv_row(it.b, j0 + j) * s.ldv + (it.g + h) * Dv;
                const typename DirectTiles<Arch>::Columns cols_of{c ? NR : s.ldv, c ? int64_t{NR} : W,
                                                                  c ? c->v_panel : W};
                DirectTiles<Arch>::accumulate(Mg, step, Dv, ph, s.block_k, vr, cols_of, w.t + h * Mg * Dv, fresh, into);
            }
        }
    }

    // Rows [r0, r1) of S (one register panel) against the tile's K panels, masked, into the rows
    // from sp on (block_k apart). Returns how many of the tile's keys the panel may see, and in
    // `first` how many before them it skips (see panel_keys): only keys [first, cols) are computed
    // and masked (the rest would all be -inf).
    static int64_t panel_scores(const Shape &s, const float *kp, const Item &it, int64_t r0, int64_t r1,
                                int64_t rows_per_head, int64_t j0, int64_t n, const ItemScratch &w, float *sp,
                                int64_t &first, const float *q_panel = nullptr) {
        const int64_t cols = panel_keys(s, it, rows_per_head, r0, r1, j0, n, &first), D = s.head_dim;
        if (cols == 0) return 0;
        // Q's rows are read where pack_q put them (see q_in_place and q_panels): the panel packed
        // for these rows, or its rows in place; the microkernel's sums are the same either way,
        // and a score is its chain times the scale.
        const float *qr = q_panel ? nullptr : w.q_read + r0 * w.q_ld;
        auto scores = [&](int64_t n_keys, const float *panels, float *dst) {
            if (q_panel)
                return gemm::sgemm_macro_packed<Arch, MR, NV>(r1 - r0, n_keys, D, q_panel, panels, dst, s.block_k, s.scale,
                                                              0.0f);
            gemm::sgemm_macro_sup<Arch, MR, NV>(gemm::SupArgs{r1 - r0, n_keys, D, 0, (n_keys + NR - 1) / NR, qr, w.q_ld,
                                                              1, nullptr, 0, panels, D, dst, s.block_k, s.scale, 0.0f});
        };
        if (s.kv_cache && !s.kv_cache->i8) {  // the cache's panels, block by block
            for (int64_t j = first, run; j < cols; j += run) {
                run = std::min(cols - j, s.kv_cache->run(j0 + j));
                scores(run, s.kv_cache->k_panels(it.b, it.g, j0 + j, D), sp + j);
            }
        } else {
            scores(cols - first, kp + first * D, sp + first);
            if (s.kv_cache)
                I8::scale_keys_i8(*s.kv_cache, false, it.b, it.g, j0 + first, cols - first, sp + first, 0, r1 - r0, s.block_k);
        }
        mask_rows(s, it, r0, r1, rows_per_head, j0, first, cols, sp);
        return cols;
    }

    // Modifiers and masks on rows [r0, r1) of S (row r0 at sp, block_k apart), keys [j0 + first,
    // j0 + n).
    static void mask_rows(const Shape &s, const Item &it, int64_t r0, int64_t r1, int64_t rows_per_head, int64_t j0,
                          int64_t first, int64_t n, float *sp) {
        const bool modified = s.softcap != 0.0f || s.alibi;
        // Nothing to do for a call without masks or modifiers whose keys all exist.
        if (!modified && !s.mask && !s.valid_lens && !s.causal && s.window <= 0 && j0 + n <= s.kvlen(it.b)) return;
        for (int64_t r = r0; r < r1; ++r) {
            const int64_t i = it.i0 + r % rows_per_head;
            float *row = sp + (r - r0) * s.block_k + first;
            if (modified)
                Mods::modify_scores(s, it.g * s.group() + r / rows_per_head, s.q_pos(it.b, i), j0 + first, n - first, row);
            Mods::apply_masks(s, it.b, i, j0 + first, n - first, row);
        }
    }

    // Whether Q K^T reads a packed item's Q rows where they lie: one head's rows (G = 1) are evenly
    // spaced there, and unless that spacing is a multiple of 4 KiB (rows then share L1 sets: 2%
    // slower at H8 D128 on Zen 5) reading them in place beats copying them (L128 H8 D64: +2-6%).
    // A block that walks one key tile reads them once: in place then at any spacing (Xeon, H8
    // D128, 1 thread: L128 causal +2.7-3.7%, L128 level, against the copy).
    static bool q_in_place(const Shape &s, const Item &it) {
        return !it.direct && s.group() == 1 &&
               (s.ldq * static_cast<int64_t>(sizeof(float)) % 4096 != 0 || s.key_tiles(it.b, it.i0, it.i1) <= 1);
    }

    // Whether a packed item's Q K^T reads its Q from panels packed once for the query block (one
    // per register panel, as chunk() cuts the rows), with the packed-A microkernel: its broadcasts
    // come from one line a step, not from MR rows in turn. That pays once the block walks three key
    // tiles or more. Xeon (1 thread, H8, against Q in place or copied): L2048 D64 +2.0-2.6%, causal
    // +1.4%, D128 +0.7%, L512 D64 (two tiles) +1.1-4.5% but causal 1.2% slower, L512 D128 level,
    // L128 (one tile) D64 5% slower. Not with the weights: their pass cuts the rows in panels of MR.
    static bool q_panels(const Shape &s, const Item &it) {
        return !it.direct && !s.weights && s.key_tiles(it.b, it.i0, it.i1) >= 3;
    }

    // The item's Q rows as Q K^T reads them: packed into panels (see q_panels), in place (see
    // q_in_place), or copied into q_rows, the heads' rows stacked head by head; a direct item's are
    // then packed too, one block per KV head.
    static void pack_q(const Shape &s, const float *q, const Item &it, ItemScratch &w) {
        const int64_t G = s.group(), D = s.head_dim, rows_per_head = it.i1 - it.i0;
        const bool panels = q_panels(s, it);
        if (q_in_place(s, it) || (panels && G == 1)) {
            w.q_read = q + s.q_row(it.b, it.i0) * s.ldq + it.g * D;  // one head's rows, evenly spaced
            w.q_ld = s.ldq;
        } else {
            w.q_read = w.q_rows;
            w.q_ld = D;
            for (int64_t hh = 0; hh < it.kv_heads * G; ++hh)
                for (int64_t i = it.i0; i < it.i1; ++i) {
                    const float *src = q + s.q_row(it.b, i) * s.ldq + (it.g * G + hh) * D;
                    std::copy(src, src + D, w.q_rows + (hh * rows_per_head + i - it.i0) * D);
                }
        }
        if (panels) {
            const Panels split(it.rows(s));
            for (int64_t p = 0, r0 = 0; p < split.count; r0 += split.rows(p), ++p)
                gemm::pack_panels<Arch, MR>(split.rows(p), D, w.q_read + r0 * w.q_ld, w.q_ld, 1, w.q_packed + p * MR * D,
                                            s.inserts);
            w.q_read = nullptr;
            return;
        }
        if (!it.direct) return;  // panel_scores reads the rows in place
        const int64_t Mg = G * rows_per_head;
        for (int64_t h = 0; h < it.kv_heads; ++h) {
            if (!s.kv_cache)  // DirectTiles::scores takes the rows across the lanes
                DirectTiles<Arch>::transpose_q(Mg, D, w.q_rows + h * Mg * D, w.q_packed + h * direct_ldqt(Mg) * D,
                                               direct_ldqt(Mg));
            else
                gemm::pack_strips<Arch, MR>(Mg, D, w.q_rows + h * Mg * D, D, 1, w.q_packed + h * round_up_to(Mg, MR) * D,
                                            s.inserts);
        }
    }

    // Whether rows [r0, r1) of a packed item see no key past key `end` (their last tile then ends
    // there).
    static bool panel_ends(const Shape &s, const Item &it, int64_t rows_per_head, int64_t r0, int64_t r1, int64_t end) {
        for (int64_t r = r0; r < r1; ++r)
            if (s.key_limit(it.b, it.i0 + r % rows_per_head) > end) return false;
        return true;
    }

    // A register panel's last P V written straight to its output rows (o, ldo apart) divided by
    // the rows' sums: out = (P V + beta acc) x (1 / l), rounded as storing the sum into acc and
    // finish() dividing it would round it, without acc's pass. 1 / l comes in inv (0 where l = 0:
    // the caller zeroes those rows). Dv is a multiple of NR.
    template <int R = 1>
    static void pv_to_out(int64_t rows, int64_t k, const float *p, int64_t ldp, const float *vp, int64_t v_depth,
                          int64_t Dv, float beta, const float *acc, const float *inv, float *o, int64_t ldo) {
        if constexpr (R <= MR) {
            if (rows != R) return pv_to_out<R + 1>(rows, k, p, ldp, vp, v_depth, Dv, beta, acc, inv, o, ldo);
            for (int64_t j = 0; j < Dv; j += NR)
                gemm::sgemm_ukernel<Arch, R, NV, gemm::Layout::strided, gemm::Layout::packed, 1, false, true, true>(
                    k, p, ldp, 1, vp + j * v_depth, NR, o + j, ldo, 1.0f, beta, nullptr, 0, nullptr, 0, inv, acc + j, Dv);
        }
    }

    // Rows [from, depth) of a pending V tile packed into its panels.
    static void pack_v_rows(const Shape &s, const typename KVTiles::VTile &t, int64_t from) {
        gemm::pack_panels_into<Arch, NR>(s.value_dim, t.depth - from, t.rows + from * s.ldv, 1, s.ldv, t.dst + from * NR,
                                         t.depth, s.inserts);
    }

    // P V over k keys for a register panel of `rows` rows whose V tile (NR-column panels `depth`
    // deep, at copy) holds the first `packed` keys' rows: those are read from the tile, the rest
    // where they lie in V (v_rows, ldv apart; Dv a multiple of NR) and copied into the tile for
    // the panels after it. Each sum is the one ordered FMA chain over the keys (the first part's
    // sums stored as floats and resumed), as on the packed tile. Into c (ldc apart, beta as for
    // the accumulator) or, given inv, to the output as pv_to_out writes it (c the output rows,
    // acc what beta adds).
    template <int R = 1>
    static void pv_copy(int64_t rows, int64_t k, int64_t packed, const float *p, int64_t ldp, const float *v_rows,
                        int64_t ldv, float *copy, int64_t depth, int64_t Dv, float beta, float *c, int64_t ldc,
                        const float *inv = nullptr, const float *acc = nullptr) {
        if constexpr (R <= MR) {
            if (rows != R)
                return pv_copy<R + 1>(rows, k, packed, p, ldp, v_rows, ldv, copy, depth, Dv, beta, c, ldc, inv, acc);
            using gemm::Layout;
            alignas(64) float sums[R * NR];
            for (int64_t j = 0; j < Dv; j += NR) {
                const float *vr = v_rows + packed * ldv + j;
                float *to = copy + j * depth + packed * NR;
                auto rest = [&]<bool Resume>() {
                    if (inv)
                        gemm::sgemm_ukernel<Arch, R, NV, Layout::strided, Layout::strided, 1, Resume, true, true, true>(
                            k - packed, p + packed, ldp, 1, vr, ldv, c + j, ldc, 1.0f, beta, nullptr, 0, sums, NR, inv,
                            acc + j, Dv, to);
                    else
                        gemm::sgemm_ukernel<Arch, R, NV, Layout::strided, Layout::strided, 1, Resume, true, false, true>(
                            k - packed, p + packed, ldp, 1, vr, ldv, c + j, ldc, 1.0f, beta, nullptr, 0, sums, NR, nullptr,
                            nullptr, 0, to);
                };
                if (packed == 0) {
                    rest.template operator()<false>();
                    continue;
                }
                gemm::sgemm_ukernel<Arch, R, NV, Layout::strided, Layout::packed>(packed, p, ldp, 1, copy + j * depth, NR,
                                                                                  sums, NR, 1.0f, 0.0f);
                rest.template operator()<true>();
            }
        }
    }

    // Row r of a packed item's output: query it.i0 + r % rows_per_head of head r / rows_per_head
    // of the item's group.
    static float *out_row(const Shape &s, const Item &it, int64_t rows_per_head, int64_t r, float *out) {
        const int64_t i = it.i0 + r % rows_per_head, h = it.g * s.group() + r / rows_per_head;
        return out + s.q_row(it.b, i) * s.ldo + h * s.value_dim;
    }

    // Row r's final sum: a sink adds exp(sink - m) to the denominator (gpt-oss: softmax over
    // [scores, sink], the sink's column dropped), in base 2 as the scores' exps are. A row that
    // sees no key (l = 0) stays zeros.
    static void add_sink(const Shape &s, const Item &it, int64_t rows_per_head, int64_t r, const float *m, float *l) {
        if (s.sinks && l[r] > 0.0f) l[r] += Rows::exp_against(s.sinks[it.g * s.group() + r / rows_per_head], m[r]);
    }

    // The panel's rows done (after its last fold): each sum l gets the sink's term, and inv its
    // inverse, as finish() takes them.
    static void panel_inverses(const Shape &s, const Item &it, int64_t rows_per_head, int64_t r0, int64_t r1,
                               const float *m, float *l, float *inv) {
        for (int64_t r = r0; r < r1; ++r) {
            add_sink(s, it, rows_per_head, r, m, l);
            inv[r - r0] = l[r] == 0.0f ? 0.0f : 1.0f / l[r];
        }
    }

    // Keys [0, key_end) are all that any row of the item can see: past the valid length, or
    // (causal) past the last row's diagonal, whole tiles are skipped.
    static int64_t key_end(const Shape &s, const Item &it) { return s.key_end(it.b, it.i0, it.i1); }

    // An empty softmax state: m = -inf, l = 0, acc = 0.
    static void start(int64_t M, int64_t Dv, float *m, float *l, float *acc) {
        std::fill(m, m + M, kNegInf);
        std::fill(l, l + M, 0.0f);
        std::fill(acc, acc + M * Dv, 0.0f);
    }

    // The online softmax over keys [c0, c1) from a fresh state (m = -inf, l = 0, acc = 0). Q must
    // be packed. Every chunk of keys is computed this way, by whichever thread, so splitting the
    // keys over threads gives the same bits as one thread walking them.
    // out (not NULL: the chunk is the query block's only one, so its state is the block's): a
    // panel's last P V goes straight to its output rows, already divided (see pv_to_out), where
    // Dv is whole panels; returns those panels (bit p: panel p), which finish() then leaves alone.
    // The first P V's beta = 0 (below) makes one key tile's output P V / l without acc at all.
    // Not with the weights (their rows are written from l after finish), so those outputs are the
    // unfused path's, bit for bit (test_attention).
    static uint64_t chunk(const Shape &s, const float *k, const float *v, const Item &it, int64_t c0, int64_t c1,
                          const ItemScratch &w, KVTiles &kv, float *m, float *l, float *acc, float *out = nullptr) {
        const int64_t Dv = s.value_dim, rows_per_head = it.i1 - it.i0, M = it.rows(s);
        const Panels split(M);
        const int64_t panels = split.count;
        // A packed item of up to 64 panels does not zero its accumulator up front: a panel's first
        // P V stores its sums (beta = 0) where adding them to zeros gives the same bits (the sums
        // start from +0, so none is -0, and x + 0 = x for any other x, NaN included), and the
        // panels no P V reached are zeroed at the end. (L64 H8 D64: the fill was 1.5% of the call.)
        const bool lazy = !it.direct && panels <= 64;
        auto bit = [](int64_t p) { return uint64_t{1} << p; };
        uint64_t written = 0;  // the panels P V has stored, when lazy
        uint64_t done = 0;     // the panels written to out
        if (!lazy || s.weights || Dv % NR != 0) out = nullptr;
        start(M, lazy ? 0 : Dv, m, l, acc);
        // Tiles before every row's window are skipped whole; tiles stay aligned to block_k.
        const int64_t begin = s.key_begin(it.b, it.i0, it.i1) / s.block_k * s.block_k;
        for (int64_t j0 = std::max(c0, begin); j0 < c1; j0 += s.block_k) {
            const int64_t n = std::min(s.block_k, c1 - j0);
            if (it.direct) {
                const int64_t cols = direct_scores(s, k, it, M, rows_per_head, j0, n, w);
                if (cols == 0) continue;  // the tile shows the rows nothing: their state stays
                Rows::online_fold(M, cols, w.s, s.block_k, m, l, acc, Dv, Dv);
                direct_accumulate(s, v, it, rows_per_head, j0, cols, j0 + s.block_k, c1, w, acc);
                continue;
            }
            // Register panel by register panel, so a panel's scores stay in L1 from Q K^T through
            // the fold to P V (a whole tile of scores is M x block_k floats: 112 KiB by default).
            // Every panel puts them in S's first MR rows, which then stay in L1 from one panel to
            // the next instead of the tile's walk through S pushing K's and V's panels out (Xeon,
            // 1 thread, H8, the same bits: L128 D64 +0.5-1.1%, L2048 D64 +2.5%, L512 level).
            // V's tile is copied by the first panel's P V as it reads V's rows in place (pv_copy),
            // rather than packed by a pass of its own: the copy takes the store slots the k loop
            // leaves free, and the pass's loads are gone. Xeon (model 207), 1 thread, H8, the same
            // bits, medians of 15-21 paired rounds: L128 D64 +4.6-6.3%, D128 +2.5-4.5%, L64 and
            // L256 D64 +1.2%, L512 +0.9-2.4% (the strip cache packs V once for four or five query
            // blocks), L2048 level; AVX2 (6x16) on the same core L128 D64 +4.3%, D128 +1.4%, L512
            // level. Inside the layer (B8 L128, V from L3 after the QKV projection) level. Under a
            // causal mask each panel copies the rows its keys add (pv_copy's packed prefix): L128
            // D128 causal +1.9-2.8%, D64 causal 0.99-1.02x, L512 causal +0.8-1.6%.
            const float *kp = kv.k(s, k, it, j0, n, w);
            typename KVTiles::VTile pending = kv.v_deferred(s, v, it, j0, n, w);
            int64_t v_copied = 0;  // the pending tile's first rows already in its panels
            const auto [vp, v_depth] = pending.dst ? std::pair<const float *, int64_t>{pending.dst, pending.depth}
                                                   : kv.v(s, v, it, j0, n, w);
            for (int64_t p = 0, r0 = 0, r1 = 0; p < panels; ++p, r0 = r1) {
                r1 = r0 + split.rows(p);
                int64_t first = 0;
                const float *q_panel = w.q_read ? nullptr : w.q_packed + p * MR * s.head_dim;
                const int64_t cols = panel_scores(s, kp, it, r0, r1, rows_per_head, j0, n, w, w.s, first, q_panel);
                // Past `cols` (and before `first`) every score of the panel would be -inf: folding
                // them would leave the state as it is (their P is 0), so the fold and P V skip
                // them, and a panel that sees none of the tile's keys is skipped.
                if (cols == 0) continue;
                float *sp = w.s + first;
                Rows::online_fold(r1 - r0, cols - first, sp, s.block_k, m + r0, l + r0, acc + r0 * Dv, Dv, Dv);
                if (s.kv_cache && s.kv_cache->i8)
                    I8::scale_keys_i8(*s.kv_cache, true, it.b, it.g, j0 + first, cols - first, sp, 0, r1 - r0, s.block_k);
                const float beta = !lazy || written & bit(p) ? 1.0f : 0.0f;
                // A pending V tile is copied by the panels' P V as they read V in place: each panel
                // that sees keys past the rows copied so far (all of them at once without a causal
                // mask) reads the copied rows from the tile and the rest in place, copying them. A
                // panel that skips the tile's first keys (a window) packs what is left first.
                float *copy = nullptr;
                const int64_t v_packed_rows = v_copied;
                if (pending.dst) {
                    if (first == 0 && cols > v_copied) {
                        copy = pending.dst;
                        v_copied = cols;
                    } else if (first > 0) {
                        pack_v_rows(s, pending, v_copied);
                        v_copied = pending.depth;
                    }
                    if (v_copied == pending.depth) pending.dst = nullptr;
                }
                const float *v_rows = pending.rows;
                if (out && panel_ends(s, it, rows_per_head, r0, r1, j0 + n)) {
                    alignas(64) float inv[MR];
                    panel_inverses(s, it, rows_per_head, r0, r1, m, l, inv);
                    // Head by head (a GQA panel may hold the end of one head's rows and the start
                    // of the next's), so each call's output rows lie ldo apart.
                    for (int64_t a = r0, z; a < r1; a = z) {
                        z = std::min(r1, (a / rows_per_head + 1) * rows_per_head);
                        float *o = out_row(s, it, rows_per_head, a, out);
                        if (copy) {  // the first head's rows copy V; the tile then holds every key for the rest
                            pv_copy(z - a, cols, v_packed_rows, sp + (a - r0) * s.block_k, s.block_k, v_rows, s.ldv, copy,
                                    v_depth, Dv, beta, o, s.ldo, inv + (a - r0), acc + a * Dv);
                            copy = nullptr;
                        } else
                            pv_to_out(z - a, cols - first, sp + (a - r0) * s.block_k, s.block_k, vp + first * NR, v_depth,
                                      Dv, beta, acc + a * Dv, inv + (a - r0), o, s.ldo);
                        for (int64_t r = a; r < z; ++r)  // no visible key: zeros, whatever P V gave
                            if (l[r] == 0.0f) std::fill(o + (r - a) * s.ldo, o + (r - a) * s.ldo + Dv, 0.0f);
                    }
                    done |= bit(p);
                } else if (copy) {
                    pv_copy(r1 - r0, cols, v_packed_rows, sp, s.block_k, v_rows, s.ldv, copy, v_depth, Dv, beta,
                            acc + r0 * Dv, Dv);
                } else {
                    gemm::sgemm_macro_sup<Arch, MR, NV>(gemm::SupArgs{r1 - r0, Dv, cols - first, 0, (Dv + NR - 1) / NR,
                                                                      sp, s.block_k, 1, nullptr, 0, vp + first * NR,
                                                                      v_depth, acc + r0 * Dv, Dv, 1.0f, beta});
                }
                if (lazy) written |= bit(p);
            }
            // The panels left some of the tile's rows uncopied: the strip cache still holds the
            // tile for the blocks after.
            if (pending.dst && s.cache_kv) pack_v_rows(s, pending, v_copied);
        }
        if (lazy)
            for (int64_t p = 0, r0 = 0, r1 = 0; p < panels; ++p, r0 = r1) {
                r1 = r0 + split.rows(p);
                if (!(written & bit(p))) std::fill(acc + r0 * Dv, acc + r1 * Dv, 0.0f);
            }
        return done;
    }

    // Folds a chunk's state (cm, cl, cacc) into the running state (m, l, acc), row by row, in the
    // order the chunks come, each state rescaled as the fold does (RowKernels::rescale: in base 2,
    // so the rounding of its max to base 2 cancels).
    static void merge(int64_t M, int64_t Dv, float *m, float *l, float *acc, const float *cm, const float *cl,
                      const float *cacc) {
        for (int64_t r = 0; r < M; ++r) {
            if (cm[r] == kNegInf) continue;  // the chunk showed this row nothing
            const float mn = std::isnan(cm[r]) || std::isnan(m[r]) ? cm[r] + m[r] : std::max(m[r], cm[r]);
            const float a = Rows::rescale(m[r], mn), b = Rows::rescale(cm[r], mn);
            float *ar = acc + r * Dv;
            const float *cr = cacc + r * Dv;
            for (int64_t d = 0; d < Dv; ++d) ar[d] = ar[d] * a + cr[d] * b;
            l[r] = l[r] * a + cl[r] * b;
            m[r] = mn;
        }
    }

    // Divides the rows by their sums straight into out and, if asked, writes the weights.
    // done: the register panels chunk() has written to out already (bit p: panel p).
    static void finish(const Shape &s, const float *k, float *out, const Item &it, const ItemScratch &w, KVTiles &kv,
                       uint64_t done = 0) {
        const int64_t Dv = s.value_dim, rows_per_head = it.i1 - it.i0, M = it.rows(s);
        const Panels split(M);
        for (int64_t p = 0, r0 = 0, r1 = 0; p < split.count; ++p, r0 = r1) {
            r1 = r0 + split.rows(p);
            if (p < 64 && done >> p & 1) continue;
            for (int64_t r = r0; r < r1; ++r) {
                add_sink(s, it, rows_per_head, r, w.m, w.l);
                Rows::online_finish_row(w.l[r], w.acc + r * Dv, Dv, out_row(s, it, rows_per_head, r, out));
            }
        }
        if (s.weights) write_weights(s, k, it, M, rows_per_head, key_end(s, it), w, kv);
    }

    // The whole item on one thread, query block by query block: the key chunks in order, each
    // merged as it completes.
    static void run(const Shape &s, const float *q, const float *k, const float *v, float *out, const Item &strip,
                    float *scratch) {
        ItemScratch w(s, MR, NR, scratch);
        KVTiles kv;
        kv.end = key_end(s, strip);
        for (int64_t t = 0; t < s.block_count(strip.b); ++t) {
            const int64_t i0 = std::max(strip.i0, s.block_start(strip.b, t));
            const int64_t i1 = std::min(strip.i1, s.block_start(strip.b, t + 1));
            if (i0 >= i1) continue;  // a block outside the item
            const Item it{strip.b, strip.g, i0, i1, strip.kv_heads, strip.direct};
            const int64_t M = it.rows(s), end = key_end(s, it);
            pack_q(s, q, it, w);
            // The first chunk goes straight into the running state: merging a chunk into an empty
            // state copies it bit for bit (its weights are exp(-inf) = 0 and exp(0) = 1), so this
            // is what the split path computes, without a pass over the accumulator.
            // Chunks before every row's window are skipped: their states would be empty, and
            // merging an empty state changes nothing.
            const int64_t first = s.key_begin(it.b, it.i0, it.i1) / s.kv_chunk * s.kv_chunk;
            if (first >= end) start(M, s.value_dim, w.m, w.l, w.acc);  // no chunk: every row sees nothing
            uint64_t done = 0;  // panels the only chunk wrote to out
            for (int64_t c0 = first; c0 < end; c0 += s.kv_chunk) {
                const int64_t c1 = std::min(end, c0 + s.kv_chunk);
                if (c0 == first) {
                    done = chunk(s, k, v, it, c0, c1, w, kv, w.m, w.l, w.acc, c1 == end ? out : nullptr);
                    continue;
                }
                chunk(s, k, v, it, c0, c1, w, kv, w.cm, w.cl, w.cacc);
                merge(M, s.value_dim, w.m, w.l, w.acc, w.cm, w.cl, w.cacc);
            }
            finish(s, k, out, it, w, kv, done);
        }
    }

    // One key chunk of an item, into a caller-owned state (for splitting the keys over threads).
    static void run_chunk(const Shape &s, const float *q, const float *k, const float *v, const Item &it,
                          int64_t chunk_index, float *state, float *scratch) {
        ItemScratch w(s, MR, NR, scratch);
        const int64_t M = it.rows(s), end = key_end(s, it), c0 = chunk_index * s.kv_chunk;
        pack_q(s, q, it, w);
        KVTiles kv;
        chunk(s, k, v, it, c0, std::min(end, c0 + s.kv_chunk), w, kv, state, state + M, state + 2 * M);
    }

    // Merges the item's chunk states in order, then finishes as run() does.
    static void run_merge(const Shape &s, const float *q, const float *k, float *out, const Item &it,
                          int64_t chunks, const float *states, float *scratch) {
        ItemScratch w(s, MR, NR, scratch);
        const int64_t M = it.rows(s), Dv = s.value_dim, per = M * (2 + Dv);
        start(M, Dv, w.m, w.l, w.acc);
        for (int64_t c = 0; c < chunks; ++c) {
            const float *st = states + c * per;
            merge(M, Dv, w.m, w.l, w.acc, st, st + M, st + 2 * M);
        }
        if (s.weights) pack_q(s, q, it, w);
        KVTiles kv;
        finish(s, k, out, it, w, kv);
    }

    // weights[b, h, i, :] = exp(S - m) / l, recomputing S tile by tile; keys never visible get 0.
    static void write_weights(const Shape &s, const float *k, const Item &it, int64_t M, int64_t rows_per_head,
                              int64_t key_end, const ItemScratch &w, KVTiles &kv) {
        const int64_t G = s.group();
        auto weight_row = [&](int64_t r) {
            const int64_t hh = r / rows_per_head, i = it.i0 + r % rows_per_head;
            return s.weights + ((it.b * s.heads + it.g * G + hh) * s.q_len + i) * s.kv_len;
        };
        for (int64_t j0 = 0; j0 < key_end; j0 += s.block_k) {
            const int64_t n = std::min(s.block_k, key_end - j0);
            scores(s, k, it, M, rows_per_head, j0, n, w, kv);
            for (int64_t r = 0; r < M; ++r) {
                float *dst = weight_row(r) + j0;
                if (w.l[r] == 0.0f || std::isnan(w.l[r])) {
                    std::fill(dst, dst + n, w.l[r] == 0.0f ? 0.0f : w.l[r]);
                    continue;
                }
                Rows::exp_store_sum(w.s + r * s.block_k, n, w.m[r], dst);
                Rows::scale(dst, n, 1.0f / w.l[r]);
            }
        }
        for (int64_t r = 0; r < M; ++r) std::fill(weight_row(r) + key_end, weight_row(r) + s.kv_len, 0.0f);
    }
};

} // namespace
} // namespace mha::attention_detail
