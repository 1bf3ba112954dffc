// The encoder layer (nn.TransformerEncoderLayer) against the double reference, and the same bits for
// Add & Norm and the encoder (see encoder_util.hpp).
#include <doctest/doctest.h>

#include "encoder_util.hpp"

using namespace mha;
using namespace encoder_test;

// ---- the encoder layer against the reference -----------------------------------------------------------

namespace {

struct EncCase {
    const char *name;
    int64_t E, H, F, B, L;
    bool causal = false;
    int valid = 0, mask = 0;
    bool biases = true, norm_params = true;
    float eps = 0.0f;
};

void run_encoder_case(const EncCase &cs, Norm norm, Activation act, Runtime &rt) {
    CAPTURE(std::string(cs.name));
    CAPTURE(std::string(norm_name(norm)));
    CAPTURE(std::string(act_name(act)));
    const EncoderConfig c = encoder_config(cs.E, cs.H, cs.F, norm, act, cs.eps);
    const EncWeights w = random_encoder(c, 31);
    const EncoderWeights ew = w.view(cs.biases, cs.norm_params);
    EncoderLayer layer(rt, c, ew);
    const auto x = random_floats(static_cast<size_t>(cs.B * cs.L * cs.E), 37);
    LayerForward p;
    p.batch = cs.B;
    p.q_len = cs.L;
    p.kv_len = cs.L;
    p.causal = cs.causal;
    Masks m;
    set_masks(p, m, cs.valid, cs.mask);
    std::vector<float> out(x.size(), test::kSentinel);
    layer.forward(rt, p, x.data(), out.data());
    check_close(out, reference_encoder(c, ew, p, to_double(x.data(), cs.B * cs.L * cs.E)), kRefTol, "out");
}

} // namespace

TEST_CASE("encoder layer matches the double reference (post/pre x relu/gelu, masks, tile edges)") {
    const std::vector<EncCase> cases = {
        {"E16 H4 F32 (the golden shape)", 16, 4, 32, 2, 5},
        {"E20 F1", 20, 4, 1, 2, 7},
        {"E20 F15", 20, 4, 15, 2, 7},
        {"E20 F16", 20, 4, 16, 2, 7},
        {"E20 F17", 20, 4, 17, 2, 7},
        {"E20 F33 padding row + key padding mask", 20, 4, 33, 3, 7, false, 1, 1},
        {"E20 F33 causal + full mask + padding row", 20, 5, 33, 3, 6, true, 1, 2},
        {"E16 F32 causal", 16, 4, 32, 2, 9, true},
        {"E17 H1 F16 one token", 17, 1, 16, 3, 1},
        {"E20 F17 no biases, norm params NULL", 20, 4, 17, 2, 5, false, 0, 0, false, false},
        {"E16 F33 eps 0.5", 16, 2, 33, 2, 5, false, 0, 0, true, true, 0.5f},
    };
    for (const RuntimeOptions &o : runtime_options()) {
        Runtime rt(o);
        CAPTURE(describe(rt));
        for (const auto &cs : cases)
            for (Norm norm : {Norm::post, Norm::pre})
                for (Activation act : {Activation::relu, Activation::gelu}) run_encoder_case(cs, norm, act, rt);
    }
}

TEST_CASE("encoder layer: a larger shape (E 64, H 8, FFN 96, 19 tokens) against the reference") {
    Runtime rt(RuntimeOptions{2, {}, {}, {}});
    for (Norm norm : {Norm::post, Norm::pre})
        run_encoder_case({"E64 H8 F96", 64, 8, 96, 2, 19, false, 1, 0}, norm, Activation::gelu, rt);
}

TEST_CASE("encoder layer: the activation itself over [-15, 15] (GELU is the erf form, not tanh's)") {
    // Pre-norm with a zero attention output (out_weight 0, no out_bias) and linear2 = I, no bias:
    // out = x + act(linear1(LayerNorm2(x))). linear1's weights are large, so its outputs span about
    // +-15 and GELU's tanh approximation (off by up to 4.7e-4 near 2.7) would fail the 1e-5 check.
    const int64_t E = 32, B = 2, L = 6;
    for (Activation act : {Activation::relu, Activation::gelu}) {
        CAPTURE(std::string(act_name(act)));
        const EncoderConfig c = encoder_config(E, 4, E, Norm::pre, act);
        EncWeights w = random_encoder(c, 51);
        std::fill(w.a.wo.begin(), w.a.wo.end(), 0.0f);
        w.w1 = random_floats(static_cast<size_t>(E * E), 52, -1.5f, 1.5f);
        std::fill(w.w2.begin(), w.w2.end(), 0.0f);
        for (int64_t i = 0; i < E; ++i) w.w2[static_cast<size_t>(i * E + i)] = 1.0f;
        EncoderWeights ew = w.view();
        ew.attention.out_bias = nullptr;
        ew.linear2_bias = nullptr;
        const auto x = random_floats(static_cast<size_t>(B * L * E), 53);
        LayerForward p;
        p.batch = B;
        p.q_len = p.kv_len = L;
        const auto want = reference_encoder(c, ew, p, to_double(x.data(), B * L * E));
        double lo = 0, hi = 0;  // the range of linear1's outputs, act's inputs
        {
            const auto xn = ref::layer_norm(to_double(x.data(), B * L * E), B * L, E, ew.norm2_weight, ew.norm2_bias,
                                            1e-5);
            for (double h : ref::linear(xn.data(), B * L, E, ew.linear1_weight, ew.linear1_bias, E)) {
                lo = std::min(lo, h);
                hi = std::max(hi, h);
            }
        }
        CHECK(lo < -8);
        CHECK(hi > 8);
        for (const RuntimeOptions &o : runtime_options()) {
            Runtime rt(o);
            CAPTURE(describe(rt));
            EncoderLayer layer(rt, c, ew);
            std::vector<float> out(x.size(), test::kSentinel);
            layer.forward(rt, p, x.data(), out.data());
            check_close(out, want, 1e-5, "x + act(h)");
        }
    }
}

TEST_CASE("encoder layer: empty calls") {
    Runtime rt(RuntimeOptions{1, {}, {}, {}});
    const EncoderConfig c = encoder_config(16, 4, 8, Norm::post, Activation::relu);
    const EncWeights w = random_encoder(c, 1);
    EncoderLayer layer(rt, c, w.view());
    const auto x = random_floats(16 * 3, 2);
    std::vector<float> out(x.size(), test::kSentinel);
    LayerForward p;
    p.batch = 0;
    p.q_len = 3;
    layer.forward(rt, p, x.data(), out.data());
    p.batch = 1;
    p.q_len = 0;
    layer.forward(rt, p, x.data(), out.data());
    for (float v : out) CHECK(v == test::kSentinel);
}

TEST_CASE("encoder layer: a NaN in one sequence stays in it; LayerNorm of its row is NaN") {
    const int64_t E = 20, B = 3, L = 5;
    for (Norm norm : {Norm::post, Norm::pre}) {
        CAPTURE(std::string(norm_name(norm)));
        const EncoderConfig c = encoder_config(E, 4, 24, norm, Activation::gelu);
        const EncWeights w = random_encoder(c, 41);
        Runtime rt(RuntimeOptions{2, {}, {}, {}});
        EncoderLayer layer(rt, c, w.view());
        auto x = random_floats(static_cast<size_t>(B * L * E), 43);
        LayerForward p;
        p.batch = B;
        p.q_len = p.kv_len = L;
        std::vector<float> clean(x.size()), out(x.size());
        layer.forward(rt, p, x.data(), clean.data());
        const int64_t bad_row = 1 * L + 2;
        x[static_cast<size_t>(bad_row * E + 3)] = std::numeric_limits<float>::quiet_NaN();
        layer.forward(rt, p, x.data(), out.data());
        int nans = 0;
        for (int64_t e = 0; e < E; ++e) nans += std::isnan(out[static_cast<size_t>(bad_row * E + e)]);
        CHECK(nans == E);
        for (int64_t b : {0, 2}) {
            CAPTURE(b);
            CHECK(std::memcmp(out.data() + b * L * E, clean.data() + b * L * E, L * E * sizeof(float)) == 0);
        }
    }
}

// ---- the same bits ---------------------------------------------------------------------------------------

TEST_CASE("Add & Norm and the encoder: same bits for 1 and 2 threads, alone or in a batch of 3, in place") {
    Runtime rt1(RuntimeOptions{1, {}, {}, {}}), rt2(RuntimeOptions{2, {}, {}, {}});
    const int64_t B = 3, L = 37, E = 64;
    const auto x = random_floats(static_cast<size_t>(B * L * E), 4);
    const int32_t valid[3] = {37, 20, 0};
    for (Norm norm : {Norm::post, Norm::pre})
        for (int variant = 0; variant < 3; ++variant) {  // 0 plain, 1 causal, 2 valid lengths
            CAPTURE(std::string(norm_name(norm)));
            CAPTURE(variant);
            LayerForward p;
            p.batch = B;
            p.q_len = p.kv_len = L;
            p.causal = variant == 1;
            if (variant == 2) p.kv_valid_lens = valid;
            auto alone_matches = [&](auto &&run, const std::vector<float> &full) {
                LayerForward one = p;
                one.batch = 1;
                for (int64_t b = 0; b < B; ++b) {
                    if (p.kv_valid_lens) one.kv_valid_lens = valid + b;
                    std::vector<float> alone(static_cast<size_t>(L * E));
                    run(one, x.data() + b * L * E, alone.data());
                    CHECK(std::memcmp(alone.data(), full.data() + b * L * E, alone.size() * sizeof(float)) == 0);
                }
            };
            {  // the attention layer with norm
                LayerConfig c = layer_config(E, 4, norm);
                c.num_kv_heads = 2;
                const AttnWeights w = random_attn(c, 21);
                Layer layer(rt1, c, w.view());
                std::vector<float> o1(x.size()), o2(x.size());
                layer.forward(rt1, p, x.data(), nullptr, nullptr, o1.data());
                layer.forward(rt2, p, x.data(), nullptr, nullptr, o2.data());
                CHECK(test::same_bits(o1, o2));
                alone_matches([&](const LayerForward &q, const float *in, float *out) {
                    layer.forward(rt2, q, in, nullptr, nullptr, out);
                }, o1);
            }
            for (Activation act : {Activation::relu, Activation::gelu}) {  // the encoder
                CAPTURE(std::string(act_name(act)));
                const EncoderConfig c = encoder_config(E, 4, 96, norm, act);
                const EncWeights w = random_encoder(c, 25);
                EncoderLayer layer(rt1, c, w.view());
                std::vector<float> o1(x.size()), o2(x.size());
                layer.forward(rt1, p, x.data(), o1.data());
                layer.forward(rt2, p, x.data(), o2.data());
                CHECK(test::same_bits(o1, o2));
                alone_matches([&](const LayerForward &q, const float *in, float *out) { layer.forward(rt2, q, in, out); },
                              o1);
                for (Runtime *rt : {&rt1, &rt2}) {  // x == out
                    std::vector<float> inplace = x;
                    layer.forward(*rt, p, inplace.data(), inplace.data());
                    CHECK(test::same_bits(inplace, o1));
                }
            }
        }
}

TEST_CASE("encoder layer: a ragged batch (forward_varlen) gives each row the bits of its sequence alone") {
    // Sequences of 5, 0, 13, 1 and 37 rows, one after the other; E 20 and FFN 17 cross the tiles' edges.
    const std::vector<int64_t> offsets = {0, 5, 5, 18, 19, 56};
    const int64_t E = 20, total = offsets.back(), S = static_cast<int64_t>(offsets.size()) - 1;
    const auto x = random_floats(static_cast<size_t>(total * E), 71);
    for (Isa isa : supported_isas())
        for (Norm norm : {Norm::post, Norm::pre})
            for (Activation act : {Activation::relu, Activation::gelu}) {
                CAPTURE(std::string(isa_name(isa)));
                CAPTURE(std::string(norm_name(norm)));
                CAPTURE(std::string(act_name(act)));
                const EncoderConfig c = encoder_config(E, 4, 17, norm, act);
                const EncWeights w = random_encoder(c, 73);
                Runtime rt1(RuntimeOptions{1, isa, {}, {}}), rt2(RuntimeOptions{2, isa, {}, {}});
                EncoderLayer layer(rt1, c, w.view());
                for (bool causal : {false, true}) {
                    CAPTURE(causal);
                    std::vector<float> o1(x.size(), test::kSentinel), o2(x.size(), test::kSentinel), alone;
                    layer.forward_varlen(rt1, LayerVarlenForward{S, offsets.data(), causal}, x.data(), o1.data());
                    layer.forward_varlen(rt2, LayerVarlenForward{S, offsets.data(), causal}, x.data(), o2.data());
                    CHECK(test::same_bits(o1, o2));
                    for (int64_t s = 0; s < S; ++s) {
                        const int64_t r0 = offsets[static_cast<size_t>(s)];
                        const int64_t n = offsets[static_cast<size_t>(s) + 1] - r0;
                        if (n == 0) continue;
                        CAPTURE(s);
                        LayerForward p;
                        p.batch = 1;
                        p.q_len = p.kv_len = n;
                        p.causal = causal;
                        alone.assign(static_cast<size_t>(n * E), test::kSentinel);
                        layer.forward(rt2, p, x.data() + r0 * E, alone.data());
                        CHECK(std::memcmp(alone.data(), o1.data() + r0 * E, alone.size() * sizeof(float)) == 0);
                        const std::vector<float> got(o1.begin() + r0 * E, o1.begin() + (r0 + n) * E);
                        check_close(got, reference_encoder(c, w.view(), p, to_double(x.data() + r0 * E, n * E)),
                                    kRefTol, "varlen vs reference");
                    }
                }
            }
}
