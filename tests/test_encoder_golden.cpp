// PyTorch's golden files (tests/data/gen_encoder_golden.py), through the C ABI (see encoder_util.hpp).
#include <doctest/doctest.h>

#include "encoder_util.hpp"

using namespace mha;
using namespace encoder_test;

namespace {

namespace fs = std::filesystem;

std::map<std::string, std::string> read_case(const fs::path &d) {
    std::map<std::string, std::string> m;
    std::ifstream f(d / "case.txt");
    std::string k, v;
    while (f >> k >> v) m[k] = v;
    return m;
}

std::vector<float> npy(const fs::path &path, const std::vector<int64_t> &shape) {
    return io::to_floats(path.string(), io::read_npy(path.string()), shape);
}

struct CRuntime {
    mha_runtime *rt = nullptr;
    explicit CRuntime(int threads) { REQUIRE(mha_runtime_create(threads, &rt) == MHA_OK); }
    ~CRuntime() { mha_runtime_destroy(rt); }
};

// One nn.TransformerEncoderLayer's state_dict (under prefix), owned, as mha's encoder weights.
struct TorchEncoderLayer {
    std::vector<float> in_w, in_b, out_w, out_b, w1, b1, w2, b2, n1w, n1b, n2w, n2b;
    mha_encoder_config config{};
    mha_encoder_weights weights{};
    TorchEncoderLayer(const fs::path &dir, const std::string &prefix, int64_t E, int64_t H, int64_t F, int act,
                      int norm, float eps) {
        auto load = [&](const std::string &key, std::vector<int64_t> shape) {
            return npy(dir / (prefix + key + ".npy"), shape);
        };
        in_w = load("self_attn.in_proj_weight", {3 * E, E});
        in_b = load("self_attn.in_proj_bias", {3 * E});
        out_w = load("self_attn.out_proj.weight", {E, E});
        out_b = load("self_attn.out_proj.bias", {E});
        w1 = load("linear1.weight", {F, E});
        b1 = load("linear1.bias", {F});
        w2 = load("linear2.weight", {E, F});
        b2 = load("linear2.bias", {E});
        n1w = load("norm1.weight", {E});
        n1b = load("norm1.bias", {E});
        n2w = load("norm2.weight", {E});
        n2b = load("norm2.bias", {E});
        config.attention.embed_dim = E;
        config.attention.num_heads = H;
        config.attention.norm = norm;
        config.attention.norm_eps = eps;
        config.ffn_dim = F;
        config.activation = act;
        REQUIRE(mha_layer_weights_from_in_proj(&config.attention, in_w.data(), in_b.data(), out_w.data(),
                                               out_b.data(), &weights.attention) == MHA_OK);
        weights.attention.norm_weight = n1w.data();
        weights.attention.norm_bias = n1b.data();
        weights.linear1_weight = w1.data();
        weights.linear1_bias = b1.data();
        weights.linear2_weight = w2.data();
        weights.linear2_bias = b2.data();
        weights.norm2_weight = n2w.data();
        weights.norm2_bias = n2b.data();
    }
};

} // namespace

TEST_CASE("seed 002's MultiHeadAttention (post-norm, eps 1e-6, d_v 32) matches PyTorch through the C ABI") {
    const fs::path d = fs::path(MHA_TEST_DATA) / "encoder" / "seed002_mha";
    auto cs = read_case(d);
    REQUIRE(cs["norm"] == "post");
    const int64_t H = std::stoll(cs["num_heads"]), DK = std::stoll(cs["head_dim"]), DV = std::stoll(cs["value_dim"]);
    const auto qa = io::read_npy((d / "query.npy").string());
    REQUIRE(qa.shape.size() == 3);
    const int64_t B = qa.shape[0], L = qa.shape[1], E = qa.shape[2];
    REQUIRE(E == 512);
    REQUIRE(H == 8);
    const auto query = io::to_floats("query", qa, {B, L, E});
    const auto key = npy(d / "key.npy", {B, L, E}), value = npy(d / "value.npy", {B, L, E});
    const auto wq = npy(d / "weights" / "q_weight.npy", {H * DK, E}), wk = npy(d / "weights" / "k_weight.npy", {H * DK, E});
    const auto wv = npy(d / "weights" / "v_weight.npy", {H * DV, E}), wo = npy(d / "weights" / "out_weight.npy", {E, H * DV});
    const auto nw = npy(d / "weights" / "norm_weight.npy", {E}), nb = npy(d / "weights" / "norm_bias.npy", {E});
    // The seed's mask [B, 1, L]: True = may attend, as ours.
    const auto mask = io::to_bools("mask", io::read_npy((d / "mask.npy").string()), {B, 1, L});
    const auto want = npy(d / "out.npy", {B, L, E});

    mha_layer_config c{};
    c.embed_dim = E;
    c.num_heads = H;
    c.head_dim = DK;
    c.value_dim = DV;
    c.weight_dtype = MHA_F32;
    c.norm = MHA_NORM_POST;
    c.norm_eps = std::stof(cs["eps"]);
    REQUIRE(c.norm_eps == 1e-6f);
    mha_layer_weights w{};
    w.q_weight = wq.data();
    w.k_weight = wk.data();
    w.v_weight = wv.data();
    w.out_weight = wo.data();
    w.norm_weight = nw.data();
    w.norm_bias = nb.data();
    for (int threads : {1, 2}) {
        CAPTURE(threads);
        CRuntime rt(threads);
        mha_layer *layer = nullptr;
        REQUIRE_MESSAGE(mha_layer_create(rt.rt, &c, &w, &layer) == MHA_OK, mha_last_error());
        mha_layer_forward_params p{};
        p.batch = B;
        p.q_len = p.kv_len = L;
        p.mask = mask.data();
        p.mask_batch_stride = L;
        p.mask_row_stride = 0;
        std::vector<float> out(want.size(), test::kSentinel), out_kv(want.size(), test::kSentinel);
        REQUIRE_MESSAGE(mha_layer_forward(rt.rt, layer, &p, query.data(), nullptr, nullptr, out.data()) == MHA_OK,
                        mha_last_error());
        check_close(out, want, 1e-4, "self (key = value = NULL)");
        REQUIRE_MESSAGE(mha_layer_forward(rt.rt, layer, &p, query.data(), key.data(), value.data(), out_kv.data()) ==
                            MHA_OK,
                        mha_last_error());
        check_close(out_kv, want, 1e-4, "key and value passed (post-norm: the same)");
        mha_layer_destroy(layer);
    }
}

TEST_CASE("nn.TransformerEncoderLayer / nn.TransformerEncoder golden files through the C ABI") {
    const fs::path root = fs::path(MHA_TEST_DATA) / "encoder";
    int cases = 0;
    for (const char *name : {"post_relu", "post_gelu", "pre_relu", "pre_gelu", "post_gelu_key_padding",
                             "pre_relu_causal", "encoder2"}) {
        CAPTURE(std::string(name));
        const fs::path d = root / name;
        auto cs = read_case(d);
        const int64_t layers = std::stoll(cs["num_layers"]), H = std::stoll(cs["num_heads"]),
                      F = std::stoll(cs["ffn_dim"]);
        const int act = cs["activation"] == "gelu" ? MHA_ACT_GELU : MHA_ACT_RELU;
        REQUIRE((cs["activation"] == "gelu" || cs["activation"] == "relu"));
        const int norm = cs["norm_first"] == "1" ? MHA_NORM_PRE : MHA_NORM_POST;
        const float eps = std::stof(cs["eps"]);
        const bool causal = cs["causal"] == "1";
        const auto xa = io::read_npy((d / "query.npy").string());
        REQUIRE(xa.shape.size() == 3);
        const int64_t B = xa.shape[0], L = xa.shape[1], E = xa.shape[2];
        const auto x = io::to_floats("query", xa, {B, L, E});
        const auto want = npy(d / "out.npy", {B, L, E});
        std::vector<uint8_t> kpm, am;
        if (fs::exists(d / "key_padding_mask.npy"))
            kpm = io::to_bools("kpm", io::read_npy((d / "key_padding_mask.npy").string()), {B, L});
        if (fs::exists(d / "attn_mask.npy"))
            am = io::to_bools("attn_mask", io::read_npy((d / "attn_mask.npy").string()), {L, L});
        REQUIRE(causal == !am.empty());
        const io::Mask mask = io::from_torch_masks(B, L, L, kpm, am);

        std::vector<TorchEncoderLayer> stack;
        stack.reserve(static_cast<size_t>(layers));
        for (int64_t i = 0; i < layers; ++i)
            stack.emplace_back(d / "weights", layers == 1 ? "" : "layers." + std::to_string(i) + ".", E, H, F, act, norm,
                               eps);
        for (int threads : {1, 2}) {
            CAPTURE(threads);
            CRuntime rt(threads);
            std::vector<mha_encoder_layer *> built;
            for (auto &l : stack) {
                mha_encoder_layer *e = nullptr;
                REQUIRE_MESSAGE(mha_encoder_layer_create(rt.rt, &l.config, &l.weights, &e) == MHA_OK, mha_last_error());
                built.push_back(e);
            }
            // The masks as PyTorch's (converted), and for the causal case p.causal instead of the mask.
            for (int form = 0; form < (causal ? 2 : 1); ++form) {
                CAPTURE(form);
                mha_layer_forward_params p{};
                p.batch = B;
                p.q_len = p.kv_len = L;
                if (form == 0 && !mask.allowed.empty()) {
                    p.mask = mask.allowed.data();
                    p.mask_batch_stride = mask.batch_stride;
                    p.mask_row_stride = mask.row_stride;
                }
                if (form == 1) p.causal = 1;
                std::vector<float> a = x, b(x.size(), test::kSentinel);
                for (auto *e : built) {  // a -> b, then b is the next layer's input
                    REQUIRE_MESSAGE(mha_encoder_layer_forward(rt.rt, e, &p, a.data(), b.data()) == MHA_OK,
                                    mha_last_error());
                    std::swap(a, b);
                }
                check_close(a, want, 1e-4, "out");
                std::vector<float> inplace = x;  // the whole stack in one buffer
                for (auto *e : built)
                    REQUIRE_MESSAGE(mha_encoder_layer_forward(rt.rt, e, &p, inplace.data(), inplace.data()) == MHA_OK,
                                    mha_last_error());
                CHECK(test::same_bits(inplace, a));
            }
            for (auto *e : built) mha_encoder_layer_destroy(e);
        }
        ++cases;
    }
    CHECK(cases == 7);
}
