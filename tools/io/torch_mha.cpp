#include "io/torch_mha.hpp"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <map>
#include <set>

namespace mha::io {

namespace fs = std::filesystem;

StateDict::StateDict(const std::string &path, const std::string &prefix) : path_(path), prefix_(prefix) {
    if (path.ends_with(".safetensors")) {
        st_ = std::make_shared<const SafeTensors>(SafeTensors::read(path));
    } else if (!fs::is_directory(path)) {
        throw FileError(path + ": expected a directory of .npy files or a .safetensors file, found " +
                        (fs::exists(path) ? "another kind of file" : "nothing (missing)"));
    }
}

bool StateDict::has(const std::string &key) const {
    return st_ ? st_->contains(prefix_ + key) : fs::exists(fs::path(path_) / (prefix_ + key + ".npy"));
}

std::string StateDict::where(const std::string &key) const {
    return st_ ? path_ + " [" + prefix_ + key + "]" : (fs::path(path_) / (prefix_ + key + ".npy")).string();
}

Array StateDict::array(const std::string &key) const { return st_ ? st_->get(prefix_ + key) : read_npy(where(key)); }

std::vector<float> StateDict::floats(const std::string &key, const std::vector<int64_t> &shape) const {
    if (!has(key)) throw FileError(where(key) + ": missing (expected " + shape_str(shape) + " float32)");
    return to_floats(where(key), array(key), shape);
}

std::vector<std::string> StateDict::keys() const {
    std::vector<std::string> out;
    auto take = [&](const std::string &name) {
        if (name.size() > prefix_.size() && name.starts_with(prefix_)) out.push_back(name.substr(prefix_.size()));
    };
    if (st_) {
        for (const std::string &k : st_->keys()) take(k);
    } else {
        std::error_code ec;
        for (const auto &e : fs::directory_iterator(path_, ec)) {
            const std::string name = e.path().filename().string();
            if (name.size() > 4 && name.ends_with(".npy") && !e.is_directory())
                take(name.substr(0, name.size() - 4));
        }
        if (ec) throw FileError(path_ + ": cannot list the directory (" + ec.message() + ")");
    }
    std::sort(out.begin(), out.end());
    return out;
}

StateDict StateDict::sub(const std::string &more) const {
    StateDict d = *this;
    d.prefix_ += more;
    return d;
}

MhaWeights load_mha_weights(const StateDict &sd, int64_t num_heads) {
    for (const char *unsupported : {"bias_k", "bias_v"})
        if (sd.has(unsupported))
            throw FileError(sd.where(unsupported) + ": add_bias_kv is not supported (expected no bias_k / bias_v)");
    MhaWeights w;
    const Array ow = sd.array("out_proj.weight");
    if (ow.shape.size() != 2 || ow.shape[0] != ow.shape[1])
        throw FileError(sd.where("out_proj.weight") + ": expected shape [E, E], found " + ow.shape_str());
    const int64_t E = ow.shape[0];
    w.config.embed_dim = E;
    w.config.num_heads = num_heads;
    w.out_proj_weight = to_floats(sd.where("out_proj.weight"), ow, {E, E});
    if (sd.has("out_proj.bias")) w.out_proj_bias = sd.floats("out_proj.bias", {E});
    if (sd.has("in_proj_bias")) w.in_proj_bias = sd.floats("in_proj_bias", {3 * E});
    if (sd.has("in_proj_weight")) {
        w.in_proj_weight = sd.floats("in_proj_weight", {3 * E, E});
        return w;
    }
    w.q_proj_weight = sd.floats("q_proj_weight", {E, E});
    const Array ka = sd.array("k_proj_weight"), va = sd.array("v_proj_weight");
    if (ka.shape.size() != 2 || va.shape.size() != 2)
        throw FileError(sd.where("k_proj_weight") + ": expected shape [E, kdim], found " + ka.shape_str());
    w.config.kdim = ka.shape[1];
    w.config.vdim = va.shape[1];
    w.k_proj_weight = to_floats(sd.where("k_proj_weight"), ka, {E, w.config.kdim});
    w.v_proj_weight = to_floats(sd.where("v_proj_weight"), va, {E, w.config.vdim});
    return w;
}

LayerWeights MhaWeights::view() const {
    auto or_null = [](const std::vector<float> &v) { return v.empty() ? nullptr : v.data(); };
    if (!in_proj_weight.empty())
        return LayerWeights::from_in_proj(config, in_proj_weight.data(), or_null(in_proj_bias), out_proj_weight.data(),
                                          or_null(out_proj_bias));
    const int64_t E = config.embed_dim;
    LayerWeights lw;
    lw.q_weight = or_null(q_proj_weight);
    lw.k_weight = or_null(k_proj_weight);
    lw.v_weight = or_null(v_proj_weight);
    lw.out_weight = or_null(out_proj_weight);
    if (!in_proj_bias.empty()) {
        lw.q_bias = in_proj_bias.data();
        lw.k_bias = in_proj_bias.data() + E;
        lw.v_bias = in_proj_bias.data() + 2 * E;
    }
    lw.out_bias = or_null(out_proj_bias);
    return lw;
}

namespace {

// "layers.<i>." -> i; -1 if the key does not start so.
int64_t layer_index(const std::string &key) {
    if (!key.starts_with("layers.")) return -1;
    const size_t dot = key.find('.', 7);
    if (dot == std::string::npos || dot == 7 || dot - 7 > 9) return -1;
    int64_t i = 0;
    for (size_t c = 7; c < dot; ++c) {
        if (key[c] < '0' || key[c] > '9') return -1;
        i = i * 10 + (key[c] - '0');
    }
    if (key[7] == '0' && dot > 8) return -1;  // "layers.01." is no layer of PyTorch's
    return i;
}

// The keys one nn.TransformerEncoderLayer writes, required ones first.
const char *const kLayerKeys[] = {"self_attn.in_proj_weight", "self_attn.out_proj.weight", "linear1.weight",
                                  "linear2.weight", "norm1.weight", "norm2.weight", "self_attn.in_proj_bias",
                                  "self_attn.out_proj.bias", "linear1.bias", "linear2.bias", "norm1.bias",
                                  "norm2.bias"};

std::vector<float> optional(const StateDict &sd, const std::string &key, const std::vector<int64_t> &shape) {
    return sd.has(key) ? sd.floats(key, shape) : std::vector<float>{};
}

} // namespace

EncoderStackWeights load_encoder_weights(const StateDict &sd, const EncoderOptions &o) {
    const int64_t N = o.num_layers;
    const std::vector<std::string> keys = sd.keys();
    // Which form: bare keys (one nn.TransformerEncoderLayer) or "layers.<i>." (nn.TransformerEncoder).
    const bool bare = sd.has("self_attn.in_proj_weight");
    int64_t found_layers = 0;  // 1 + the largest layer index among the keys
    for (const std::string &k : keys) found_layers = std::max(found_layers, layer_index(k) + 1);
    const std::string what = bare ? "an nn.TransformerEncoderLayer" : "an nn.TransformerEncoder of " + std::to_string(N) +
                                                                          (N == 1 ? " layer" : " layers");
    if (bare && N > 1)
        throw FileError(sd.where("layers.0.self_attn.in_proj_weight") + ": missing: the state_dict holds one " +
                        "nn.TransformerEncoderLayer's keys (self_attn.in_proj_weight, ...), but --encoder-layers " +
                        std::to_string(N) + " needs an nn.TransformerEncoder's (layers.0. to layers." +
                        std::to_string(N - 1) + ".)");
    if (!bare && found_layers > N) {
        std::string extra;
        for (const std::string &k : keys)
            if (layer_index(k) >= N) {
                extra = k;
                break;
            }
        throw FileError(sd.where(extra) + ": the state_dict holds " + std::to_string(found_layers) +
                        " layers (layers.0. to layers." + std::to_string(found_layers - 1) + ".), --encoder-layers asks for " +
                        std::to_string(N));
    }
    if (!bare && found_layers < N)
        throw FileError(sd.where("layers." + std::to_string(found_layers) + ".self_attn.in_proj_weight") +
                        ": missing: the state_dict holds " +
                        (found_layers ? std::to_string(found_layers) + " layer" + (found_layers > 1 ? "s" : "") +
                                            " (layers.0. to layers." + std::to_string(found_layers - 1) + ".)"
                                      : std::string("no encoder layer (expected self_attn.in_proj_weight, or ") +
                                            "layers.<i>.self_attn.in_proj_weight for an nn.TransformerEncoder)") +
                        ", --encoder-layers asks for " + std::to_string(N));

    // Every key must belong to a layer asked for (or be the stack's final norm), as PyTorch's
    // load_state_dict(strict=True) requires.
    std::set<std::string> expected;
    for (int64_t i = 0; i < N; ++i)
        for (const char *k : kLayerKeys) expected.insert((bare ? std::string() : "layers." + std::to_string(i) + ".") + k);
    if (!bare) {
        expected.insert("norm.weight");
        expected.insert("norm.bias");
    }
    for (const std::string &k : keys)
        if (!expected.count(k)) {
            const bool attn_extra = k.ends_with("self_attn.bias_k") || k.ends_with("self_attn.bias_v");
            throw FileError(sd.where(k) + (attn_extra ? ": add_bias_kv is not supported (expected no bias_k / bias_v)"
                                                      : ": unexpected key for " + what + " (expected " +
                                                            (bare ? "" : "layers.<i>.") +
                                                            "self_attn.in_proj_weight, self_attn.out_proj.weight, "
                                                            "linear1.weight, linear2.weight, norm1.weight, norm2.weight "
                                                            "and their biases" +
                                                            (bare ? "" : ", norm.weight, norm.bias") + ")"));
        }

    EncoderStackWeights w;
    EncoderConfig &c = w.config;
    c.attention.num_heads = o.num_heads;
    c.attention.norm = o.norm_first ? Norm::pre : Norm::post;
    c.attention.norm_eps = o.norm_eps;
    c.activation = o.activation;
    int64_t E = 0, F = o.ffn_dim;
    for (int64_t i = 0; i < N; ++i) {
        const StateDict l = sd.sub(bare ? "" : "layers." + std::to_string(i) + ".");
        EncoderLayerTensors t;
        t.prefix = l.prefix();
        if (i == 0) {  // the widths, from the first layer's shapes
            const std::string k = "self_attn.in_proj_weight";
            if (!l.has(k)) throw FileError(l.where(k) + ": missing (expected [3E, E] float32)");
            const Array a = l.array(k);
            if (a.shape.size() != 2 || a.shape[1] <= 0 || a.shape[0] != 3 * a.shape[1])
                throw FileError(l.where(k) + ": expected shape [3E, E], found " + a.shape_str());
            E = a.shape[1];
            if (F == 0) {
                const std::string k1 = "linear1.weight";
                if (!l.has(k1)) throw FileError(l.where(k1) + ": missing (expected [dim_feedforward, " + std::to_string(E) +
                                                "] float32)");
                const Array a1 = l.array(k1);
                if (a1.shape.size() != 2 || a1.shape[0] <= 0 || a1.shape[1] != E)
                    throw FileError(l.where(k1) + ": expected shape [dim_feedforward, " + std::to_string(E) + "], found " +
                                    a1.shape_str());
                F = a1.shape[0];
            }
        }
        t.in_proj_weight = l.floats("self_attn.in_proj_weight", {3 * E, E});
        t.out_proj_weight = l.floats("self_attn.out_proj.weight", {E, E});
        t.linear1_weight = l.floats("linear1.weight", {F, E});
        t.linear2_weight = l.floats("linear2.weight", {E, F});
        t.norm1_weight = l.floats("norm1.weight", {E});
        t.norm2_weight = l.floats("norm2.weight", {E});
        t.in_proj_bias = optional(l, "self_attn.in_proj_bias", {3 * E});
        t.out_proj_bias = optional(l, "self_attn.out_proj.bias", {E});
        t.linear1_bias = optional(l, "linear1.bias", {F});
        t.linear2_bias = optional(l, "linear2.bias", {E});
        t.norm1_bias = optional(l, "norm1.bias", {E});
        t.norm2_bias = optional(l, "norm2.bias", {E});
        w.layers.push_back(std::move(t));
    }
    c.attention.embed_dim = E;
    c.ffn_dim = F;
    if (!bare) {
        if (sd.has("norm.bias") && !sd.has("norm.weight"))
            throw FileError(sd.where("norm.weight") + ": missing (expected [" + std::to_string(E) +
                            "] float32, since norm.bias is there)");
        if (sd.has("norm.weight")) {
            w.final_norm_weight = sd.floats("norm.weight", {E});
            w.final_norm_bias = optional(sd, "norm.bias", {E});
        }
    }
    return w;
}

EncoderWeights EncoderStackWeights::view(size_t i) const {
    auto or_null = [](const std::vector<float> &v) { return v.empty() ? nullptr : v.data(); };
    const EncoderLayerTensors &t = layers.at(i);
    EncoderWeights w;
    w.attention = LayerWeights::from_in_proj(config.attention, t.in_proj_weight.data(), or_null(t.in_proj_bias),
                                             t.out_proj_weight.data(), or_null(t.out_proj_bias));
    w.attention.norm_weight = or_null(t.norm1_weight);
    w.attention.norm_bias = or_null(t.norm1_bias);
    w.linear1_weight = t.linear1_weight.data();
    w.linear1_bias = or_null(t.linear1_bias);
    w.linear2_weight = t.linear2_weight.data();
    w.linear2_bias = or_null(t.linear2_bias);
    w.norm2_weight = or_null(t.norm2_weight);
    w.norm2_bias = or_null(t.norm2_bias);
    return w;
}

void layer_norm_rows(float *x, int64_t rows, int64_t width, const float *weight, const float *bias, float eps) {
    for (int64_t r = 0; r < rows; ++r) {
        float *v = x + r * width;
        float sum = 0;
        for (int64_t e = 0; e < width; ++e) sum += v[e];
        const float mean = sum / static_cast<float>(width);
        float sq = 0;
        for (int64_t e = 0; e < width; ++e) sq += (v[e] - mean) * (v[e] - mean);
        const float rstd = 1.0f / std::sqrt(sq / static_cast<float>(width) + eps);
        for (int64_t e = 0; e < width; ++e)
            v[e] = (v[e] - mean) * rstd * (weight ? weight[e] : 1.0f) + (bias ? bias[e] : 0.0f);
    }
}

Mask from_torch_masks(int64_t B, int64_t Lq, int64_t Lk, const std::vector<uint8_t> &kpm,
                      const std::vector<uint8_t> &am) {
    Mask m;
    if (!kpm.empty() && am.empty()) {  // [B, Lk], the same for every query
        m.allowed.resize(kpm.size());
        for (size_t i = 0; i < kpm.size(); ++i) m.allowed[i] = !kpm[i];
        m.batch_stride = Lk;
    } else if (kpm.empty() && !am.empty()) {  // [Lq, Lk], the same for every batch
        m.allowed.resize(am.size());
        for (size_t i = 0; i < am.size(); ++i) m.allowed[i] = !am[i];
        m.row_stride = Lk;
    } else if (!kpm.empty()) {  // both: [B, Lq, Lk]
        m.allowed.resize(static_cast<size_t>(B * Lq * Lk));
        for (int64_t b = 0; b < B; ++b)
            for (int64_t i = 0; i < Lq; ++i)
                for (int64_t j = 0; j < Lk; ++j)
                    m.allowed[static_cast<size_t>((b * Lq + i) * Lk + j)] =
                        !kpm[static_cast<size_t>(b * Lk + j)] && !am[static_cast<size_t>(i * Lk + j)];
        m.batch_stride = Lq * Lk;
        m.row_stride = Lk;
    }
    return m;
}

} // namespace mha::io
