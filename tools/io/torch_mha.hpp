// PyTorch's nn.MultiheadAttention as files hold it: its state_dict (a directory of <key>.npy files,
// or a .safetensors file with a key prefix) and its masks, turned into mha's layer weights and mask.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "io/npy.hpp"
#include "io/safetensors.hpp"
#include "mha/layer.hpp"

namespace mha::io {

// The tensors of one layer's state_dict. Every failure throws FileError naming the file (and the
// key inside a .safetensors file).
class StateDict {
public:
    StateDict(const std::string &path, const std::string &prefix);
    bool has(const std::string &key) const;
    std::string where(const std::string &key) const;  // the file, or "file [prefix+key]"
    Array array(const std::string &key) const;
    // The tensor as float32 with this shape (-1 = any size).
    std::vector<float> floats(const std::string &key, const std::vector<int64_t> &shape) const;

private:
    std::string path_, prefix_;
    std::optional<SafeTensors> st_;
};

// The weights of an nn.MultiheadAttention state_dict, owned: in_proj_weight [3E, E], or
// q/k/v_proj_weight when kdim or vdim differ from E; in_proj_bias [3E] and out_proj.bias [E] may be
// absent (empty).
struct MhaWeights {
    LayerConfig config;  // embed_dim and num_heads, and kdim and vdim from the shapes
    std::vector<float> in_proj_weight, q_proj_weight, k_proj_weight, v_proj_weight, in_proj_bias, out_proj_weight,
        out_proj_bias;
    LayerWeights view() const;  // pointers into the vectors above
};
MhaWeights load_mha_weights(const StateDict &sd, int64_t num_heads);

// PyTorch's key_padding_mask [B, Lk] and bool attn_mask [Lq, Lk] (nonzero = not allowed; either may
// be empty) as one mask of ours (nonzero = may attend), in the most compact form that holds them.
struct Mask {
    std::vector<uint8_t> allowed;  // empty: no mask
    int64_t batch_stride = 0, row_stride = 0;
};
Mask from_torch_masks(int64_t B, int64_t Lq, int64_t Lk, const std::vector<uint8_t> &key_padding_mask,
                      const std::vector<uint8_t> &attn_mask);

} // namespace mha::io
