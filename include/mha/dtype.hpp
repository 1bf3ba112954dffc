// Storage types of the KV cache and of a layer's weights (arithmetic stays fp32), and the
// Add & Norm placements of the layers.
#pragma once

namespace mha {

enum class DType { f32 = 0, bf16 = 1, i8 = 2 };  // i8: the KV cache only

// See mha_norm in mha.h: none, out = LayerNorm(x + f(x)) (post), or out = x + f(LayerNorm(x)) (pre).
enum class Norm { none = 0, post = 1, pre = 2 };

} // namespace mha
