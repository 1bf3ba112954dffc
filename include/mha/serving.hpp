// Serving: ragged (varlen) attention, a paged KV cache owned by the library, and attention over it.
// The C ABI's mha_attention_varlen, mha_kv_cache_* and mha_attention_cached sit on these.
//
// Every attention path computes a query row in one order: each score is the same ordered sum over
// the head dimension, and keys are folded into the online softmax in tiles of attn_block_k and
// chunks of attn_kv_chunk keys aligned to absolute key positions. A token's output therefore has
// the same bits alone or in any batch, in a full or chunked prefill or a decode step, on any
// number of threads (for one ISA and tile config, and finite V).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "mha/attention.hpp"
#include "mha/dtype.hpp"
#include "mha/runtime.hpp"

namespace mha {

struct VarlenParams {
    int64_t num_seqs = 0;
    const int64_t *q_offsets = nullptr;   // [num_seqs + 1], non-decreasing, starting at 0
    const int64_t *kv_offsets = nullptr;  // [num_seqs + 1], the same for key/value rows
    int64_t num_heads = 0, num_kv_heads = 0, head_dim = 0, value_dim = 0;
    float scale = 0.0f;                   // 0 means 1/sqrt(head_dim)
    bool causal = false;                  // bottom-right per sequence
    int64_t q_stride = 0, k_stride = 0, v_stride = 0, out_stride = 0;  // floats between rows; 0 = dense
    AttentionVariant variant;             // window, softcap, ALiBi, sinks; positions per sequence
};

// q [total_q, H, Dqk], k [total_kv, Hkv, Dqk], v [total_kv, Hkv, Dv] -> out [total_q, H, Dv].
// out may be q itself (in place) on mha::attention's terms: Dv == Dqk and equal row strides.
// Throws mha::Error naming the field on bad input, before writing anything.
void attention_varlen(Runtime &rt, const VarlenParams &p, const float *q, const float *k, const float *v,
                      float *out);
// Throws mha::Error, naming the field, if the arguments of attention_varlen() are not valid.
void attention_varlen_validate(const VarlenParams &p, const float *q, const float *k, const float *v,
                               const float *out);

struct KVCacheConfig {
    int64_t num_kv_heads = 0, head_dim = 0, value_dim = 0;
    int64_t block_tokens = 0;  // 0 = the runtime's choice; see mha_kv_cache_config in mha.h for what fits
    int64_t max_tokens = 0;    // capacity, rounded up to whole blocks
    DType dtype = DType::f32;
    int64_t window = 0;        // 0 = keep every token; W: release blocks outside every future window (see mha.h)
};

// The paged cache (see mha.h for the thread rules). All blocks are allocated at construction.
class KVCache {
public:
    // Throws mha::Error: invalid_argument naming the field, unsupported for bf16, out_of_memory.
    KVCache(Runtime &rt, const KVCacheConfig &config);
    ~KVCache();
    KVCache(const KVCache &) = delete;
    KVCache &operator=(const KVCache &) = delete;

    // k [n, Hkv, Dqk], v [n, Hkv, Dv]. Throws Error(out_of_memory) when the free blocks do not
    // suffice, appending nothing.
    void append(int64_t seq_id, int64_t n_tokens, const float *k, const float *v);
    void fork(int64_t src_seq, int64_t dst_seq);
    void release(int64_t seq_id);
    int64_t seq_len(int64_t seq_id) const;  // throws for an unknown id
    bool contains(int64_t seq_id) const;
    int64_t free_tokens() const;
    size_t bytes() const;
    const KVCacheConfig &config() const;  // resolved
    // Copies positions [start, start + n) back out (k or v may be NULL).
    void read(int64_t seq_id, int64_t start, int64_t n, float *k, float *v) const;

    struct Impl;
    Impl &impl() const { return *impl_; }

private:
    std::unique_ptr<Impl> impl_;
};

struct CachedParams {
    int64_t num_seqs = 0;
    const int64_t *seq_ids = nullptr;    // [num_seqs], distinct, each held by the cache
    const int64_t *q_offsets = nullptr;  // [num_seqs + 1]: each sequence's queries are its last cached tokens
    int64_t num_heads = 0;               // a multiple of the cache's num_kv_heads
    float scale = 0.0f;                  // 0 means 1/sqrt(head_dim)
    bool causal = false;
    int64_t q_stride = 0, out_stride = 0;  // floats between rows of q and out; 0 = dense
    AttentionVariant variant;              // positions: a token's index in its sequence
};

// q [total_q, H, Dqk] -> out [total_q, H, Dv]; out may be q itself as in attention_varlen.
void attention_cached(Runtime &rt, const KVCache &cache, const CachedParams &p, const float *q, float *out);

} // namespace mha
