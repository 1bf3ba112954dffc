// The attention layer's Add & Norm (post and pre) against the double reference (see encoder_util.hpp).
#include <doctest/doctest.h>

#include "encoder_util.hpp"

using namespace mha;
using namespace encoder_test;

namespace {

struct LayerCase {
    const char *name;
    LayerConfig config;  // norm is set per run
    int64_t B, Lq, Lk;
    bool self = true, causal = false;
    int valid = 0, mask = 0;
    bool biases = true, norm_params = true;
};

void run_layer_case(const LayerCase &cs, Norm norm, Runtime &rt) {
    CAPTURE(std::string(cs.name));
    CAPTURE(std::string(norm_name(norm)));
    LayerConfig c = cs.config;
    c.norm = norm;
    const Dims d = dims_of(c);
    const AttnWeights w = random_attn(c, 7);
    const LayerWeights lw = w.view(cs.biases, cs.norm_params);
    Layer layer(rt, c, lw);
    const auto query = random_floats(static_cast<size_t>(cs.B * cs.Lq * d.E), 11);
    const auto key = random_floats(static_cast<size_t>(cs.B * cs.Lk * d.kdim), 12);
    const auto value = random_floats(static_cast<size_t>(cs.B * cs.Lk * d.vdim), 13);
    LayerForward p;
    p.batch = cs.B;
    p.q_len = cs.Lq;
    p.kv_len = cs.self ? cs.Lq : cs.Lk;
    p.causal = cs.causal;
    Masks m;
    set_masks(p, m, cs.valid, cs.mask);
    std::vector<float> out(static_cast<size_t>(cs.B * cs.Lq * d.E), test::kSentinel);
    if (cs.self)
        layer.forward(rt, p, query.data(), nullptr, nullptr, out.data());
    else
        layer.forward(rt, p, query.data(), key.data(), value.data(), out.data());
    const auto want = reference_layer(c, lw, p, query.data(), cs.self ? nullptr : key.data(),
                                      cs.self ? nullptr : value.data());
    check_close(out, want, kRefTol, "out");
    if (cs.self) {  // query passed as key and value is self-attention too (pre-norm normalizes all three)
        std::vector<float> again(out.size(), test::kSentinel);
        layer.forward(rt, p, query.data(), query.data(), query.data(), again.data());
        CHECK(test::same_bits(again, out));
    }
}

} // namespace

TEST_CASE("layer Add & Norm (post and pre) matches the double reference") {
    const auto cfg = [](auto... sizes) { return test::layer_config(sizes...); };
    const std::vector<LayerCase> cases = {
        {"self", cfg(32, 4), 2, 9, 9},
        {"self eps 1e-6", cfg(32, 4, 0, 0, 0, 0, 0, 1e-6f), 2, 5, 5},
        {"self odd E = 20", cfg(20, 4), 2, 7, 7},
        {"self head_dim 16 value_dim 8 (seed 002's shape, small)", cfg(24, 2, 0, 16, 8), 2, 5, 5},
        {"cross", cfg(32, 4), 2, 5, 11, false},
        {"cross kdim vdim != E", cfg(32, 4, 0, 0, 0, 24, 20), 2, 6, 13, false},
        {"cross gqa kdim, full mask", cfg(32, 4, 2, 0, 0, 17, 9), 2, 4, 9, false, false, 0, 2},
        {"self padding row (valid 0) + key padding mask", cfg(32, 4), 3, 6, 6, true, false, 1, 1},
        {"self causal + full mask + valid", cfg(20, 4, 2), 3, 7, 7, true, true, 1, 2},
        {"cross padding row + causal", cfg(32, 4, 0, 0, 0, 24, 20), 3, 4, 10, false, true, 1, 0},
        {"no biases", cfg(32, 4), 2, 6, 6, true, false, 0, 0, false},
        {"norm_weight / norm_bias NULL", cfg(32, 4), 2, 6, 6, true, false, 0, 0, true, false},
        {"cross, norm params NULL", cfg(32, 4, 0, 0, 0, 24, 20), 2, 3, 5, false, false, 0, 0, true, false},
    };
    for (const RuntimeOptions &o : runtime_options()) {
        Runtime rt(o);
        CAPTURE(describe(rt));
        for (const auto &cs : cases)
            for (Norm norm : {Norm::post, Norm::pre}) run_layer_case(cs, norm, rt);
    }
}

TEST_CASE("layer Add & Norm: pre-norm leaves key and value of cross-attention unnormalized") {
    // Cross-attention with key = value = a copy of query (not the same pointer): under pre-norm only
    // the query is normalized, so it differs from self-attention on the same values.
    Runtime rt(RuntimeOptions{1, {}, {}, {}});
    const LayerConfig c = layer_config(16, 2, Norm::pre);
    const AttnWeights w = random_attn(c, 3);
    Layer layer(rt, c, w.view());
    const auto x = random_floats(2 * 4 * 16, 5, -2.0f, 3.0f);  // far from normalized
    const std::vector<float> copy = x;
    LayerForward p;
    p.batch = 2;
    p.q_len = p.kv_len = 4;
    std::vector<float> self(x.size()), cross(x.size());
    layer.forward(rt, p, x.data(), nullptr, nullptr, self.data());
    layer.forward(rt, p, x.data(), copy.data(), copy.data(), cross.data());
    check_close(self, reference_layer(c, w.view(), p, x.data(), nullptr, nullptr), kRefTol, "self");
    check_close(cross, reference_layer(c, w.view(), p, x.data(), copy.data(), copy.data()), kRefTol, "cross");
    CHECK_FALSE(test::same_bits(self, cross));
}

TEST_CASE("layer Add & Norm: LayerNorm itself (zero out_weight: out = LayerNorm(query))") {
    // With out_weight = 0 and no out_bias the attention adds exactly 0, so post-norm gives
    // LayerNorm(query) and pre-norm gives query.
    const int64_t E = 20, B = 2, L = 4;
    LayerConfig c = layer_config(E, 4, Norm::post);
    AttnWeights w = random_attn(c, 9);
    std::fill(w.wo.begin(), w.wo.end(), 0.0f);
    LayerWeights lw = w.view();
    lw.out_bias = nullptr;
    LayerForward p;
    p.batch = B;
    p.q_len = p.kv_len = L;
    for (const RuntimeOptions &o : runtime_options()) {
        Runtime rt(o);
        CAPTURE(describe(rt));
        {  // a row of equal values gives norm_bias, not NaN
            for (float value : {0.25f, -3.0f, 0.0f, 1024.0f})
                for (bool norm_params : {true, false}) {
                    CAPTURE(value);
                    CAPTURE(norm_params);
                    const std::vector<float> x(static_cast<size_t>(B * L * E), value);
                    LayerWeights v = w.view(true, norm_params);
                    v.out_bias = nullptr;
                    Layer layer(rt, c, v);
                    std::vector<float> out(x.size(), test::kSentinel);
                    layer.forward(rt, p, x.data(), nullptr, nullptr, out.data());
                    for (size_t i = 0; i < out.size(); ++i) {
                        const float want = norm_params ? w.nb[i % E] : 0.0f;
                        REQUIRE_MESSAGE(std::abs(out[i] - want) <= 1e-6f,
                                        "element " << i << ": got " << out[i] << ", want " << want);
                    }
                }
            // An inexact constant (0.3 is no binary fraction): the bias up to rounding, and never NaN.
            const std::vector<float> x(static_cast<size_t>(B * L * E), 0.3f);
            Layer layer(rt, c, lw);
            std::vector<float> out(x.size(), test::kSentinel);
            layer.forward(rt, p, x.data(), nullptr, nullptr, out.data());
            for (size_t i = 0; i < out.size(); ++i)
                REQUIRE_MESSAGE(std::abs(out[i] - w.nb[i % E]) <= 2e-4f, "element " << i << ": got " << out[i]);
        }
        {  // eps: 0 means 1e-5, the configured one otherwise (rows of small variance, where it matters)
            const auto x = random_floats(static_cast<size_t>(B * L * E), 17, -0.01f, 0.01f);  // var ~ 3e-5
            for (float eps : {0.0f, 1e-5f, 1e-6f, 0.5f}) {
                CAPTURE(eps);
                LayerConfig ce = c;
                ce.norm_eps = eps;
                Layer layer(rt, ce, lw);
                std::vector<float> out(x.size(), test::kSentinel);
                layer.forward(rt, p, x.data(), nullptr, nullptr, out.data());
                check_close(out, ref::layer_norm(to_double(x.data(), B * L * E), B * L, E, lw.norm_weight,
                                                 lw.norm_bias, eps_of(eps)),
                            kRefTol, "LayerNorm(query)");
            }
            // eps 1e-5 and 1e-6 differ here by several percent: the check above sees a wrong default.
            const auto a = ref::layer_norm(to_double(x.data(), E), 1, E, nullptr, nullptr, 1e-5);
            const auto b = ref::layer_norm(to_double(x.data(), E), 1, E, nullptr, nullptr, 1e-6);
            CHECK(std::abs(a[0] - b[0]) > 1e-2 * std::abs(b[0]));
        }
        {  // pre-norm with a zero output projection returns query
            LayerConfig cp = c;
            cp.norm = Norm::pre;
            Layer layer(rt, cp, lw);
            const auto x = random_floats(static_cast<size_t>(B * L * E), 19);
            std::vector<float> out(x.size(), test::kSentinel);
            layer.forward(rt, p, x.data(), nullptr, nullptr, out.data());
            CHECK(test::same_bits(out, x));
        }
    }
}

TEST_CASE("layer Add & Norm: a NaN in one query row stays in that row") {
    // Cross-attention (finite key and value), so the NaN cannot reach other rows through the keys:
    // what is tested is that the residual and the LayerNorm keep to their row.
    const int64_t E = 24, B = 2, Lq = 4, Lk = 6;
    for (Norm norm : {Norm::post, Norm::pre}) {
        CAPTURE(std::string(norm_name(norm)));
        LayerConfig c = layer_config(E, 4, norm);
        c.kdim = 12;
        const Dims d = dims_of(c);
        const AttnWeights w = random_attn(c, 23);
        for (const RuntimeOptions &o : runtime_options()) {
            Runtime rt(o);
            CAPTURE(describe(rt));
            Layer layer(rt, c, w.view());
            auto query = random_floats(static_cast<size_t>(B * Lq * E), 1);
            const auto key = random_floats(static_cast<size_t>(B * Lk * d.kdim), 2);
            const auto value = random_floats(static_cast<size_t>(B * Lk * d.vdim), 3);
            LayerForward p;
            p.batch = B;
            p.q_len = Lq;
            p.kv_len = Lk;
            const auto want = reference_layer(c, w.view(), p, query.data(), key.data(), value.data());
            const int64_t bad_row = 1 * Lq + 2;  // batch 1, query 2
            query[static_cast<size_t>(bad_row * E + 5)] = std::numeric_limits<float>::quiet_NaN();
            std::vector<float> out(query.size(), test::kSentinel);
            layer.forward(rt, p, query.data(), key.data(), value.data(), out.data());
            int nans = 0;
            for (int64_t e = 0; e < E; ++e) nans += std::isnan(out[static_cast<size_t>(bad_row * E + e)]);
            if (norm == Norm::post)
                CHECK(nans == E);  // LayerNorm of a row with a NaN: its mean is NaN
            else
                CHECK(nans >= 1);
            std::vector<float> got_rest;
            std::vector<double> want_rest;
            for (int64_t r = 0; r < B * Lq; ++r)
                if (r != bad_row)
                    for (int64_t e = 0; e < E; ++e) {
                        got_rest.push_back(out[static_cast<size_t>(r * E + e)]);
                        want_rest.push_back(want[static_cast<size_t>(r * E + e)]);
                    }
            check_close(got_rest, want_rest, kRefTol, "the other rows");
        }
    }
}

TEST_CASE("layer Add & Norm through the KV cache: prefill + decode = the causal forward, bit for bit") {
    const int64_t E = 32, L = 40, P = 30;
    for (Norm norm : {Norm::post, Norm::pre}) {
        CAPTURE(std::string(norm_name(norm)));
        LayerConfig c = layer_config(E, 4, norm, 1e-6f);
        c.num_kv_heads = 2;
        const Dims d = dims_of(c);
        const AttnWeights w = random_attn(c, 61);
        Runtime rt1(RuntimeOptions{1, {}, {}, {}}), rt2(RuntimeOptions{2, {}, {}, {}});
        Layer layer(rt1, c, w.view());
        const auto x = random_floats(static_cast<size_t>(L * E), 62);
        LayerForward p;
        p.batch = 1;
        p.q_len = p.kv_len = L;
        p.causal = true;
        std::vector<float> full(x.size());
        layer.forward(rt1, p, x.data(), nullptr, nullptr, full.data());
        check_close(full, reference_layer(c, w.view(), p, x.data(), nullptr, nullptr), kRefTol, "causal forward");
        KVCacheConfig kc;
        kc.num_kv_heads = d.Hkv;
        kc.head_dim = d.D;
        kc.value_dim = d.Dv;
        kc.max_tokens = 2 * L;
        KVCache cache(rt1, kc);
        const int64_t seq = 3;
        std::vector<float> cached(x.size(), test::kSentinel);
        int64_t pos = 0;
        for (int64_t n : {P, int64_t{1}, int64_t{1}, L - P - 2}) {
            const int64_t offsets[2] = {0, n};
            LayerCachedForward cp;
            cp.num_seqs = 1;
            cp.seq_ids = &seq;
            cp.q_offsets = offsets;
            cp.causal = true;
            layer.forward_cached(pos % 2 ? rt2 : rt1, cache, cp, x.data() + pos * E, cached.data() + pos * E);
            pos += n;
        }
        CHECK(test::same_bits(cached, full));
    }
}
