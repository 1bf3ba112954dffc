// An encoder layer (nn.TransformerEncoderLayer: post-norm, relu) with hashed PyTorch-layout weights
// and its input, as mha-bench's encoder suite runs it: mha::EncoderLayer, and the same layer
// composed from oneDNN pieces (bench::dnnl_encoder_layer).
#pragma once

#include <algorithm>
#include <cmath>
#include <memory>
#include <vector>

#include "bench/bench_support.hpp"
#include "mha/encoder.hpp"

namespace mha::bench {

struct EncoderFixture {
    EncoderShape shape;
    std::vector<float> w_in, b_in, w_out, b_out, w1, b1, w2, b2, norm1_w, norm1_b, norm2_w, norm2_b, x, out, out_dnnl;
    DnnlEncoderScratch scratch;
    std::unique_ptr<EncoderLayer> layer;
    LayerForward params;
    static constexpr float kEps = 1e-5f;

    EncoderFixture(Runtime &rt, const EncoderShape &s) : shape(s) {
        const int64_t E = s.embed, F = s.ffn, T = s.batch * s.len;
        auto fill = [](std::vector<float> &v, int64_t n, uint64_t seed, float scale, float offset = 0.0f) {
            v.resize(static_cast<size_t>(n));
            fill_hashed(v.data(), v.size(), seed, scale);
            for (float &e : v) e += offset;
        };
        // Weights of about PyTorch's initial scale (1/sqrt(fan_in)), so activations stay O(1).
        const float se = 1.0f / std::sqrt(static_cast<float>(E)), sf = 1.0f / std::sqrt(static_cast<float>(F));
        fill(w_in, 3 * E * E, 101, se);
        fill(b_in, 3 * E, 102, 0.02f);
        fill(w_out, E * E, 103, se);
        fill(b_out, E, 104, 0.02f);
        fill(w1, F * E, 105, se);
        fill(b1, F, 106, 0.02f);
        fill(w2, E * F, 107, sf);
        fill(b2, E, 108, 0.02f);
        fill(norm1_w, E, 109, 0.1f, 1.0f);
        fill(norm1_b, E, 110, 0.1f);
        fill(norm2_w, E, 111, 0.1f, 1.0f);
        fill(norm2_b, E, 112, 0.1f);
        fill(x, T * E, 113, 1.0f);
        out.resize(x.size());
        out_dnnl.resize(x.size());
        EncoderConfig c;
        c.attention.embed_dim = E;
        c.attention.num_heads = s.heads;
        c.attention.norm = Norm::post;
        c.attention.norm_eps = kEps;
        c.ffn_dim = F;
        c.activation = Activation::relu;
        EncoderWeights w;
        w.attention = LayerWeights::from_in_proj(c.attention, w_in.data(), b_in.data(), w_out.data(), b_out.data());
        w.attention.norm_weight = norm1_w.data();
        w.attention.norm_bias = norm1_b.data();
        w.linear1_weight = w1.data();
        w.linear1_bias = b1.data();
        w.linear2_weight = w2.data();
        w.linear2_bias = b2.data();
        w.norm2_weight = norm2_w.data();
        w.norm2_bias = norm2_b.data();
        layer = std::make_unique<EncoderLayer>(rt, c, w);
        params.batch = s.batch;
        params.q_len = params.kv_len = s.len;
    }
    void forward(Runtime &rt) { layer->forward(rt, params, x.data(), out.data()); }
    void onednn(int threads) {
        const EncoderTensors t = {w_in.data(), b_in.data(), w_out.data(), b_out.data(), w1.data(), b1.data(),
                                  w2.data(), b2.data(), norm1_w.data(), norm1_b.data(), norm2_w.data(), norm2_b.data()};
        dnnl_encoder_layer(threads, shape, false, false, kEps, x.data(), t, out_dnnl.data(), scratch);
    }
    // The largest |ours - oneDNN's| over the outputs of the last runs of each.
    double max_abs_diff() const {
        double worst = 0;
        for (size_t i = 0; i < out.size(); ++i)
            worst = std::max(worst, std::abs(static_cast<double>(out[i]) - static_cast<double>(out_dnnl[i])));
        return worst;
    }
};

} // namespace mha::bench
