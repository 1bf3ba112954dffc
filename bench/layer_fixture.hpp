// A multi-head attention layer with random PyTorch-layout weights and its input, as bench_layer and
// mha-bench's layer suite run it (self-attention, E = embed, H heads).
#pragma once

#include <memory>
#include <vector>

#include "bench/bench_support.hpp"
#include "mha/attention.hpp"
#include "mha/gemm.hpp"
#include "mha/layer.hpp"

namespace mha::bench {

struct LayerFixture {
    LayerShape shape;
    std::vector<float> w_in, b_in, w_out, b_out, x, out, q, k, v, o, qkv, scratch, scores;
    std::unique_ptr<Layer> layer;
    LayerForward forward_params;
    AttentionParams attention_params;
    // On qkv as the layer lays it out, [T, q | k | v] with rows 3E apart, the output over q (in
    // place, as Layer::forward runs it).
    AttentionParams layer_attention_params;

    LayerFixture(Runtime &rt, const LayerShape &s) : shape(s) {
        const int64_t E = s.embed, T = s.batch * s.len;
        auto fill = [](std::vector<float> &v, size_t n, float scale) {
            v.resize(n);
            for (size_t i = 0; i < n; ++i) v[i] = static_cast<float>(static_cast<int64_t>(i * 7919 % 1001) - 500) * scale;
        };
        fill(w_in, static_cast<size_t>(3 * E * E), 1e-4f);
        fill(b_in, static_cast<size_t>(3 * E), 1e-3f);
        fill(w_out, static_cast<size_t>(E * E), 1e-4f);
        fill(b_out, static_cast<size_t>(E), 1e-3f);
        fill(x, static_cast<size_t>(T * E), 2e-3f);
        out.resize(x.size());
        q.assign(x.size(), 0.01f);
        k.assign(x.size(), 0.02f);
        v.assign(x.size(), 0.5f);
        o.resize(x.size());
        qkv.resize(x.size() * 3);
        LayerConfig c;
        c.embed_dim = E;
        c.num_heads = s.heads;
        layer = std::make_unique<Layer>(rt, c, LayerWeights::from_in_proj(c, w_in.data(), b_in.data(), w_out.data(),
                                                                           b_out.data()));
        forward_params.batch = s.batch;
        forward_params.q_len = forward_params.kv_len = s.len;
        attention_params.batch = s.batch;
        attention_params.q_len = attention_params.kv_len = s.len;
        attention_params.num_heads = attention_params.num_kv_heads = s.heads;
        attention_params.head_dim = attention_params.value_dim = E / s.heads;
        layer_attention_params = attention_params;
        layer_attention_params.q_stride = layer_attention_params.k_stride = layer_attention_params.v_stride = 3 * E;
        layer_attention_params.out_stride = 3 * E;
    }
    void forward(Runtime &rt) { layer->forward(rt, forward_params, x.data(), nullptr, nullptr, out.data()); }
    // The attention step alone, on buffers of its own: repeated, it runs on what its previous call
    // left in the caches (mha-bench's attention_alone_ms).
    void attention_only(Runtime &rt) { attention(rt, attention_params, q.data(), k.data(), v.data(), o.data()); }
    // The attention step as the layer runs it: project_qkv() writes its input [T, q | k | v] as the
    // layer's QKV projection does (one GEMM against in_proj_weight^T, without the bias; untimed by
    // the caller), then attention_in_layer() reads it from wherever that GEMM left it in the caches
    // and writes its output over q.
    void project_qkv(Runtime &rt) {
        const int64_t E = shape.embed, T = shape.batch * shape.len;
        sgemm(rt, Trans::N, Trans::T, T, 3 * E, E, 1.0f, x.data(), E, w_in.data(), E, 0.0f, qkv.data(), 3 * E);
    }
    void attention_in_layer(Runtime &rt) {
        const int64_t E = shape.embed;
        attention(rt, layer_attention_params, qkv.data(), qkv.data() + E, qkv.data() + 2 * E, qkv.data());
    }
    void onednn(int threads) {
        dnnl_layer(threads, shape, x.data(), w_in.data(), b_in.data(), w_out.data(), b_out.data(), out.data(), scratch,
                   scores);
    }
};

} // namespace mha::bench
