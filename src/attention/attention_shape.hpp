// What a fused-attention work item needs to know, shared by the scheduler and the per-ISA kernels.
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <string_view>

#include "gemm/sgemm_kernels.hpp"
#include "mha/isa.hpp"

namespace mha::detail { struct RuntimeState; }

namespace mha::attention_detail {

// Where a cached sequence's K and V live: the paged KV cache's blocks (see src/serving/). Block
// `id` starts at pool + id * block_floats; for KV head h it holds the K of its block_tokens tokens
// as NR-key panels of head_dim depth (keys across the lanes, the packed B of Q K^T) at k_head * h,
// and their V as NR-column panels of block_tokens depth (the packed B of P V) at
// v_start + v_head * h, v_panel floats apart. Sequence b's blocks are blocks[table_off[b]],
// blocks[table_off[b] + 1], ...
struct CacheView {
    const float *pool = nullptr;
    int64_t block_floats = 0, block_tokens = 0, nr = 0;
    int64_t k_head = 0, v_start = 0, v_head = 0, v_panel = 0;
    const int64_t *table_off = nullptr;
    const int32_t *blocks = nullptr;
    const float *block(int64_t b, int64_t j) const {
        return pool + static_cast<int64_t>(blocks[table_off[b] + j / block_tokens]) * block_floats;
    }
    // K panels of KV head h from key j (j % nr == 0), panels of nr keys, depth head_dim.
    const float *k_panels(int64_t b, int64_t h, int64_t j, int64_t head_dim) const {
        return block(b, j) + h * k_head + (j % block_tokens) * head_dim;
    }
    // Key j's NR values in V's first panel of KV head h (the next panel is v_panel floats on).
    const float *v_panels(int64_t b, int64_t h, int64_t j) const {
        return block(b, j) + v_start + h * v_head + (j % block_tokens) * nr;
    }
    // Keys from j to the end of j's block.
    int64_t run(int64_t j) const { return block_tokens - j % block_tokens; }

    // An int8 cache (MHA_I8): the same panels hold int8 values (the offsets above count bytes),
    // and each token has one fp32 scale per KV head for K and one for V, from float `scales` of
    // the block on: K's [kv_heads][block_tokens], then V's. The kernels widen them as they read.
    bool i8 = false;
    int64_t scales = 0, kv_heads = 0;
    const int8_t *k_panels_i8(int64_t b, int64_t h, int64_t j, int64_t head_dim) const {
        return reinterpret_cast<const int8_t *>(block(b, j)) + h * k_head + (j % block_tokens) * head_dim;
    }
    const int8_t *v_panels_i8(int64_t b, int64_t h, int64_t j) const {
        return reinterpret_cast<const int8_t *>(block(b, j)) + v_start + h * v_head + (j % block_tokens) * nr;
    }
    const float *k_scales(int64_t b, int64_t h, int64_t j) const {
        return block(b, j) + scales + h * block_tokens + j % block_tokens;
    }
    const float *v_scales(int64_t b, int64_t h, int64_t j) const {
        return block(b, j) + scales + (kv_heads + h) * block_tokens + j % block_tokens;
    }
};

struct Shape {
    // Dense calls: batch sequences of q_len queries and kv_len keys. Ragged calls (q_off set):
    // sequence b owns query rows [q_off[b], q_off[b + 1]) and key rows [kv_off[b], kv_off[b + 1]);
    // q_len and kv_len are then the longest.
    int64_t batch, q_len, kv_len, heads, kv_heads, head_dim, value_dim;
    float scale;
    bool causal;
    const int32_t *valid_lens;  // NULL or [batch]
    const uint8_t *mask;        // NULL or strided [batch][q_len][kv_len]
    int64_t mask_batch_stride, mask_row_stride;
    float *weights;             // NULL or [batch, heads, q_len, kv_len]
    int64_t block_q, block_k;   // query rows per head in an item; keys per tile
    int64_t kv_chunk;           // keys per chunk (a multiple of block_k): the unit of key splitting
    bool cache_kv = false;      // items are strips that keep every packed K/V tile (see the scheduler)
    int64_t kv_ring = 0;        // with cache_kv: keep only the last kv_ring tiles (a window's), 0 = all
    int64_t ldq = 0, ldk = 0, ldv = 0, ldo = 0;  // floats between tokens in q, k, v, out
    const int64_t *q_off = nullptr, *kv_off = nullptr;  // ragged: [batch + 1] row offsets
    const CacheView *kv_cache = nullptr;  // K and V from a paged cache instead of k and v
    // Score modifiers (mha_attention_variant): a window of keys before each query's position,
    // tanh soft-capping, ALiBi slopes and sink logits per head (NULL = none).
    int64_t window = 0;
    float softcap = 0.0f;
    const float *alibi = nullptr, *sinks = nullptr;
    bool inserts = false;  // the runtime's register transpose for K^T's pack (run_attention sets it)
    int64_t group() const { return heads / kv_heads; }
    // Query i's absolute position in batch b (bottom-right: its keys are at 0 .. kvlen - 1).
    int64_t q_pos(int64_t b, int64_t i) const { return i + kvlen(b) - qlen(b); }
    // Keys [key_start, key_limit) may be seen by query i (before the boolean mask): the window.
    int64_t key_start(int64_t b, int64_t i) const {
        const int64_t p = q_pos(b, i);
        // p - window + 1 without overflow: a window of up to INT64_MAX is valid (found by fuzz_c_abi:
        // a huge window wrapped the first rows' starts past every key, so no row saw any).
        if (window <= 0 || window > p) return 0;
        return p - window + 1;
    }
    // The first key any of queries [i0, i1) can see (the window starts rise with i).
    int64_t key_begin(int64_t b, int64_t i0, int64_t i1) const { return i1 > i0 ? key_start(b, i0) : 0; }
    int64_t qlen(int64_t b) const { return q_off ? q_off[b + 1] - q_off[b] : q_len; }
    int64_t kvlen(int64_t b) const { return kv_off ? kv_off[b + 1] - kv_off[b] : kv_len; }
    int64_t q_row(int64_t b, int64_t i) const { return (q_off ? q_off[b] : b * q_len) + i; }
    // Batch b's query blocks: block_count(b) of them, block t holding rows [block_start(b, t),
    // block_start(b, t + 1)), block_q rows each, except that a last block under block_q / 2 rows
    // shares the last two blocks' rows evenly (128 rows at BQ 112: 64 + 64, not 112 + 16), as the
    // GEMM cuts its row strips. A row's bits never depend on its block.
    int64_t block_count(int64_t b) const { return gemm::strip_count(qlen(b), block_q); }
    int64_t block_start(int64_t b, int64_t t) const { return gemm::strip_start(qlen(b), block_q, t); }
    int64_t kv_row(int64_t b, int64_t j) const { return (kv_off ? kv_off[b] : b * kv_len) + j; }
    // Keys [0, limit) may be seen by query i of batch b (before the boolean mask).
    int64_t key_limit(int64_t b, int64_t i) const {
        const int64_t n = kvlen(b);
        int64_t lim = n;
        if (valid_lens && valid_lens[b] < lim) lim = valid_lens[b];
        if (causal && i + n - qlen(b) + 1 < lim) lim = i + n - qlen(b) + 1;
        return lim < 0 ? 0 : lim;
    }
    // Keys [0, end) are all that queries [i0, i1) of batch b can see between them.
    int64_t key_end(int64_t b, int64_t i0, int64_t i1) const {
        int64_t end = 0;
        for (int64_t i = i0; i < i1; ++i) end = std::max(end, key_limit(b, i));
        return end;
    }
    // The key tiles (block_k keys each, at multiples of block_k) that queries [i0, i1) of batch b
    // walk: from the one holding the first key any of them can see to the one holding the last.
    int64_t key_tiles(int64_t b, int64_t i0, int64_t i1) const {
        const int64_t begin = key_begin(b, i0, i1) / block_k * block_k, end = key_end(b, i0, i1);
        return end > begin ? (end - begin + block_k - 1) / block_k : 0;
    }
};

// Which packed K (or V) tiles a strip holds between its query blocks (FusedAttention::KVTiles):
// the tiles [lo, ready), packed in a row since the last jump. Without a ring (slots = 0) tile t
// has slot t and every tile below ready counts as held (a strip visits its tiles in order, and
// the tiles before a block's first, never packed, are never read); with a ring of `slots` (a
// window's), tile t goes to slot t % slots and at most `slots` tiles are held, so a tile asked
// for again after it was overwritten, or after a jump back, is packed again.
struct TileRing {
    int64_t lo = 0, ready = 0;
    static int64_t slot(int64_t slots, int64_t t) { return slots ? t % slots : t; }
    bool holds(int64_t t) const { return t >= lo && t < ready; }
    void packed(int64_t slots, int64_t t) {
        if (slots) {
            if (t != ready) lo = t;
            lo = std::max(lo, t + 1 - slots);
        }
        ready = t + 1;
    }
};

// Copies the score modifiers of a call (already validated) into its shape.
template <class Variant>
void set_variant(Shape &s, const Variant &v) {
    s.window = v.window;
    s.softcap = v.softcap;
    s.alibi = v.alibi_slopes;
    s.sinks = v.sink_logits;
}

// One work item: query rows [i0, i1) of every head that shares KV heads [g, g + kv_heads), in
// batch b; one query block, or (with Shape::cache_kv) a strip of them. Its rows are stacked head
// by head: row r is query i0 + r % (i1 - i0) of head g * group + r / (i1 - i0). Direct items
// (few rows per KV head: decode) hold every KV head of their sequence and walk K and V token by
// token (see DirectTiles); the others pack K^T and V tile by tile for the GEMM microkernel.
struct Item {
    int64_t b, g, i0, i1;
    int64_t kv_heads = 1;
    bool direct = false;
    int64_t rows(const Shape &s) const { return kv_heads * s.group() * (i1 - i0); }
};

// Items whose KV head has at most this many rows (G heads x query rows: decode, and short
// speculative steps) take the direct path; see DirectTiles. At H32/8 D128 Lk4096 it measured
// 2% faster than the packed path at 8 rows, 4% at 12, even at 16 and 35% slower at 24.
inline constexpr int64_t kDirectRows = 12;
// Tokens per step of the direct path on dense K and V. Within a key tile it reads the rows of this
// many tokens whole, K then V: 16 tokens keep that within the streams the L2 prefetcher tracks
// (16 K and 16 V pages at Hkv x D x 4 = 4 KiB per token): a probe read H32/8 D128 K/V this way at
// 13-16 GB/s against 5-6 GB/s head by head, and 11 GB/s for one sequential stream.
inline constexpr int64_t kDirectKeys = 16;

// The scheduler: spreads the items of a shape over the runtime's threads, costliest first, and
// runs them with the kernel (used by every attention entry point).
struct AttentionKernel;
void run_attention(detail::RuntimeState &st, const AttentionKernel &ak, Shape &s, const float *q, const float *k,
                   const float *v, float *out);

// A dense call's row strides (0 in the params: dense rows), its score modifiers, and the run: what
// attention() and attention_varlen() share after building their shapes.
template <class Params>
void run_dense(detail::RuntimeState &st, const AttentionKernel &ak, Shape &s, const Params &p, const float *q,
               const float *k, const float *v, float *out) {
    s.ldq = p.q_stride ? p.q_stride : p.num_heads * p.head_dim;
    s.ldk = p.k_stride ? p.k_stride : p.num_kv_heads * p.head_dim;
    s.ldv = p.v_stride ? p.v_stride : p.num_kv_heads * p.value_dim;
    s.ldo = p.out_stride ? p.out_stride : p.num_heads * p.value_dim;
    set_variant(s, p.variant);
    run_attention(st, ak, s, q, k, v, out);
}

// Refuses out == q (in place) unless each head's output lands on its own query: value_dim ==
// head_dim, equal row strides (ldq, ldo: resolved, not 0) and no weights (their pass reads Q
// after the outputs). Every entry point that runs the kernels allows it on these terms.
void check_in_place(const float *q, const float *out, int64_t head_dim, int64_t value_dim, int64_t ldq, int64_t ldo,
                    bool weights);

// Floats of scratch one item needs (the same layout the kernels carve up).
int64_t item_scratch_floats(const Shape &s, int mr, int nr);

// A whole item on one thread.
using ItemFn = void (*)(const Shape &s, const float *q, const float *k, const float *v, float *out, const Item &item,
                        float *scratch);
// One key chunk of an item into `state` (m[M], l[M], acc[M x Dv]); then all chunks merged in order.
using ChunkFn = void (*)(const Shape &s, const float *q, const float *k, const float *v, const Item &item,
                         int64_t chunk, float *state, float *scratch);
using MergeFn = void (*)(const Shape &s, const float *q, const float *k, float *out, const Item &item, int64_t chunks,
                         const float *states, float *scratch);

struct AttentionKernel {
    const char *name;  // the GEMM microkernel it is built on
    Isa isa;
    int mr, nr;
    ItemFn item;
    ChunkFn chunk;
    MergeFn merge;
};

std::span<const AttentionKernel> attention_kernels_avx2();
std::span<const AttentionKernel> attention_kernels_avx512();
const AttentionKernel &find_attention_kernel(std::string_view gemm_ukernel);

} // namespace mha::attention_detail
