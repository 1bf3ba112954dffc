// mha::EncoderLayer: nn.TransformerEncoderLayer (batch_first, eval) on mha's layer, GEMMs and
// Add & Norm. Post-norm (norm_first=False):
//   y = LayerNorm1(x + SelfAttention(x)),   out = LayerNorm2(y + FFN(y))
// pre-norm (norm_first=True):
//   y = x + SelfAttention(LayerNorm1(x)),   out = y + FFN(LayerNorm2(y))
// with FFN(y) = linear2(activation(linear1(y))), the bias and the activation in linear1's GEMM
// epilogue. Weights are packed once, when the layer is built.
#pragma once

#include <cstdint>
#include <memory>

#include "mha/layer.hpp"

namespace mha {

enum class Activation { relu = 0, gelu = 1 };  // gelu: x/2 (1 + erf(x / sqrt 2)), PyTorch's "gelu"

struct EncoderConfig {
    LayerConfig attention;  // self-attention; its norm (post or pre, not none) applies to both sub-blocks
    int64_t ffn_dim = 0;
    Activation activation = Activation::relu;
};

struct EncoderWeights {
    LayerWeights attention;  // norm_weight / norm_bias: PyTorch's norm1
    const float *linear1_weight = nullptr, *linear1_bias = nullptr;  // [ffn_dim, E], [ffn_dim] (NULL: none)
    const float *linear2_weight = nullptr, *linear2_bias = nullptr;  // [E, ffn_dim], [E]
    const float *norm2_weight = nullptr, *norm2_bias = nullptr;      // [E]; NULL means 1 and 0
};

class EncoderLayer {
public:
    // Throws mha::Error naming the field on bad input.
    EncoderLayer(Runtime &rt, const EncoderConfig &config, const EncoderWeights &weights);
    ~EncoderLayer();
    EncoderLayer(const EncoderLayer &) = delete;
    EncoderLayer &operator=(const EncoderLayer &) = delete;

    // x [batch, q_len, E] -> out [batch, q_len, E] (x == out is allowed). p: batch, q_len, kv_len
    // (0 or q_len), causal, kv_valid_lens and mask as for Layer::forward; p.weights must be NULL.
    // Bitwise the same for any thread count and for a sequence alone or in a batch.
    void forward(Runtime &rt, const LayerForward &p, const float *x, float *out) const;
    // A ragged batch, x [total, E] -> out [total, E] (see LayerVarlenForward): no padding computed.
    void forward_varlen(Runtime &rt, const LayerVarlenForward &p, const float *x, float *out) const;

    const EncoderConfig &config() const;  // resolved
    double flops(const LayerForward &p) const;

    struct Impl;

private:
    std::unique_ptr<Impl> impl_;
};

} // namespace mha
