// What a fused-attention work item needs to know, shared by the scheduler and the per-ISA kernels.
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <string_view>

#include "mha/isa.hpp"

namespace mha::attention_detail {

struct Shape {
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
    bool direct = false;        // items have few rows and take K and V in place (DirectTiles), all KV heads at once
    int64_t ldq = 0, ldk = 0, ldv = 0, ldo = 0;  // floats between tokens in q, k, v, out
    int64_t group() const { return heads / kv_heads; }
    // KV heads per item: one, or on the direct path all of them, so that a key tile's rows are
    // read whole (the heads of a token lie side by side) rather than a slice of each.
    int64_t item_kv_heads() const { return direct ? kv_heads : 1; }
    // Keys [0, limit) may be seen by query i of batch b (before the boolean mask).
    int64_t key_limit(int64_t b, int64_t i) const {
        int64_t lim = kv_len;
        if (valid_lens && valid_lens[b] < lim) lim = valid_lens[b];
        if (causal && i + kv_len - q_len + 1 < lim) lim = i + kv_len - q_len + 1;
        return lim < 0 ? 0 : lim;
    }
    // Keys [0, end) are all that queries [i0, i1) of batch b can see between them.
    int64_t key_end(int64_t b, int64_t i0, int64_t i1) const {
        int64_t end = 0;
        for (int64_t i = i0; i < i1; ++i) end = std::max(end, key_limit(b, i));
        return end;
    }
};

// One work item: query rows [i0, i1) of every head that shares KV heads [g, g + kv_heads), in
// batch b; one query block, or (with Shape::cache_kv) a strip of them. Its rows are stacked head
// by head: row r is query i0 + r % (i1 - i0) of head g * group + r / (i1 - i0).
struct Item {
    int64_t b, g, i0, i1;
    int64_t kv_heads = 1;
    int64_t rows(const Shape &s) const { return kv_heads * s.group() * (i1 - i0); }
};

// Items whose KV head has at most this many rows (G heads x query rows: decode, and short
// speculative steps) take the direct path; see DirectTiles. At H32/8 D128 Lk4096 it measured
// 2% faster than the packed path at 8 rows, 4% at 12, even at 16 and 35% slower at 24.
inline constexpr int64_t kDirectRows = 12;
// Keys per tile on the direct path. Each tile reads the rows of tile-many tokens whole, K then V;
// 16 tokens keep that within the streams the L2 prefetcher tracks (16 K and 16 V pages at Hkv x
// D x 4 = 4 KiB per token): a probe read H32/8 D128 K/V this way at 13-16 GB/s against 5-6
// GB/s head by head, and 11 GB/s for one sequential stream.
inline constexpr int64_t kDirectKeys = 16;

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
