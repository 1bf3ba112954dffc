#include "io/torch_mha.hpp"

#include <filesystem>

namespace mha::io {

namespace fs = std::filesystem;

StateDict::StateDict(const std::string &path, const std::string &prefix) : path_(path), prefix_(prefix) {
    if (path.ends_with(".safetensors")) {
        st_ = SafeTensors::read(path);
    } else if (!fs::is_directory(path)) {
        throw FileError(path + ": expected a directory of .npy files or a .safetensors file, found " +
                        (fs::exists(path) ? "another kind of file" : "nothing (missing)"));
    }
}

bool StateDict::has(const std::string &key) const {
    return st_ ? st_->contains(prefix_ + key) : fs::exists(fs::path(path_) / (key + ".npy"));
}

std::string StateDict::where(const std::string &key) const {
    return st_ ? path_ + " [" + prefix_ + key + "]" : (fs::path(path_) / (key + ".npy")).string();
}

Array StateDict::array(const std::string &key) const { return st_ ? st_->get(prefix_ + key) : read_npy(where(key)); }

std::vector<float> StateDict::floats(const std::string &key, const std::vector<int64_t> &shape) const {
    if (!has(key)) throw FileError(where(key) + ": missing (expected " + shape_str(shape) + " float32)");
    return to_floats(where(key), array(key), shape);
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
