// mha::Layer: a multi-head attention layer as a server holds it, built once from a checkpoint's
// weights (PyTorch's nn.Linear layout, [out_features, in_features]) and called for every request.
//
//   Q = query W_q^T + b_q     [B, Lq, H, head_dim]
//   K = key   W_k^T + b_k     [B, Lk, Hkv, head_dim]
//   V = value W_v^T + b_v     [B, Lk, Hkv, value_dim]
//   O = attention(Q, K, V)    (mha::attention, with its masks)
//   out = O W_o^T + b_o       [B, Lq, embed_dim]
//   with Add & Norm (norm): out = LayerNorm(query + out) (post), or the whole block on
//   LayerNorm(query) plus query (pre)
//
// The weights are packed for the GEMM microkernel once, when the layer is built. The projections
// are GEMMs with the bias added in their epilogue; self-attention computes Q, K and V in one GEMM.
#pragma once

#include <cstdint>
#include <memory>

#include "mha/attention.hpp"
#include "mha/dtype.hpp"
#include "mha/runtime.hpp"

namespace mha {

// Rotary position embeddings (see mha_rope in mha.h).
struct Rope {
    int64_t dims = 0;             // 0 = none; else even and <= head_dim
    float theta = 0.0f;           // 0 = 10000
    bool interleaved = false;     // false: (x[d], x[d + dims/2]) (rotate_half); true: (x[2d], x[2d+1])
    float position_scale = 0.0f;  // 0 = 1
};

struct LayerConfig {
    int64_t embed_dim = 0;     // E: the width of query and out
    int64_t num_heads = 0;     // H
    int64_t num_kv_heads = 0;  // Hkv; 0 means H. H must be a multiple of it (GQA, MQA)
    int64_t head_dim = 0;      // Dqk per head; 0 means E / H (then E must be a multiple of H)
    int64_t value_dim = 0;     // Dv per head; 0 means E / H
    int64_t kdim = 0, vdim = 0;  // the widths of key and value (PyTorch's names); 0 means E
    DType weight_dtype = DType::f32;  // bf16 weights: Error(unsupported) for now
    Norm norm = Norm::none;      // Add & Norm around the layer (see mha_norm in mha.h)
    float norm_eps = 0.0f;       // LayerNorm's eps; 0 means 1e-5
    AttentionVariant variant;    // score modifiers; the slopes and sinks are copied when the layer is built
    Rope rope;                   // rotary embeddings on q and k, right after their projection

    // The same configuration with every 0 replaced by what it means. Throws mha::Error naming the
    // field if the configuration is not valid.
    LayerConfig resolved() const;
};

// Borrowed pointers, read only while the layer is built. A NULL bias means "no bias".
struct LayerWeights {
    const float *q_weight = nullptr;    // [H * head_dim, E]
    const float *k_weight = nullptr;    // [Hkv * head_dim, kdim]
    const float *v_weight = nullptr;    // [Hkv * value_dim, vdim]
    const float *out_weight = nullptr;  // [E, H * value_dim]
    const float *q_bias = nullptr, *k_bias = nullptr, *v_bias = nullptr, *out_bias = nullptr;
    const float *norm_weight = nullptr, *norm_bias = nullptr;  // [E] each; NULL means 1 and 0

    // PyTorch's packed form: in_proj_weight [3E, E] holds W_q, W_k and W_v one after the other, and
    // in_proj_bias [3E] (or NULL) their biases. Valid when kdim = vdim = E, Hkv = H and
    // head_dim = value_dim = E / H (the only shapes nn.MultiheadAttention packs); throws otherwise.
    static LayerWeights from_in_proj(const LayerConfig &config, const float *in_proj_weight,
                                     const float *in_proj_bias, const float *out_proj_weight,
                                     const float *out_proj_bias);
};

// The per-call arguments; the masks mean what they mean in AttentionParams.
struct LayerForward {
    int64_t batch = 0, q_len = 0, kv_len = 0;
    bool causal = false;                      // query i sees key j iff j <= i + kv_len - q_len
    const int32_t *kv_valid_lens = nullptr;   // NULL or [batch]
    const uint8_t *mask = nullptr;            // NULL or mask[b*batch_stride + i*row_stride + j]; 0 = masked
    int64_t mask_batch_stride = 0, mask_row_stride = 0;  // 0 broadcasts
    float *weights = nullptr;                 // NULL, or out: per-head probabilities [batch, H, q_len, kv_len]
};

// One step of a continuous batch through a KV cache (self-attention layers only).
struct LayerCachedForward {
    int64_t num_seqs = 0;
    const int64_t *seq_ids = nullptr;    // [num_seqs], distinct; an id the cache lacks starts a new sequence
    const int64_t *q_offsets = nullptr;  // [num_seqs + 1]: rows of x and out per sequence, its new tokens
    bool causal = false;
};

// A ragged batch through a self-attention layer: sequence s owns rows offsets[s] .. offsets[s+1]-1
// of x and out, no padding.
struct LayerVarlenForward {
    int64_t num_seqs = 0;
    const int64_t *offsets = nullptr;  // [num_seqs + 1], non-decreasing, starting at 0
    bool causal = false;
};

class KVCache;

class Layer {
public:
    // Validates the configuration and the weights and packs the weights for rt's microkernel and
    // tiles. Throws mha::Error naming the field on bad input.
    Layer(Runtime &rt, const LayerConfig &config, const LayerWeights &weights);
    ~Layer();
    Layer(const Layer &) = delete;
    Layer &operator=(const Layer &) = delete;

    // query [batch, q_len, E], key [batch, kv_len, kdim], value [batch, kv_len, vdim] ->
    // out [batch, q_len, E]. key and value both NULL means self-attention on query (kv_len must
    // then be 0 or q_len); so does passing query itself as both. rt must use the ISA and tiles the
    // layer was packed for (any thread count). Many host threads may call one layer at once. The
    // result is bitwise identical for any thread count and for a sequence alone or in a batch.
    // Throws mha::Error on bad input, before writing anything.
    void forward(Runtime &rt, const LayerForward &p, const float *query, const float *key, const float *value,
                 float *out) const;

    // x [total_q, E] -> out [total_q, E]: projects the new tokens, appends their K and V to each
    // sequence of the cache, attends over the cache, projects out. The cache's heads and dims must
    // match the layer's. Every sequence's append is checked before any is made: not enough free
    // blocks throws Error(out_of_memory) with nothing appended or written. A token's output has the
    // bits that forward() gives it in a causal self-attention over its whole sequence.
    void forward_cached(Runtime &rt, KVCache &cache, const LayerCachedForward &p, const float *x, float *out) const;

    // x [total, E] -> out [total, E] for a ragged batch (self-attention layers only); a row gets
    // the bits forward() gives it in its sequence alone.
    void forward_varlen(Runtime &rt, const LayerVarlenForward &p, const float *x, float *out) const;

    const LayerConfig &config() const;  // resolved
    // Floating-point operations of one forward call (projections, attention without masks, output).
    double flops(const LayerForward &p) const;

    struct Impl;
    const Impl &impl() const { return *impl_; }

private:
    std::unique_ptr<Impl> impl_;
};

} // namespace mha
