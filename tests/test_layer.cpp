// The multi-head attention layer against a double-precision reference layer, PyTorch's
// nn.MultiheadAttention (golden files), and itself (threads, batches, concurrency), plus bad input.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "io/npy.hpp"
#include "io/torch_mha.hpp"
#include "mha/layer.hpp"
#include "mha/mha.h"
#include "mha/serving.hpp"
#include "check_close.hpp"
#include "reference.hpp"
#include "test_util.hpp"

using namespace mha;
using test::check_close;
using test::random_floats;

namespace {

// All the weights of one layer, owned.
struct Weights {
    std::vector<float> wq, wk, wv, wo, bq, bk, bv, bo;
    LayerWeights view(bool q_bias = true, bool k_bias = true, bool v_bias = true, bool o_bias = true) const {
        LayerWeights w;
        w.q_weight = wq.data();
        w.k_weight = wk.data();
        w.v_weight = wv.data();
        w.out_weight = wo.data();
        w.q_bias = q_bias ? bq.data() : nullptr;
        w.k_bias = k_bias ? bk.data() : nullptr;
        w.v_bias = v_bias ? bv.data() : nullptr;
        w.out_bias = o_bias ? bo.data() : nullptr;
        return w;
    }
};

Weights random_weights(const LayerConfig &c, uint32_t seed) {
    const LayerConfig r = c.resolved();
    const int64_t nq = r.num_heads * r.head_dim, nk = r.num_kv_heads * r.head_dim, nv = r.num_kv_heads * r.value_dim;
    auto w = [&](int64_t out, int64_t in, uint32_t s) {
        const float a = 1.0f / std::sqrt(static_cast<float>(in));
        return random_floats(static_cast<size_t>(out * in), seed + s, -a, a);
    };
    Weights x;
    x.wq = w(nq, r.embed_dim, 1);
    x.wk = w(nk, r.kdim, 2);
    x.wv = w(nv, r.vdim, 3);
    x.wo = w(r.embed_dim, r.num_heads * r.value_dim, 4);
    x.bq = random_floats(static_cast<size_t>(nq), seed + 5, -0.5f, 0.5f);
    x.bk = random_floats(static_cast<size_t>(nk), seed + 6, -0.5f, 0.5f);
    x.bv = random_floats(static_cast<size_t>(nv), seed + 7, -0.5f, 0.5f);
    x.bo = random_floats(static_cast<size_t>(r.embed_dim), seed + 8, -0.5f, 0.5f);
    return x;
}

// y[t, o] = sum_i x[t, i] w[o, i] + b[o], in double.
std::vector<double> project(const float *x, int64_t tokens, int64_t in, const float *w, const float *b, int64_t out) {
    return ref::linear(x, tokens, in, w, b, out);
}

// The layer in double, straight from its definition.
std::vector<double> reference_layer(const LayerConfig &config, const LayerWeights &w, const LayerForward &p,
                                    const float *query, const float *key, const float *value,
                                    std::vector<double> *weights = nullptr) {
    const LayerConfig c = config.resolved();
    const int64_t nq = c.num_heads * c.head_dim, nk = c.num_kv_heads * c.head_dim, nv = c.num_kv_heads * c.value_dim;
    const auto q = project(query, p.batch * p.q_len, c.embed_dim, w.q_weight, w.q_bias, nq);
    const auto k = project(key, p.batch * p.kv_len, c.kdim, w.k_weight, w.k_bias, nk);
    const auto v = project(value, p.batch * p.kv_len, c.vdim, w.v_weight, w.v_bias, nv);
    ref::AttentionCase ac{p.batch, p.q_len, p.kv_len, c.num_heads, c.num_kv_heads, c.head_dim, c.value_dim,
                          1.0 / std::sqrt(static_cast<double>(c.head_dim)), p.causal, p.kv_valid_lens, p.mask,
                          p.mask_batch_stride, p.mask_row_stride};
    std::vector<double> o;
    ref::attention(ac, q.data(), k.data(), v.data(), o, weights);
    const int64_t tokens = p.batch * p.q_len, in = c.num_heads * c.value_dim;
    std::vector<double> out(static_cast<size_t>(tokens * c.embed_dim));
    for (int64_t t = 0; t < tokens; ++t)
        for (int64_t e = 0; e < c.embed_dim; ++e) {
            double s = w.out_bias ? w.out_bias[e] : 0.0;
            for (int64_t i = 0; i < in; ++i) s += o[static_cast<size_t>(t * in + i)] * w.out_weight[e * in + i];
            out[static_cast<size_t>(t * c.embed_dim + e)] = s;
        }
    return out;
}

// Self-attention of B random sequences of L tokens through a layer with these weights, against the
// reference layer.
void check_self_attention(Runtime &rt, const LayerConfig &c, const LayerWeights &lw, int64_t B, int64_t L,
                          uint32_t seed) {
    Layer layer(rt, c, lw);
    const auto x = random_floats(static_cast<size_t>(B * L * c.embed_dim), seed);
    LayerForward p;
    p.batch = B;
    p.q_len = p.kv_len = L;
    std::vector<float> out(x.size());
    layer.forward(rt, p, x.data(), nullptr, nullptr, out.data());
    check_close(out, reference_layer(c, lw, p, x.data(), x.data(), x.data()), 3e-5, "out");
}

struct Case {
    const char *name;
    LayerConfig config;
    int64_t B, Lq, Lk;
    bool self = true, causal = false, valid = false;
    int mask = 0;  // 0 none, 1 [B, 1, Lk] (key padding), 2 [B, Lq, Lk]
    bool biases = true, weights = false;
};

void run_case(const Case &cs, Runtime &rt) {
    CAPTURE(cs.name);
    const LayerConfig c = cs.config.resolved();
    const Weights w = random_weights(cs.config, 7);
    const LayerWeights lw = cs.biases ? w.view() : w.view(false, false, false, false);
    Layer layer(rt, cs.config, lw);
    const auto query = random_floats(static_cast<size_t>(cs.B * cs.Lq * c.embed_dim), 11);
    const auto key = cs.self ? query : random_floats(static_cast<size_t>(cs.B * cs.Lk * c.kdim), 12);
    const auto value = cs.self ? query : random_floats(static_cast<size_t>(cs.B * cs.Lk * c.vdim), 13);
    std::vector<int32_t> valid(static_cast<size_t>(cs.B));
    for (int64_t b = 0; b < cs.B; ++b) valid[static_cast<size_t>(b)] = static_cast<int32_t>(b == 0 ? 0 : cs.Lk - b + 1);
    std::vector<uint8_t> mask(static_cast<size_t>(cs.B * cs.Lq * cs.Lk));
    for (size_t i = 0; i < mask.size(); ++i) mask[i] = (i * 7 + 3) % 5 != 0;
    LayerForward p;
    p.batch = cs.B;
    p.q_len = cs.Lq;
    p.kv_len = cs.Lk;
    p.causal = cs.causal;
    if (cs.valid) p.kv_valid_lens = valid.data();
    if (cs.mask) {
        p.mask = mask.data();
        p.mask_batch_stride = cs.mask == 1 ? cs.Lk : cs.Lq * cs.Lk;
        p.mask_row_stride = cs.mask == 1 ? 0 : cs.Lk;
    }
    std::vector<float> weights(static_cast<size_t>(cs.B * c.num_heads * cs.Lq * cs.Lk), test::kSentinel);
    if (cs.weights) p.weights = weights.data();
    std::vector<float> out(static_cast<size_t>(cs.B * cs.Lq * c.embed_dim), test::kSentinel);
    if (cs.self)
        layer.forward(rt, p, query.data(), nullptr, nullptr, out.data());
    else
        layer.forward(rt, p, query.data(), key.data(), value.data(), out.data());
    std::vector<double> want_w;
    const auto want = reference_layer(cs.config, lw, p, query.data(), key.data(), value.data(), &want_w);
    check_close(out, want, 3e-5, "out");
    if (cs.weights) check_close(weights, want_w, 3e-6, "weights");
}

} // namespace

TEST_CASE("layer matches the double reference over every feature") {
    const auto cfg = [](auto... sizes) { return test::layer_config(sizes...); };
    const std::vector<Case> cases = {
        {"self", cfg(32, 4), 2, 9, 9},
        {"self one token", cfg(32, 4), 3, 1, 1},
        {"self E not a multiple of the tile", cfg(40, 5), 2, 17, 17},
        {"cross", cfg(32, 4), 2, 5, 11, false},
        {"cross kdim vdim", cfg(32, 4, 0, 0, 0, 24, 20), 2, 6, 13, false},
        {"gqa", cfg(32, 4, 2), 2, 7, 7},
        {"mqa cross", cfg(32, 4, 1), 2, 3, 8, false},
        {"head_dim != E/H, value_dim != head_dim", cfg(32, 4, 2, 12, 10), 2, 6, 6},
        {"head_dim != E/H cross kdim", cfg(24, 3, 0, 20, 7, 17, 9), 2, 4, 10, false},
        {"no bias", cfg(32, 4), 2, 6, 6, true, false, false, 0, false},
        {"causal", cfg(32, 4), 2, 12, 12, true, true},
        {"causal cross Lq < Lk", cfg(32, 4), 2, 4, 10, false, true},
        {"valid lens incl. 0", cfg(32, 4), 3, 5, 5, true, false, true},
        {"key padding mask", cfg(32, 4), 2, 6, 6, true, false, false, 1},
        {"full mask + causal + valid", cfg(32, 4, 2), 3, 7, 7, true, true, true, 2},
        {"weights", cfg(32, 4), 2, 5, 5, true, false, false, 0, true, true},
        {"weights cross gqa masked", cfg(32, 4, 2, 0, 0, 24, 20), 2, 4, 9, false, true, true, 2, true, true},
        // H * head_dim = 1024: the [tokens, q | k | v] scratch (3072 columns), and cross-attention's
        // Q (1024) and K | V (2048), would have rows a multiple of 4 KiB apart; their rows are padded.
        {"self, scratch rows padded off 4 KiB", cfg(16, 16, 0, 64, 64), 2, 9, 9},
        {"cross, scratch rows padded off 4 KiB", cfg(16, 16, 0, 64, 64), 2, 5, 11, false, true},
    };
    for (Isa isa : supported_isas())
        for (int threads : {1, 2}) {
            CAPTURE(std::string(isa_name(isa)));
            CAPTURE(threads);
            Runtime rt(RuntimeOptions{threads, isa, {}, {}});
            for (const auto &cs : cases) run_case(cs, rt);
        }
}

TEST_CASE("layer: empty batches, no queries and no keys") {
    Runtime rt(RuntimeOptions{1, {}, {}, {}});
    LayerConfig c;
    c.embed_dim = 16;
    c.num_heads = 2;
    c.kdim = 8;
    const Weights w = random_weights(c, 1);
    Layer layer(rt, c, w.view());
    const auto x = random_floats(3 * 16, 2), kv = random_floats(16, 3);
    std::vector<float> out(3 * 16, test::kSentinel);
    LayerForward p;
    p.batch = 0;
    p.q_len = 3;
    p.kv_len = 2;
    layer.forward(rt, p, nullptr, kv.data(), kv.data(), nullptr);  // nothing to do, nothing read
    p.batch = 1;
    p.q_len = 0;
    layer.forward(rt, p, nullptr, kv.data(), kv.data(), nullptr);
    // No keys: the attention gives zeros, so every output row is the output projection's bias.
    p.q_len = 3;
    p.kv_len = 0;
    layer.forward(rt, p, x.data(), kv.data(), kv.data(), out.data());
    for (int64_t t = 0; t < 3; ++t)
        for (int64_t e = 0; e < 16; ++e) CHECK(out[static_cast<size_t>(t * 16 + e)] == w.bo[static_cast<size_t>(e)]);
}

TEST_CASE("layer: a projection with only some biases") {
    Runtime rt(RuntimeOptions{1, {}, {}, {}});
    LayerConfig c;
    c.embed_dim = 32;
    c.num_heads = 4;
    const Weights w = random_weights(c, 3);
    for (int variant = 0; variant < 4; ++variant) {
        const LayerWeights lw = w.view(variant == 0, variant == 1, variant == 2, variant == 3);
        check_self_attention(rt, c, lw, 2, 5, 5);
    }
}

TEST_CASE("layer: PyTorch's packed in_proj_weight") {
    Runtime rt(RuntimeOptions{1, {}, {}, {}});
    LayerConfig c;
    c.embed_dim = 16;
    c.num_heads = 2;
    const auto in_w = random_floats(3 * 16 * 16, 1, -0.25f, 0.25f), in_b = random_floats(48, 2);
    const auto out_w = random_floats(16 * 16, 3, -0.25f, 0.25f), out_b = random_floats(16, 4);
    const LayerWeights lw = LayerWeights::from_in_proj(c, in_w.data(), in_b.data(), out_w.data(), out_b.data());
    CHECK(lw.k_weight == in_w.data() + 256);
    CHECK(lw.v_bias == in_b.data() + 32);
    check_self_attention(rt, c, lw, 1, 3, 9);
    LayerConfig gqa = c;
    gqa.num_kv_heads = 1;
    CHECK_THROWS_AS(LayerWeights::from_in_proj(gqa, in_w.data(), nullptr, out_w.data(), nullptr), Error);
    LayerConfig kd = c;
    kd.kdim = 8;
    CHECK_THROWS_AS(LayerWeights::from_in_proj(kd, in_w.data(), nullptr, out_w.data(), nullptr), Error);
}

namespace {

std::vector<float> load_floats(const std::string &path, const std::vector<int64_t> &shape) {
    return io::to_floats(path, io::read_npy(path), shape);
}

} // namespace

TEST_CASE("layer matches PyTorch's nn.MultiheadAttention (tests/data/gen_layer_golden.py)") {
    namespace fs = std::filesystem;
    const fs::path root = fs::path(MHA_TEST_DATA) / "layer";
    int cases = 0;
    for (const char *name : {"self", "cross_kdim_vdim", "no_bias", "key_padding", "causal"}) {
        CAPTURE(name);
        const fs::path d = root / name;
        int64_t H = 0;
        bool causal = false;
        {
            std::ifstream f(d / "case.txt");
            std::string word;
            while (f >> word)
                if (word == "num_heads") f >> H;
                else if (word == "causal") causal = true;
        }
        REQUIRE(H > 0);
        const auto qa = io::read_npy((d / "query.npy").string());
        const int64_t B = qa.shape[0], Lq = qa.shape[1], E = qa.shape[2];
        const auto query = io::to_floats("query", qa, {B, Lq, E});
        const bool cross = fs::exists(d / "key.npy");
        const auto ka = cross ? io::read_npy((d / "key.npy").string()) : qa;
        const auto va = cross ? io::read_npy((d / "value.npy").string()) : qa;
        const int64_t Lk = ka.shape[1], kdim = ka.shape[2], vdim = va.shape[2];
        const auto key = io::to_floats("key", ka, {B, Lk, kdim}), value = io::to_floats("value", va, {B, Lk, vdim});
        const io::MhaWeights mw = io::load_mha_weights(io::StateDict((d / "weights").string(), ""), H);
        const LayerConfig &c = mw.config;
        const LayerWeights lw = mw.view();
        REQUIRE(c.embed_dim == E);
        REQUIRE(c.resolved().kdim == kdim);
        REQUIRE(c.resolved().vdim == vdim);
        // PyTorch's masks, True = not allowed, become ours, nonzero = may attend.
        std::vector<uint8_t> kpm;
        if (fs::exists(d / "key_padding_mask.npy"))
            kpm = io::to_bools("kpm", io::read_npy((d / "key_padding_mask.npy").string()), {B, Lk});
        const io::Mask mask = io::from_torch_masks(B, Lq, Lk, kpm, {});
        const auto want = load_floats((d / "out.npy").string(), {B, Lq, E});
        const auto want_w = load_floats((d / "weights.npy").string(), {B, H, Lq, Lk});
        for (int threads : {1, 2}) {
            Runtime rt(RuntimeOptions{threads, {}, {}, {}});
            Layer layer(rt, c, lw);
            LayerForward p;
            p.batch = B;
            p.q_len = Lq;
            p.kv_len = Lk;
            p.causal = causal;  // the golden attn_mask is the causal one
            if (!mask.allowed.empty()) {
                p.mask = mask.allowed.data();
                p.mask_batch_stride = mask.batch_stride;
                p.mask_row_stride = mask.row_stride;
            }
            std::vector<float> out(want.size()), weights(want_w.size());
            p.weights = weights.data();
            layer.forward(rt, p, query.data(), cross ? key.data() : nullptr, cross ? value.data() : nullptr, out.data());
            check_close(out, want, 1e-4, "out");
            check_close(weights, want_w, 1e-4, "weights");
        }
        ++cases;
    }
    CHECK(cases == 5);
}

namespace {

struct DetSetup {
    LayerConfig c;
    Weights w;
    DetSetup() {
        c.embed_dim = 64;
        c.num_heads = 4;
        c.num_kv_heads = 2;
        w = random_weights(c, 21);
    }
};

} // namespace

TEST_CASE("layer: same bits for 1 and 2 threads, and for a sequence alone or in a batch") {
    DetSetup s;
    Runtime rt1(RuntimeOptions{1, {}, {}, {}}), rt2(RuntimeOptions{2, {}, {}, {}});
    Layer layer(rt1, s.c, s.w.view());
    const int64_t B = 5, L = 37, E = 64;
    const auto x = random_floats(static_cast<size_t>(B * L * E), 4);
    for (bool causal : {false, true}) {
        LayerForward p;
        p.batch = B;
        p.q_len = p.kv_len = L;
        p.causal = causal;
        std::vector<float> o1(x.size()), o2(x.size());
        layer.forward(rt1, p, x.data(), nullptr, nullptr, o1.data());
        layer.forward(rt2, p, x.data(), nullptr, nullptr, o2.data());
        CHECK(test::same_bits(o1, o2));
        // With the weights asked for, O goes to a buffer of its own instead of over Q: the same bits.
        std::vector<float> ow(x.size()), weights(static_cast<size_t>(B * s.c.num_heads * L * L));
        p.weights = weights.data();
        layer.forward(rt1, p, x.data(), nullptr, nullptr, ow.data());
        p.weights = nullptr;
        CHECK(test::same_bits(o1, ow));
        p.batch = 1;
        for (int64_t b = 0; b < B; ++b) {
            std::vector<float> alone(static_cast<size_t>(L * E));
            layer.forward(rt2, p, x.data() + b * L * E, nullptr, nullptr, alone.data());
            CHECK(std::memcmp(alone.data(), o1.data() + b * L * E, alone.size() * sizeof(float)) == 0);
        }
    }
}

TEST_CASE("layer: 8 host threads share one layer and one runtime") {
    DetSetup s;
    Runtime rt(RuntimeOptions{2, {}, {}, {}});
    const Layer layer(rt, s.c, s.w.view());
    const int64_t L = 19, E = 64;
    std::vector<std::vector<float>> inputs, serial(8), parallel(8);
    LayerForward p;
    p.batch = 1;
    p.q_len = p.kv_len = L;
    for (int t = 0; t < 8; ++t) {
        inputs.push_back(random_floats(static_cast<size_t>(L * E), 100 + t));
        serial[t].resize(static_cast<size_t>(L * E));
        parallel[t].resize(static_cast<size_t>(L * E));
        layer.forward(rt, p, inputs[t].data(), nullptr, nullptr, serial[t].data());
    }
    std::vector<std::thread> pool;
    for (int t = 0; t < 8; ++t)
        pool.emplace_back([&, t] {
            for (int rep = 0; rep < 5; ++rep) layer.forward(rt, p, inputs[t].data(), nullptr, nullptr, parallel[t].data());
        });
    for (auto &th : pool) th.join();
    for (int t = 0; t < 8; ++t) CHECK(test::same_bits(serial[t], parallel[t]));
}

TEST_CASE("layer: bad input gets a status and a message naming the field, and writes nothing") {
    mha_runtime *rt = nullptr;
    REQUIRE(mha_runtime_create(1, &rt) == MHA_OK);
    const auto w = random_floats(3 * 16 * 16, 1), ow = random_floats(16 * 16, 2);
    mha_layer_config c{16, 4, 0, 0, 0, 0, 0};
    mha_layer_weights lw{};
    REQUIRE(mha_layer_weights_from_in_proj(&c, w.data(), nullptr, ow.data(), nullptr, &lw) == MHA_OK);
    auto create_fails = [&](mha_layer_config cc, const mha_layer_weights *ww, const char *field) {
        mha_layer *l = reinterpret_cast<mha_layer *>(0x1);
        CHECK(mha_layer_create(rt, &cc, ww, &l) == MHA_INVALID_ARGUMENT);
        CHECK(l == nullptr);
        CHECK(std::string(mha_last_error()).find(field) != std::string::npos);
    };
    create_fails({0, 4, 0, 0, 0, 0, 0}, &lw, "embed_dim");
    create_fails({16, -1, 0, 0, 0, 0, 0}, &lw, "num_heads");
    create_fails({16, 4, 3, 0, 0, 0, 0}, &lw, "num_kv_heads");
    create_fails({18, 4, 0, 0, 0, 0, 0}, &lw, "embed_dim = 18");
    create_fails({16, 4, 0, -2, 0, 0, 0}, &lw, "head_dim");
    {
        mha_layer_config r = c;
        r.rope.dims = 2;
        r.rope.interleaved = 2;  // neither pair order: refused, not read as "true"
        create_fails(r, &lw, "rope.interleaved = 2");
        r.rope.interleaved = 1;
        r.rope.position_scale = -1.0f;
        create_fails(r, &lw, "rope.position_scale");
    }
    create_fails({16, 4, 0, 0, 0, -1, 0}, &lw, "kdim");
    create_fails({int64_t{1} << 40, 1, 0, 0, 0, int64_t{1} << 40, 0}, &lw, "overflow");
    mha_layer_weights no_v = lw;
    no_v.v_weight = nullptr;
    create_fails(c, &no_v, "v_weight");
    create_fails(c, nullptr, "weights");
    mha_layer *layer = nullptr;
    CHECK(mha_layer_create(nullptr, &c, &lw, &layer) == MHA_INVALID_ARGUMENT);
    CHECK(mha_layer_create(rt, nullptr, &lw, &layer) == MHA_INVALID_ARGUMENT);
    CHECK(std::string(mha_last_error()).find("config") != std::string::npos);
    CHECK(mha_layer_create(rt, &c, &lw, nullptr) == MHA_INVALID_ARGUMENT);
    mha_layer_config gqa = c;
    gqa.num_kv_heads = 2;
    CHECK(mha_layer_weights_from_in_proj(&gqa, w.data(), nullptr, ow.data(), nullptr, &lw) == MHA_INVALID_ARGUMENT);
    REQUIRE(mha_layer_create(rt, &c, &lw, &layer) == MHA_OK);

    const int64_t B = 2, L = 4;
    const auto x = random_floats(static_cast<size_t>(B * L * 16), 3);
    std::vector<float> out(x.size(), test::kSentinel), weights(static_cast<size_t>(B * 4 * L * L), test::kSentinel);
    int32_t valid[2] = {4, 5};
    auto forward_fails = [&](mha_layer_forward_params p, const float *q, const float *k, const float *v, float *o,
                             const char *field, const mha_layer *l) {
        CHECK(mha_layer_forward(rt, l, &p, q, k, v, o) == MHA_INVALID_ARGUMENT);
        CHECK(std::string(mha_last_error()).find(field) != std::string::npos);
        for (float f : out) REQUIRE(f == test::kSentinel);
        for (float f : weights) REQUIRE(f == test::kSentinel);
    };
    mha_layer_forward_params p{};
    p.batch = B;
    p.q_len = L;
    p.weights = weights.data();
    forward_fails(p, nullptr, nullptr, nullptr, out.data(), "query", layer);
    forward_fails(p, x.data(), nullptr, nullptr, nullptr, "out", layer);
    forward_fails(p, x.data(), x.data(), nullptr, out.data(), "value", layer);
    forward_fails(p, x.data(), nullptr, nullptr, out.data(), "layer", nullptr);
    mha_layer_forward_params bad = p;
    bad.kv_valid_lens = valid;
    forward_fails(bad, x.data(), nullptr, nullptr, out.data(), "kv_valid_lens[1] = 5", layer);
    bad = p;
    bad.kv_len = 3;
    forward_fails(bad, x.data(), nullptr, nullptr, out.data(), "kv_len", layer);
    bad = p;
    bad.batch = -1;
    forward_fails(bad, x.data(), nullptr, nullptr, out.data(), "batch", layer);
    bad = p;
    bad.batch = int64_t{1} << 62;
    forward_fails(bad, x.data(), nullptr, nullptr, out.data(), "overflow", layer);
    bad = p;
    bad.mask = reinterpret_cast<const uint8_t *>(valid);
    bad.mask_row_stride = 2;
    forward_fails(bad, x.data(), nullptr, nullptr, out.data(), "mask_row_stride", layer);
    CHECK(mha_layer_forward(rt, layer, nullptr, x.data(), nullptr, nullptr, out.data()) == MHA_INVALID_ARGUMENT);

    // A runtime whose tiles lay the packed weights out differently (depth blocks of 8 where the
    // layer has one of 16) is refused, not misread.
    TileConfig other = Runtime().tiles();
    other.kc = 8;
    Runtime small(RuntimeOptions{1, {}, other, {}});
    LayerWeights cw;
    cw.q_weight = lw.q_weight;
    cw.k_weight = lw.k_weight;
    cw.v_weight = lw.v_weight;
    cw.out_weight = lw.out_weight;
    Layer cpp_layer(small, LayerConfig{16, 4}, cw);
    Runtime normal(RuntimeOptions{1, {}, {}, {}});
    LayerForward f;
    f.batch = B;
    f.q_len = L;
    CHECK_THROWS_WITH_AS(cpp_layer.forward(normal, f, x.data(), nullptr, nullptr, out.data()),
                         doctest::Contains("packed for"), Error);
    for (float v : out) REQUIRE(v == test::kSentinel);

    p.weights = nullptr;
    CHECK(mha_layer_forward(rt, layer, &p, x.data(), nullptr, nullptr, out.data()) == MHA_OK);
    mha_layer_destroy(layer);
    mha_layer_destroy(nullptr);
    mha_runtime_destroy(rt);
}

TEST_CASE("layer: a ragged batch (forward_varlen) gives each row the bits of its sequence alone, every norm") {
    for (Isa isa : supported_isas())
        for (Norm norm : {Norm::none, Norm::post, Norm::pre})
            for (bool causal : {false, true})
                for (int threads : {1, 2}) {
                    CAPTURE(isa_name(isa));
                    CAPTURE(static_cast<int>(norm));
                    CAPTURE(causal);
                    CAPTURE(threads);
                    Runtime rt(RuntimeOptions{threads, isa, {}, {}});
                    LayerConfig c;
                    c.embed_dim = 24;
                    c.num_heads = 4;
                    c.num_kv_heads = 2;
                    c.norm = norm;
                    const Weights w = random_weights(c, 40);
                    const auto gamma = random_floats(24, 50, 0.5f, 1.5f), beta = random_floats(24, 51);
                    LayerWeights v = w.view();
                    v.norm_weight = gamma.data();
                    v.norm_bias = beta.data();
                    Layer layer(rt, c, v);
                    // Sequences of 5, 0, 1 and 37 rows, one after the other.
                    const std::vector<int64_t> offsets = {0, 5, 5, 6, 43};
                    const auto x = random_floats(43 * 24, 52);
                    std::vector<float> out(x.size(), test::kSentinel), alone;
                    layer.forward_varlen(rt, LayerVarlenForward{4, offsets.data(), causal}, x.data(), out.data());
                    for (size_t s = 0; s + 1 < offsets.size(); ++s) {
                        const int64_t r0 = offsets[s], n = offsets[s + 1] - r0;
                        if (n == 0) continue;
                        LayerForward p;
                        p.batch = 1;
                        p.q_len = n;
                        p.causal = causal;
                        alone.assign(static_cast<size_t>(n * 24), 0.0f);
                        layer.forward(rt, p, x.data() + r0 * 24, nullptr, nullptr, alone.data());
                        CHECK(std::memcmp(alone.data(), out.data() + r0 * 24, alone.size() * sizeof(float)) == 0);
                    }
                }
}

TEST_CASE("layer: forward_varlen refuses bad offsets and cross-attention layers, writing nothing") {
    Runtime rt(RuntimeOptions{1, {}, {}, {}});
    LayerConfig c;
    c.embed_dim = 8;
    c.num_heads = 2;
    const Weights w = random_weights(c, 60);
    Layer layer(rt, c, w.view());
    const auto x = random_floats(16 * 8, 61);
    std::vector<float> out(x.size(), test::kSentinel);
    auto refused = [&](int64_t num_seqs, const int64_t *offsets, const char *field) {
        int64_t rc = 0;
        try {
            layer.forward_varlen(rt, LayerVarlenForward{num_seqs, offsets, false}, x.data(), out.data());
        } catch (const Error &e) {
            rc = static_cast<int64_t>(e.status());
            CHECK(std::string(e.what()).find(field) != std::string::npos);
        }
        CHECK(rc == static_cast<int64_t>(Status::invalid_argument));
        CHECK(std::all_of(out.begin(), out.end(), [](float v) { return v == test::kSentinel; }));
    };
    const int64_t decreasing[] = {0, 9, 4}, not_zero[] = {1, 4}, negative_count[] = {0};
    refused(2, decreasing, "offsets");
    refused(1, not_zero, "offsets");
    refused(1, nullptr, "offsets");
    refused(-1, negative_count, "num_seqs");
    LayerConfig cross = c;
    cross.kdim = 6;
    const Weights wc = random_weights(cross, 62);
    Layer cross_layer(rt, cross, wc.view());
    const int64_t ok[] = {0, 4};
    CHECK_THROWS_WITH_AS(cross_layer.forward_varlen(rt, LayerVarlenForward{1, ok, false}, x.data(), out.data()),
                         doctest::Contains("self-attention"), Error);
}

// ---- Rotary embeddings and score modifiers in the layer -------------------------------------------

namespace {

struct RopeCase {
    LayerConfig c;
    std::vector<float> x, wq, wk, wv, wo, bq, bk, bv, bo;
    std::vector<double> want;
    int64_t B = 0, L = 0;
    LayerWeights view() const {
        LayerWeights w;
        w.q_weight = wq.data(); w.k_weight = wk.data(); w.v_weight = wv.data(); w.out_weight = wo.data();
        w.q_bias = bq.data(); w.k_bias = bk.data(); w.v_bias = bv.data(); w.out_bias = bo.data();
        return w;
    }
};

RopeCase load_rope_case(const std::string &name) {
    namespace fs = std::filesystem;
    const fs::path d = fs::path(MHA_TEST_DATA) / "rope" / name;
    RopeCase r;
    std::ifstream f(d / "case.txt");
    std::string word;
    int interleaved = 0;
    while (f >> word) {
        if (word == "num_heads") f >> r.c.num_heads;
        else if (word == "num_kv_heads") f >> r.c.num_kv_heads;
        else if (word == "head_dim") f >> r.c.head_dim;
        else if (word == "rope_dims") f >> r.c.rope.dims;
        else if (word == "theta") f >> r.c.rope.theta;
        else if (word == "interleaved") f >> interleaved;
        else if (word == "position_scale") f >> r.c.rope.position_scale;
    }
    r.c.rope.interleaved = interleaved != 0;
    r.c.value_dim = r.c.head_dim;
    const auto xa = io::read_npy((d / "x.npy").string());
    r.B = xa.shape[0];
    r.L = xa.shape[1];
    r.c.embed_dim = xa.shape[2];
    const int64_t E = r.c.embed_dim, nq = r.c.num_heads * r.c.head_dim, nk = r.c.num_kv_heads * r.c.head_dim;
    r.x = io::to_floats("x", xa, {r.B, r.L, E});
    auto ld = [&](const char *n, std::vector<int64_t> shape) { return load_floats((d / (std::string(n) + ".npy")).string(), shape); };
    r.wq = ld("q_weight", {nq, E}); r.wk = ld("k_weight", {nk, E}); r.wv = ld("v_weight", {nk, E});
    r.wo = ld("out_weight", {E, nq}); r.bq = ld("q_bias", {nq}); r.bk = ld("k_bias", {nk}); r.bv = ld("v_bias", {nk});
    r.bo = ld("out_bias", {E});
    const auto out = io::read_npy((d / "out.npy").string());
    const auto outf = io::to_floats("out", out, {r.B, r.L, E});
    r.want.assign(outf.begin(), outf.end());
    return r;
}

} // namespace

TEST_CASE("layer: RoPE against PyTorch goldens, both pair orders (tests/data/gen_rope_golden.py); cached and varlen = dense bitwise") {
    for (const char *name : {"half_partial_gqa", "interleaved_full"}) {
        CAPTURE(name);
        const RopeCase r = load_rope_case(name);
        const int64_t E = r.c.embed_dim, B = r.B, L = r.L;
        for (Isa isa : supported_isas())
            for (int threads : {1, 2}) {
                CAPTURE(std::string(isa_name(isa)));
                Runtime rt(RuntimeOptions{threads, isa, {}, {}});
                Layer layer(rt, r.c, r.view());
                LayerForward p;
                p.batch = B;
                p.q_len = p.kv_len = L;
                p.causal = true;
                std::vector<float> out(static_cast<size_t>(B * L * E));
                layer.forward(rt, p, r.x.data(), nullptr, nullptr, out.data());
                for (size_t i = 0; i < out.size(); ++i) CHECK(std::fabs(out[i] - r.want[i]) <= 1e-4);
                // The same rows through a ragged batch and through the cache (prefill of 3, then
                // one token at a time): K is stored rotated, each new token at its position.
                const int64_t offsets[3] = {0, L, 2 * L};
                std::vector<float> ragged(out.size());
                layer.forward_varlen(rt, LayerVarlenForward{B, offsets, true}, r.x.data(), ragged.data());
                CHECK(test::same_bits(ragged, out));
                KVCacheConfig kc;
                kc.num_kv_heads = r.c.num_kv_heads;
                kc.head_dim = kc.value_dim = r.c.head_dim;
                kc.max_tokens = 1024;
                KVCache cache(rt, kc);
                std::vector<float> step(out.size());
                for (int64_t b = 0; b < B; ++b) {
                    const int64_t id = 10 + b;
                    for (int64_t pos = 0; pos < L;) {
                        const int64_t n = pos == 0 ? std::min<int64_t>(3, L) : 1;
                        const int64_t qo[2] = {0, n};
                        layer.forward_cached(rt, cache, LayerCachedForward{1, &id, qo, true}, r.x.data() + (b * L + pos) * E,
                                             step.data() + (b * L + pos) * E);
                        pos += n;
                    }
                }
                CHECK(test::same_bits(step, out));
            }
    }
}

namespace {

// One causal sequence x (rows of E) through forward.
std::vector<float> causal_forward(Runtime &rt, const Layer &layer, int64_t E, const std::vector<float> &x) {
    LayerForward p;
    p.batch = 1;
    p.q_len = p.kv_len = static_cast<int64_t>(x.size()) / E;
    p.causal = true;
    std::vector<float> out(x.size(), test::kSentinel);
    layer.forward(rt, p, x.data(), nullptr, nullptr, out.data());
    return out;
}

// One causal sequence x (rows of E) through forward_cached on a fresh cache: a prefill of `first`
// tokens, then one token a step. Returns every token's output.
std::vector<float> cached_steps(Runtime &rt, const Layer &layer, const LayerConfig &config, const std::vector<float> &x,
                                int64_t first) {
    const LayerConfig c = config.resolved();
    const int64_t E = c.embed_dim, L = static_cast<int64_t>(x.size()) / E;
    KVCacheConfig kc;
    kc.num_kv_heads = c.num_kv_heads;
    kc.head_dim = c.head_dim;
    kc.value_dim = c.value_dim;
    kc.max_tokens = 256;
    KVCache cache(rt, kc);
    const int64_t id = 1;
    std::vector<float> out(x.size(), test::kSentinel);
    for (int64_t pos = 0; pos < L;) {
        const int64_t n = pos == 0 ? first : 1, qo[2] = {0, n};
        layer.forward_cached(rt, cache, LayerCachedForward{1, &id, qo, true}, x.data() + pos * E, out.data() + pos * E);
        pos += n;
    }
    return out;
}

} // namespace

TEST_CASE("layer: score modifiers (window, softcap, ALiBi, sinks) with RoPE: cached prefill + decode = the full forward, bitwise") {
    LayerConfig c;
    c.embed_dim = 64;
    c.num_heads = 8;
    c.num_kv_heads = 2;
    const std::vector<float> slopes = {0.5f, 0.25f, 0.125f, 0.0625f, 0.03f, 0.015f, 0.007f, 0.004f},
                             sinks = {0.1f, -0.5f, 1.0f, 2.0f, 0.0f, -1.0f, 0.3f, 0.7f};
    c.variant = AttentionVariant{5, 1.5f, slopes.data(), sinks.data()};
    c.rope.dims = 8;
    const Weights w = random_weights(c, 91);
    const int64_t L = 40, E = c.embed_dim;
    const auto x = random_floats(static_cast<size_t>(L * E), 92);
    for (Isa isa : supported_isas()) {
        Runtime rt(RuntimeOptions{2, isa, {}, {}});
        Layer layer(rt, c, w.view());
        const auto full = causal_forward(rt, layer, E, x);
        LayerConfig c0 = c;
        c0.variant = AttentionVariant{};
        Layer without(rt, c0, w.view());
        CHECK(!test::same_bits(full, causal_forward(rt, without, E, x)));  // the modifiers reach the layer's attention
        CHECK(test::same_bits(cached_steps(rt, layer, c, x, 17), full));
    }
}

TEST_CASE("layer: with its scratch rows padded off 4 KiB, forward_varlen and forward_cached give forward's bits") {
    LayerConfig c;  // q | k | v: 3072 columns, 12 KiB
    c.embed_dim = 16;
    c.num_heads = 16;
    c.head_dim = c.value_dim = 64;
    const Weights w = random_weights(c, 93);
    const int64_t L = 21, E = c.embed_dim;
    const auto x = random_floats(static_cast<size_t>(L * E), 94);
    for (Isa isa : supported_isas()) {
        CAPTURE(isa_name(isa));
        Runtime rt(RuntimeOptions{2, isa, {}, {}});
        Layer layer(rt, c, w.view());
        const auto full = causal_forward(rt, layer, E, x);
        std::vector<float> ragged(x.size(), test::kSentinel);
        const int64_t offsets[2] = {0, L};
        layer.forward_varlen(rt, LayerVarlenForward{1, offsets, true}, x.data(), ragged.data());
        CHECK(test::same_bits(ragged, full));
        CHECK(test::same_bits(cached_steps(rt, layer, c, x, 9), full));
    }
}

TEST_CASE("layer: RoPE's projection blocks shared out over the threads give the bits of one thread") {
    // 300 tokens = 4 whole blocks of the RoPE projection and a partial one; with parallel_min_flops
    // = 0 every block is a task, so both threads take blocks (GEMM and rotation) whatever the size.
    LayerConfig c;
    c.embed_dim = 64;
    c.num_heads = 4;
    c.num_kv_heads = 2;
    c.rope.dims = 16;
    const Weights w = random_weights(c, 93);
    const int64_t B = 3, L = 100, E = c.embed_dim;
    const auto x = random_floats(static_cast<size_t>(B * L * E), 94);
    for (Isa isa : supported_isas()) {
        CAPTURE(std::string(isa_name(isa)));
        std::vector<std::vector<float>> outs;
        for (int threads : {1, 2}) {
            RuntimeOptions o{threads, isa, {}, {}};
            TileConfig t = default_tile_config(isa, detect_cache_sizes());
            t.parallel_min_flops = 0;
            o.tiles = t;
            Runtime rt(o);
            Layer layer(rt, c, w.view());
            LayerForward p;
            p.batch = B;
            p.q_len = p.kv_len = L;
            p.causal = true;
            std::vector<float> out(x.size());
            layer.forward(rt, p, x.data(), nullptr, nullptr, out.data());
            outs.push_back(out);
            // Against one sequence at a time (blocks of 64 + 36 rows, cut elsewhere than in the batch).
            std::vector<float> alone(x.size());
            LayerForward one = p;
            one.batch = 1;
            for (int64_t b = 0; b < B; ++b)
                layer.forward(rt, one, x.data() + b * L * E, nullptr, nullptr, alone.data() + b * L * E);
            CHECK(test::same_bits(alone, out));
        }
        CHECK(test::same_bits(outs[0], outs[1]));
    }
}

TEST_CASE("layer: bad rope and variant fields get a status naming the field") {
    mha_runtime *rt = nullptr;
    REQUIRE(mha_runtime_create(1, &rt) == MHA_OK);
    const auto w = random_floats(3 * 16 * 16, 1), ow = random_floats(16 * 16, 2);
    mha_layer_config c{};
    c.embed_dim = 16;
    c.num_heads = 4;
    mha_layer_weights lw{};
    REQUIRE(mha_layer_weights_from_in_proj(&c, w.data(), nullptr, ow.data(), nullptr, &lw) == MHA_OK);
    auto fails = [&](mha_layer_config cc, const char *field) {
        mha_layer *l = reinterpret_cast<mha_layer *>(0x1);
        CHECK(mha_layer_create(rt, &cc, &lw, &l) == MHA_INVALID_ARGUMENT);
        CHECK(l == nullptr);
        CHECK_MESSAGE(std::string(mha_last_error()).find(field) != std::string::npos, mha_last_error());
    };
    for (int64_t dims : {int64_t{3}, int64_t{6}, int64_t{-2}}) {  // odd, above head_dim = 4, negative
        mha_layer_config cc = c;
        cc.rope.dims = dims;
        fails(cc, "rope.dims");
    }
    for (float theta : {-1.0f, NAN, INFINITY}) {
        mha_layer_config cc = c;
        cc.rope.dims = 4;
        cc.rope.theta = theta;
        fails(cc, "rope.theta");
    }
    mha_layer_config cc = c;
    cc.rope.dims = 2;
    cc.rope.position_scale = -1.0f;
    fails(cc, "rope.position_scale");
    cc = c;
    cc.variant.window = -5;
    fails(cc, "variant.window");
    cc = c;
    cc.variant.softcap = NAN;
    fails(cc, "variant.softcap");
    mha_runtime_destroy(rt);
}
