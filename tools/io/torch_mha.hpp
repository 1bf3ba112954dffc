// PyTorch's nn.MultiheadAttention as files hold it: its state_dict (a directory of <key>.npy files,
// or a .safetensors file with a key prefix) and its masks, turned into mha's layer weights and mask.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "io/npy.hpp"
#include "io/safetensors.hpp"
#include "mha/encoder.hpp"
#include "mha/layer.hpp"

namespace mha::io {

// The tensors of one layer's state_dict. Every failure throws FileError naming the file (and the
// key inside a .safetensors file). Keys are taken relative to the prefix: inside a .safetensors
// file the tensor prefix+key, in a directory the file prefix+key.npy.
class StateDict {
public:
    StateDict(const std::string &path, const std::string &prefix);
    bool has(const std::string &key) const;
    std::string where(const std::string &key) const;  // the file, or "file [prefix+key]"
    Array array(const std::string &key) const;
    // The tensor as float32 with this shape (-1 = any size).
    std::vector<float> floats(const std::string &key, const std::vector<int64_t> &shape) const;
    // Every key under the prefix (without it), sorted: the tensors of a .safetensors file, the .npy
    // files of a directory.
    std::vector<std::string> keys() const;
    // The same state_dict seen under prefix() + more (e.g. "layers.0."); shares the file.
    StateDict sub(const std::string &more) const;
    const std::string &prefix() const { return prefix_; }

private:
    std::string path_, prefix_;
    std::shared_ptr<const SafeTensors> st_;
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

// nn.TransformerEncoderLayer(batch_first=True) or a stack of them, nn.TransformerEncoder, as its
// state_dict holds it; what the state_dict does not say (heads, activation, norm order, eps) comes
// from the caller.
struct EncoderOptions {
    int64_t num_layers = 1;  // 1: an nn.TransformerEncoderLayer's keys, or a one-layer stack's
    int64_t num_heads = 0;
    int64_t ffn_dim = 0;     // 0: linear1.weight's rows; otherwise every linear1/linear2 must fit it
    Activation activation = Activation::relu;
    bool norm_first = false;
    float norm_eps = 1e-5f;
};

// One layer's tensors, owned. Biases may be absent (empty: PyTorch 2's bias=False).
struct EncoderLayerTensors {
    std::string prefix;  // its keys' prefix in the state_dict: "" or "layers.<i>."
    std::vector<float> in_proj_weight, in_proj_bias, out_proj_weight, out_proj_bias, linear1_weight, linear1_bias,
        linear2_weight, linear2_bias, norm1_weight, norm1_bias, norm2_weight, norm2_bias;
};

struct EncoderStackWeights {
    EncoderConfig config;  // every layer's (embed_dim from the shapes, the rest from the options)
    std::vector<EncoderLayerTensors> layers;  // in order: layer 0 first
    // nn.TransformerEncoder(norm=LayerNorm(E)): its norm.weight / norm.bias, applied after the last
    // layer with config.attention.norm_eps; both empty when the state_dict has none.
    std::vector<float> final_norm_weight, final_norm_bias;
    EncoderWeights view(size_t layer) const;  // pointers into layers[layer]
};

// Reads and checks every layer: self_attn.in_proj_weight [3E, E], self_attn.out_proj.weight [E, E],
// linear1.weight [F, E], linear2.weight [E, F], norm1.weight and norm2.weight [E] are required, their
// biases optional. num_layers = 1 takes the keys bare (nn.TransformerEncoderLayer) or under
// "layers.0." (a one-layer nn.TransformerEncoder); more layers take them under "layers.<i>.". A
// missing key, a wrong shape or dtype, a key that belongs to no layer asked for, or a state_dict with
// more or fewer layers throws FileError naming the key.
EncoderStackWeights load_encoder_weights(const StateDict &sd, const EncoderOptions &o);

// LayerNorm over each of `rows` rows of `width` values in place (fp32, two passes over the row):
// weight and bias may be NULL (1 and 0).
void layer_norm_rows(float *x, int64_t rows, int64_t width, const float *weight, const float *bias, float eps);

// PyTorch's key_padding_mask [B, Lk] and bool attn_mask [Lq, Lk] (nonzero = not allowed; either may
// be empty) as one mask of ours (nonzero = may attend), in the most compact form that holds them.
struct Mask {
    std::vector<uint8_t> allowed;  // empty: no mask
    int64_t batch_stride = 0, row_stride = 0;
};
Mask from_torch_masks(int64_t B, int64_t Lq, int64_t Lk, const std::vector<uint8_t> &key_padding_mask,
                      const std::vector<uint8_t> &attn_mask);

} // namespace mha::io
