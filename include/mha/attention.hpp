// Fused scaled-dot-product attention: softmax(Q K^T * scale + masks) V, per head, without ever
// storing the q_len x kv_len score matrix.
#pragma once

#include <cstdint>

#include "mha/runtime.hpp"

namespace mha {

// Score modifiers (see mha_attention_variant in mha.h); all zero = plain attention.
struct AttentionVariant {
    int64_t window = 0;                   // 0 = none; else query position p sees keys j > p - window
    float softcap = 0.0f;                 // 0 = none; else s = softcap * tanh(s / softcap)
    const float *alibi_slopes = nullptr;  // NULL or [num_heads]: s += slope[h] * (j - p), after the cap
    const float *sink_logits = nullptr;   // NULL or [num_heads]: an extra logit per row with no value
    bool any() const { return window != 0 || softcap != 0.0f || alibi_slopes || sink_logits; }
};

// Throws mha::Error naming the field (prefix.window, ...) if v is not valid for num_heads heads.
void attention_variant_validate(const AttentionVariant &v, int64_t num_heads, const char *prefix = "variant");

struct AttentionParams {
    int64_t batch = 0, q_len = 0, kv_len = 0;
    int64_t num_heads = 0, num_kv_heads = 0;  // num_heads % num_kv_heads == 0 (MHA, GQA, MQA)
    int64_t head_dim = 0, value_dim = 0;      // Dqk and Dv, which may differ
    float scale = 0.0f;                       // 0 means 1/sqrt(head_dim)
    bool causal = false;                      // query i sees key j iff j <= i + kv_len - q_len
    const int32_t *kv_valid_lens = nullptr;   // NULL or [batch]: keys j >= valid_len are masked
    const uint8_t *mask = nullptr;            // NULL or mask[b*batch_stride + i*row_stride + j]; 0 = masked
    int64_t mask_batch_stride = 0, mask_row_stride = 0;  // 0 broadcasts
    float *weights = nullptr;                 // NULL, or out: probabilities [batch, num_heads, q_len, kv_len]
    // Floats from one token's row to the next in q, k, v and out; 0 means dense (num_heads * head_dim
    // for q, and so on). Larger strides read the heads out of a wider row, such as the fused QKV
    // projection's [tokens, q | k | v] output, without copies.
    int64_t q_stride = 0, k_stride = 0, v_stride = 0, out_stride = 0;
    AttentionVariant variant;  // window, softcap, ALiBi, sinks
};

// q [batch, q_len, num_heads, head_dim], k [batch, kv_len, num_kv_heads, head_dim],
// v [batch, kv_len, num_kv_heads, value_dim], out [batch, q_len, num_heads, value_dim] (each token's
// row may be wider: see the strides).
// All masks combine (a key must pass every one). A query row with no visible key gets zeros (and
// zero weights). Subnormal floats count as zero inside the call (FTZ and DAZ on the threads that
// compute it; the caller's MXCSR is restored): an input or result below FLT_MIN in magnitude is 0.
// The result is bitwise identical for any thread count and for a sequence alone or inside a batch.
// In place: out may be q itself (out == q) when value_dim == head_dim, the row strides are equal
// and weights is NULL; each query row's output is written after the call's last read of that row,
// so the result has the same bits as into a buffer of its own (Layer::forward writes its attention
// output over its Q this way). out == q otherwise is refused; no other overlap of out with q, k, v,
// the mask or the weights is allowed.
// Throws mha::Error on bad arguments, before writing anything.
void attention(Runtime &rt, const AttentionParams &p, const float *q, const float *k, const float *v, float *out);

// The same result through the unfused composition (GEMM, masks, softmax, GEMM), which stores the
// q_len x kv_len score matrix of one head at a time: a second opinion for tests and a baseline.
void attention_unfused(Runtime &rt, const AttentionParams &p, const float *q, const float *k, const float *v,
                       float *out);

// Throws mha::Error, naming the field, if the arguments of attention() are not valid.
void attention_validate(const AttentionParams &p, const float *q, const float *k, const float *v, const float *out);

} // namespace mha
