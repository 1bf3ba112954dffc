// Bad input to the layer's Add & Norm and the encoder layer: a status, a message naming the field,
// and nothing written (see encoder_util.hpp).
#include <doctest/doctest.h>

#include "encoder_util.hpp"

using namespace mha;
using namespace encoder_test;

namespace {

// Writes an out-of-range value into an enum field without ever holding it as the enum.
template <class Enum>
void poke(Enum &field, int value) {
    static_assert(sizeof(Enum) == sizeof(int));
    std::memcpy(&field, &value, sizeof value);
}

} // namespace

TEST_CASE("layer Add & Norm: bad config gets a status and a message naming the field") {
    mha_runtime *rt = nullptr;
    REQUIRE(mha_runtime_create(1, &rt) == MHA_OK);
    const int64_t E = 16;
    const auto w = random_floats(3 * E * E, 1), ow = random_floats(E * E, 2);
    mha_layer_config c{};
    c.embed_dim = E;
    c.num_heads = 4;
    c.norm = MHA_NORM_POST;
    mha_layer_weights lw{};
    REQUIRE(mha_layer_weights_from_in_proj(&c, w.data(), nullptr, ow.data(), nullptr, &lw) == MHA_OK);
    auto fails = [&](const mha_layer_config &cc, mha_status status, std::initializer_list<const char *> fields,
                     const char *what) {
        CAPTURE(std::string(what));
        mha_layer *l = nullptr;
        CHECK(mha_layer_create(rt, &cc, &lw, &l) == status);
        CHECK(l == nullptr);
        const std::string msg = mha_last_error();
        CHECK_MESSAGE(names_any(msg, fields), msg);
        if (l) mha_layer_destroy(l);
    };
    for (int bad : {7, 3, -1}) {
        mha_layer_config cc = c;
        cc.norm = bad;
        fails(cc, MHA_INVALID_ARGUMENT, {"norm"}, "norm outside the enum");
    }
    {
        mha_layer_config cc = c;
        poke(cc.weight_dtype, 5);
        fails(cc, MHA_INVALID_ARGUMENT, {"weight_dtype"}, "weight_dtype outside the enum");
        poke(cc.weight_dtype, -1);
        fails(cc, MHA_INVALID_ARGUMENT, {"weight_dtype"}, "weight_dtype -1");
        cc.weight_dtype = MHA_BF16;
        fails(cc, MHA_UNSUPPORTED, {"weight_dtype", "bf16", "BF16"}, "bf16 weights");
    }
    // Every valid norm builds, with and without norm parameters.
    for (int norm : {MHA_NORM_NONE, MHA_NORM_POST, MHA_NORM_PRE}) {
        mha_layer_config cc = c;
        cc.norm = norm;
        cc.norm_eps = 1e-6f;
        mha_layer *l = nullptr;
        CHECK(mha_layer_create(rt, &cc, &lw, &l) == MHA_OK);
        mha_layer_destroy(l);
    }
    // C++: the same refusal as mha::Error.
    {
        LayerConfig cc = layer_config(E, 4, static_cast<Norm>(7));
        Runtime crt(RuntimeOptions{1, {}, {}, {}});
        LayerWeights cw;
        cw.q_weight = lw.q_weight;
        cw.k_weight = lw.k_weight;
        cw.v_weight = lw.v_weight;
        cw.out_weight = lw.out_weight;
        CHECK_THROWS_WITH_AS(Layer(crt, cc, cw), doctest::Contains("norm"), Error);
    }
    mha_runtime_destroy(rt);
}

namespace {

struct CEncoder {
    int64_t E = 16, H = 4, F = 32;
    std::vector<float> in_w, out_w, w1, b1, w2, b2;
    mha_encoder_config config{};
    mha_encoder_weights weights{};
    CEncoder() {
        in_w = random_floats(static_cast<size_t>(3 * E * E), 1, -0.25f, 0.25f);
        out_w = random_floats(static_cast<size_t>(E * E), 2, -0.25f, 0.25f);
        w1 = random_floats(static_cast<size_t>(F * E), 3, -0.25f, 0.25f);
        b1 = random_floats(static_cast<size_t>(F), 4);
        w2 = random_floats(static_cast<size_t>(E * F), 5, -0.2f, 0.2f);
        b2 = random_floats(static_cast<size_t>(E), 6);
        config.attention.embed_dim = E;
        config.attention.num_heads = H;
        config.attention.norm = MHA_NORM_POST;
        config.ffn_dim = F;
        config.activation = MHA_ACT_GELU;
        REQUIRE(mha_layer_weights_from_in_proj(&config.attention, in_w.data(), nullptr, out_w.data(), nullptr,
                                               &weights.attention) == MHA_OK);
        weights.linear1_weight = w1.data();
        weights.linear1_bias = b1.data();
        weights.linear2_weight = w2.data();
        weights.linear2_bias = b2.data();
    }
};

} // namespace

TEST_CASE("encoder layer: bad input gets a status and a message naming the field, and writes nothing") {
    mha_runtime *rt = nullptr;
    REQUIRE(mha_runtime_create(1, &rt) == MHA_OK);
    const CEncoder s;
    using Cfg = mha_encoder_config;
    using W = mha_encoder_weights;
    auto create_fails = [&](const Cfg *cc, const W *ww, mha_status status, std::initializer_list<const char *> fields,
                            const char *what) {
        CAPTURE(std::string(what));
        mha_encoder_layer *l = nullptr;
        CHECK(mha_encoder_layer_create(rt, cc, ww, &l) == status);
        CHECK(l == nullptr);
        const std::string msg = mha_last_error();
        CHECK_MESSAGE(names_any(msg, fields), msg);
        if (l) mha_encoder_layer_destroy(l);
    };
    auto with_config = [&](auto edit, mha_status status, std::initializer_list<const char *> fields, const char *what) {
        Cfg cc = s.config;
        edit(cc);
        create_fails(&cc, &s.weights, status, fields, what);
    };
    auto with_weights = [&](auto edit, std::initializer_list<const char *> fields, const char *what) {
        W ww = s.weights;
        edit(ww);
        create_fails(&s.config, &ww, MHA_INVALID_ARGUMENT, fields, what);
    };
    const mha_status INV = MHA_INVALID_ARGUMENT;
    with_config([](Cfg &c) { c.attention.norm = MHA_NORM_NONE; }, INV, {"norm"}, "norm none");
    with_config([](Cfg &c) { c.attention.norm = 7; }, INV, {"norm"}, "norm 7");
    with_config([](Cfg &c) { c.attention.norm = -1; }, INV, {"norm"}, "norm -1");
    with_config([](Cfg &c) { c.activation = 7; }, INV, {"activation"}, "activation 7");
    with_config([](Cfg &c) { c.activation = -1; }, INV, {"activation"}, "activation -1");
    with_config([](Cfg &c) { c.ffn_dim = 0; }, INV, {"ffn_dim"}, "ffn_dim 0");
    with_config([](Cfg &c) { c.ffn_dim = -3; }, INV, {"ffn_dim"}, "ffn_dim -3");
    with_config([](Cfg &c) { c.ffn_dim = int64_t{1} << 60; }, INV, {"ffn_dim", "overflow"}, "ffn_dim overflows");
    with_config([](Cfg &c) { c.attention.kdim = 8; }, INV, {"kdim"}, "kdim != E");
    with_config([](Cfg &c) { c.attention.vdim = 12; }, INV, {"vdim"}, "vdim != E");
    with_config([](Cfg &c) { c.attention.embed_dim = 0; }, INV, {"embed_dim"}, "embed_dim 0");
    with_config([](Cfg &c) { c.attention.num_heads = 3; }, INV, {"embed_dim", "num_heads"}, "E % H");
    with_config([](Cfg &c) { poke(c.attention.weight_dtype, 5); }, INV, {"weight_dtype"}, "weight_dtype 5");
    with_config([](Cfg &c) { c.attention.weight_dtype = MHA_BF16; }, MHA_UNSUPPORTED, {"weight_dtype", "bf16", "BF16"},
                "bf16 weights");
    with_weights([](W &w) { w.linear1_weight = nullptr; }, {"linear1_weight"}, "linear1_weight NULL");
    with_weights([](W &w) { w.linear2_weight = nullptr; }, {"linear2_weight"}, "linear2_weight NULL");
    with_weights([](W &w) { w.attention.q_weight = nullptr; }, {"q_weight"}, "q_weight NULL");
    with_weights([](W &w) { w.attention.out_weight = nullptr; }, {"out_weight"}, "out_weight NULL");
    create_fails(&s.config, nullptr, INV, {"weights"}, "weights NULL");
    create_fails(nullptr, &s.weights, INV, {"config"}, "config NULL");
    {
        mha_encoder_layer *l = nullptr;
        CHECK(mha_encoder_layer_create(nullptr, &s.config, &s.weights, &l) == INV);
        CHECK(names(mha_last_error(), "rt"));
        CHECK(mha_encoder_layer_create(rt, &s.config, &s.weights, nullptr) == INV);
        CHECK(names(mha_last_error(), "out"));
    }
    // Optional weights may be NULL: biases, norm1/norm2 parameters.
    {
        W ww = s.weights;
        ww.linear1_bias = ww.linear2_bias = nullptr;
        ww.norm2_weight = ww.norm2_bias = nullptr;
        ww.attention.norm_weight = ww.attention.norm_bias = nullptr;
        mha_encoder_layer *l = nullptr;
        CHECK_MESSAGE(mha_encoder_layer_create(rt, &s.config, &ww, &l) == MHA_OK, mha_last_error());
        mha_encoder_layer_destroy(l);
    }

    mha_encoder_layer *layer = nullptr;
    REQUIRE_MESSAGE(mha_encoder_layer_create(rt, &s.config, &s.weights, &layer) == MHA_OK, mha_last_error());
    const int64_t B = 2, L = 4, E = s.E;
    auto x = random_floats(static_cast<size_t>(B * L * E), 3);
    const std::vector<float> x0 = x;
    std::vector<float> out(x.size(), test::kSentinel), weights(static_cast<size_t>(B * s.H * L * L), test::kSentinel);
    int32_t valid[2] = {4, 5};
    auto forward_fails = [&](const mha_layer_forward_params *p, const float *in, float *o, const mha_encoder_layer *l,
                             std::initializer_list<const char *> fields, const char *what, mha_runtime *r) {
        CAPTURE(std::string(what));
        CHECK(mha_encoder_layer_forward(r, l, p, in, o) == MHA_INVALID_ARGUMENT);
        const std::string msg = mha_last_error();
        bool named = false;
        for (const char *f : fields) named = named || names(msg, f);
        CHECK_MESSAGE(named, msg);
        for (float f : out) REQUIRE(f == test::kSentinel);
        for (float f : weights) REQUIRE(f == test::kSentinel);
        REQUIRE(test::same_bits(x, x0));
    };
    mha_layer_forward_params p{};
    p.batch = B;
    p.q_len = L;
    mha_layer_forward_params bad = p;
    bad.weights = weights.data();
    forward_fails(&bad, x.data(), out.data(), layer, {"weights"}, "p->weights non-NULL", rt);
    bad.weights = nullptr;
    forward_fails(&p, nullptr, out.data(), layer, {"x"}, "x NULL", rt);
    forward_fails(&p, x.data(), nullptr, layer, {"out"}, "out NULL", rt);
    forward_fails(&p, x.data(), out.data(), nullptr, {"layer"}, "layer NULL", rt);
    forward_fails(nullptr, x.data(), out.data(), layer, {"p"}, "p NULL", rt);
    forward_fails(&p, x.data(), out.data(), layer, {"rt"}, "rt NULL", nullptr);
    bad = p;
    bad.kv_len = 3;
    forward_fails(&bad, x.data(), out.data(), layer, {"kv_len"}, "kv_len != q_len", rt);
    bad = p;
    bad.kv_valid_lens = valid;
    forward_fails(&bad, x.data(), out.data(), layer, {"kv_valid_lens"}, "kv_valid_lens[1] = 5 > 4", rt);
    bad = p;
    bad.batch = -1;
    forward_fails(&bad, x.data(), out.data(), layer, {"batch"}, "batch -1", rt);
    bad = p;
    bad.q_len = -2;
    forward_fails(&bad, x.data(), out.data(), layer, {"q_len"}, "q_len -2", rt);
    bad = p;
    bad.mask = reinterpret_cast<const uint8_t *>(valid);
    bad.mask_row_stride = 2;
    forward_fails(&bad, x.data(), out.data(), layer, {"mask_row_stride"}, "mask_row_stride < len", rt);
    bad = p;
    bad.batch = int64_t{1} << 62;
    forward_fails(&bad, x.data(), out.data(), layer, {"overflow", "batch"}, "batch overflows", rt);
    // In place, a failed call leaves x as it was.
    bad = p;
    bad.kv_len = 1;
    CHECK(mha_encoder_layer_forward(rt, layer, &bad, x.data(), x.data()) == MHA_INVALID_ARGUMENT);
    CHECK(test::same_bits(x, x0));

    // A runtime whose tiles lay the packed weights out differently (depth blocks of 8) is
    // refused, not misread.
    {
        Runtime normal(RuntimeOptions{1, {}, {}, {}});
        TileConfig other = normal.tiles();
        other.kc = 8;
        Runtime small(RuntimeOptions{1, {}, other, {}});
        const EncoderConfig c = encoder_config(E, 4, 32, Norm::post, Activation::relu);
        const EncWeights w = random_encoder(c, 5);
        EncoderLayer cpp_layer(small, c, w.view());
        LayerForward f;
        f.batch = B;
        f.q_len = L;
        CHECK_THROWS_WITH_AS(cpp_layer.forward(normal, f, x.data(), out.data()), doctest::Contains("packed for"), Error);
        for (float v : out) REQUIRE(v == test::kSentinel);
        // The C++ API refuses what the C ABI does.
        EncoderConfig bad_c = c;
        bad_c.activation = static_cast<Activation>(7);
        CHECK_THROWS_WITH_AS(EncoderLayer(normal, bad_c, w.view()), doctest::Contains("activation"), Error);
        bad_c = c;
        bad_c.attention.norm = Norm::none;
        CHECK_THROWS_WITH_AS(EncoderLayer(normal, bad_c, w.view()), doctest::Contains("norm"), Error);
    }

    CHECK_MESSAGE(mha_encoder_layer_forward(rt, layer, &p, x.data(), out.data()) == MHA_OK, mha_last_error());
    for (float v : out) CHECK(std::isfinite(v));
    mha_encoder_layer_destroy(layer);
    mha_encoder_layer_destroy(nullptr);
    mha_runtime_destroy(rt);
}

TEST_CASE("encoder layer: forward_varlen refuses bad input through the C ABI, writing nothing") {
    mha_runtime *rt = nullptr;
    REQUIRE(mha_runtime_create(1, &rt) == MHA_OK);
    const CEncoder s;
    mha_encoder_layer *layer = nullptr;
    REQUIRE_MESSAGE(mha_encoder_layer_create(rt, &s.config, &s.weights, &layer) == MHA_OK, mha_last_error());
    const auto x = random_floats(static_cast<size_t>(16 * s.E), 3);
    std::vector<float> out(x.size(), test::kSentinel);
    auto refused = [&](mha_runtime *r, const mha_encoder_layer *l, int64_t num_seqs, const int64_t *offsets,
                       const float *in, float *o, const char *field) {
        CAPTURE(std::string(field));
        CHECK(mha_encoder_layer_forward_varlen(r, l, num_seqs, offsets, 0, in, o) == MHA_INVALID_ARGUMENT);
        const std::string msg = mha_last_error();
        CHECK_MESSAGE(names(msg, field), msg);
        for (float v : out) REQUIRE(v == test::kSentinel);
    };
    const int64_t decreasing[] = {0, 9, 4}, not_zero[] = {1, 4}, ok[] = {0, 4, 16};
    refused(rt, layer, 2, decreasing, x.data(), out.data(), "offsets");
    refused(rt, layer, 1, not_zero, x.data(), out.data(), "offsets");
    refused(rt, layer, 1, nullptr, x.data(), out.data(), "offsets");
    refused(rt, layer, -1, ok, x.data(), out.data(), "num_seqs");
    refused(rt, layer, 2, ok, nullptr, out.data(), "x");
    refused(rt, layer, 2, ok, x.data(), nullptr, "out");
    refused(rt, nullptr, 2, ok, x.data(), out.data(), "layer");
    refused(nullptr, layer, 2, ok, x.data(), out.data(), "rt");
    CHECK_MESSAGE(mha_encoder_layer_forward_varlen(rt, layer, 2, ok, 1, x.data(), out.data()) == MHA_OK,
                  mha_last_error());
    for (float v : out) CHECK(std::isfinite(v));
    mha_encoder_layer_destroy(layer);
    mha_runtime_destroy(rt);
}
