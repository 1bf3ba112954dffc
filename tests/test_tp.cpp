// The sharded layer (mha_tp.h), run under mpirun -np 1, 2 and 4: against the same head split computed
// in one process (bitwise), against the unsharded layer (the stated bound on the output projection's
// regrouped sum; the attention weights bitwise), over threads per rank (bitwise), in self- and
// cross-attention, GQA, masks, Add & Norm, ragged and cached forms; rank counts that cannot split the
// KV heads refused on every rank; a rank that fails its checks failing every rank, never a hang; bad
// C arguments.
//
// Every rank runs every case in the same order, and collective calls never sit behind a REQUIRE
// (a failed check on one rank must not leave the others waiting in MPI): checks are CHECKs.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>
#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "layer/norm.hpp"
#include "mha/layer.hpp"
#include "mha/mha.h"
#include "mha/mha_tp.h"
#include "mha/serving.hpp"
#include "mha/tp_layer.hpp"
#include "runtime/runtime_state.hpp"
#include "test_util.hpp"

using namespace mha;
using test::random_floats;
using test::same_bits;

namespace {

int g_rank = 0, g_size = 1;

// One layer's weights, owned, and their shards as rank r of n would slice them.
struct Model {
    LayerConfig c;  // resolved
    std::vector<float> wq, wk, wv, wo, bq, bk, bv, bo, nw, nb;

    Model(LayerConfig config, uint32_t seed) : c(config.resolved()) {
        const int64_t E = c.embed_dim, nq = c.num_heads * c.head_dim, nk = c.num_kv_heads * c.head_dim,
                      nv = c.num_kv_heads * c.value_dim;
        auto w = [&](int64_t out, int64_t in, uint32_t s) {
            const float a = 1.0f / std::sqrt(static_cast<float>(in));
            return random_floats(static_cast<size_t>(out * in), seed + s, -a, a);
        };
        wq = w(nq, E, 1);
        wk = w(nk, c.kdim, 2);
        wv = w(nv, c.vdim, 3);
        wo = w(E, c.num_heads * c.value_dim, 4);
        bq = random_floats(static_cast<size_t>(nq), seed + 5, -0.5f, 0.5f);
        bk = random_floats(static_cast<size_t>(nk), seed + 6, -0.5f, 0.5f);
        bv = random_floats(static_cast<size_t>(nv), seed + 7, -0.5f, 0.5f);
        bo = random_floats(static_cast<size_t>(E), seed + 8, -0.5f, 0.5f);
        nw = random_floats(static_cast<size_t>(E), seed + 9, 0.5f, 1.5f);
        nb = random_floats(static_cast<size_t>(E), seed + 10, -0.5f, 0.5f);
    }
    LayerWeights view() const {
        LayerWeights w;
        w.q_weight = wq.data();
        w.k_weight = wk.data();
        w.v_weight = wv.data();
        w.out_weight = wo.data();
        w.q_bias = bq.data();
        w.k_bias = bk.data();
        w.v_bias = bv.data();
        w.out_bias = bo.data();
        w.norm_weight = nw.data();
        w.norm_bias = nb.data();
        return w;
    }
    // Rank r of n's rows and columns, sliced here (not by the library), and its layer config.
    struct Shard {
        LayerConfig c;
        std::vector<float> wq, wk, wv, wo, bq, bk, bv;
        LayerWeights view(const Model &m, bool with_rest) const {
            LayerWeights w;
            w.q_weight = wq.data();
            w.k_weight = wk.data();
            w.v_weight = wv.data();
            w.out_weight = wo.data();
            w.q_bias = bq.data();
            w.k_bias = bk.data();
            w.v_bias = bv.data();
            if (with_rest) {
                w.out_bias = m.bo.data();
                w.norm_weight = m.nw.data();
                w.norm_bias = m.nb.data();
            }
            return w;
        }
    };
    Shard shard(int r, int n) const {
        const int64_t kv = c.num_kv_heads / n, group = c.num_heads / c.num_kv_heads, h = kv * group;
        const int64_t h0 = r * h, kv0 = r * kv, E = c.embed_dim, Hv = c.num_heads * c.value_dim;
        Shard s;
        s.c = c;
        s.c.num_heads = h;
        s.c.num_kv_heads = kv;
        s.c.norm = Norm::none;
        auto rows = [](const std::vector<float> &m, int64_t r0, int64_t n_rows, int64_t width) {
            return std::vector<float>(m.begin() + r0 * width, m.begin() + (r0 + n_rows) * width);
        };
        s.wq = rows(wq, h0 * c.head_dim, h * c.head_dim, E);
        s.wk = rows(wk, kv0 * c.head_dim, kv * c.head_dim, c.kdim);
        s.wv = rows(wv, kv0 * c.value_dim, kv * c.value_dim, c.vdim);
        s.bq = rows(bq, h0 * c.head_dim, h * c.head_dim, 1);
        s.bk = rows(bk, kv0 * c.head_dim, kv * c.head_dim, 1);
        s.bv = rows(bv, kv0 * c.value_dim, kv * c.value_dim, 1);
        for (int64_t e = 0; e < E; ++e)
            for (int64_t j = 0; j < h * c.value_dim; ++j) s.wo.push_back(wo[static_cast<size_t>(e * Hv + h0 * c.value_dim + j)]);
        return s;
    }
};

// The same head split in one process: n shard layers, their partial output projections summed in
// rank order, the bias, then Add & Norm, exactly as mha_tp.h defines the result.
struct SplitReference {
    const Model &m;
    int n;
    std::vector<Model::Shard> shards;
    std::vector<std::unique_ptr<Layer>> layers;
    SplitReference(Runtime &rt, const Model &model, int ranks) : m(model), n(ranks) {
        for (int r = 0; r < n; ++r) shards.push_back(m.shard(r, n));
        for (int r = 0; r < n; ++r) layers.push_back(std::make_unique<Layer>(rt, shards[r].c, shards[r].view(m, false)));
    }
    const float *pre(Runtime &rt, int64_t rows, const float *x, std::vector<float> &xn) const {
        if (m.c.norm != Norm::pre) return x;
        xn.resize(static_cast<size_t>(rows * m.c.embed_dim));
        layer_detail::add_norm_rows(rt.state(), true, rows, m.c.embed_dim, x, m.c.embed_dim, nullptr, 0, xn.data(),
                                    m.c.embed_dim, m.nw.data(), m.nb.data(), m.c.norm_eps);
        return xn.data();
    }
    // parts[r] = rank r's partial; returns the layer's output.
    std::vector<float> finish(Runtime &rt, int64_t rows, const float *x, const std::vector<std::vector<float>> &parts) const {
        const int64_t E = m.c.embed_dim;
        std::vector<float> sum = parts[0];
        for (int r = 1; r < n; ++r)
            for (size_t i = 0; i < sum.size(); ++i) sum[i] += parts[static_cast<size_t>(r)][i];
        for (int64_t i = 0; i < rows; ++i)
            for (int64_t j = 0; j < E; ++j) sum[static_cast<size_t>(i * E + j)] += m.bo[static_cast<size_t>(j)];
        if (m.c.norm == Norm::none) return sum;
        std::vector<float> out(sum.size());
        layer_detail::add_norm_rows(rt.state(), m.c.norm == Norm::post, rows, E, x, E, sum.data(), E, out.data(), E,
                                    m.nw.data(), m.nb.data(), m.c.norm_eps);
        return out;
    }
    std::vector<float> forward(Runtime &rt, const LayerForward &p, const float *q, const float *k, const float *v) const {
        const int64_t rows = p.batch * p.q_len;
        std::vector<float> xn;
        const float *x = pre(rt, rows, q, xn);
        const bool self = !k;
        std::vector<std::vector<float>> parts;
        LayerForward lp = p;
        lp.weights = nullptr;
        for (int r = 0; r < n; ++r) {
            parts.emplace_back(static_cast<size_t>(rows * m.c.embed_dim));
            layers[static_cast<size_t>(r)]->forward(rt, lp, x, self ? nullptr : k, self ? nullptr : v, parts.back().data());
        }
        return finish(rt, rows, q, parts);
    }
};

std::vector<float> forward_of(Runtime &rt, const Layer &l, const LayerForward &p, const float *q, const float *k,
                              const float *v) {
    std::vector<float> out(static_cast<size_t>(p.batch * p.q_len * l.config().embed_dim));
    l.forward(rt, p, q, k, v, out.data());
    return out;
}

std::vector<float> tp_forward_of(Runtime &rt, const TpLayer &l, const LayerForward &p, const float *q, const float *k,
                                 const float *v) {
    std::vector<float> out(static_cast<size_t>(p.batch * p.q_len * l.config().embed_dim), test::kSentinel);
    l.forward(rt, p, q, k, v, out.data());
    return out;
}

double gamma_of(double n) {
    const double u = std::ldexp(1.0, -24);
    return n * u / (1 - n * u);
}

// |sharded - unsharded| <= 2 gamma(K + 1) (sum_k |O_k| |Wo_jk| + |bo_j|), element by element (no norm).
// O comes from the unsharded layer with Wo = I and no bias: its output is O itself, exactly.
int64_t check_bound(Runtime &rt, const Model &m, const LayerForward &p, const float *q, const float *k, const float *v,
                    const std::vector<float> &tp, const std::vector<float> &one, double *worst_ratio) {
    const int64_t E = m.c.embed_dim, K = m.c.num_heads * m.c.value_dim, rows = p.batch * p.q_len;
    std::vector<float> eye(static_cast<size_t>(E * K), 0.0f);
    for (int64_t j = 0; j < E; ++j) eye[static_cast<size_t>(j * K + j)] = 1.0f;
    LayerConfig c = m.c;
    c.norm = Norm::none;
    LayerWeights w = m.view();
    w.out_weight = eye.data();
    w.out_bias = nullptr;
    const Layer o_layer(rt, c, w);
    LayerForward lp = p;
    lp.weights = nullptr;
    const std::vector<float> o = forward_of(rt, o_layer, lp, q, k, v);
    int64_t over = 0;
    *worst_ratio = 0;
    for (int64_t i = 0; i < rows; ++i)
        for (int64_t j = 0; j < E; ++j) {
            double s = std::abs(static_cast<double>(m.bo[static_cast<size_t>(j)]));
            for (int64_t kk = 0; kk < K; ++kk)
                s += std::abs(static_cast<double>(o[static_cast<size_t>(i * K + kk)]) * m.wo[static_cast<size_t>(j * K + kk)]);
            const double bound = 2 * gamma_of(static_cast<double>(K + 1)) * s;
            const double d = std::abs(static_cast<double>(tp[static_cast<size_t>(i * E + j)]) - one[static_cast<size_t>(i * E + j)]);
            if (d > bound) ++over;
            *worst_ratio = std::max(*worst_ratio, d / bound);
        }
    return over;
}

struct Case {
    const char *name;
    int64_t E, H, Hkv, kdim, vdim;
    Norm norm;
    bool cross, causal, masks;
};

const Case kCases[] = {
    {"self H8", 64, 8, 8, 0, 0, Norm::none, false, false, false},
    {"self H8 causal, valid lens and a mask", 64, 8, 8, 0, 0, Norm::none, false, true, true},
    {"GQA H8 over 2 KV heads", 64, 8, 2, 0, 0, Norm::none, false, true, false},
    {"cross H8, kdim 40, vdim 24, masks", 64, 8, 8, 40, 24, Norm::none, true, false, true},
    {"cross GQA H8/2", 64, 8, 2, 0, 0, Norm::none, true, false, true},
    {"post-norm", 64, 8, 8, 0, 0, Norm::post, false, true, false},
    {"pre-norm GQA", 64, 8, 2, 0, 0, Norm::pre, false, false, true},
    {"pre-norm cross", 64, 8, 8, 0, 0, Norm::pre, true, false, false},
    {"E 512 H8 (the output projection over several depth blocks)", 512, 8, 8, 0, 0, Norm::none, false, true, false},
};

bool splits(const LayerConfig &c) { return c.resolved().num_kv_heads % g_size == 0; }

} // namespace

TEST_CASE("the sharded layer: bits of the same split in one process, any threads per rank, and the bound against unsharded") {
    Runtime rt1(RuntimeOptions{1, {}, {}, {}}), rt2(RuntimeOptions{2, {}, {}, {}});
    for (const Case &cs : kCases) {
        const std::string name = cs.name;
        CAPTURE(name);
        LayerConfig cfg;
        cfg.embed_dim = cs.E;
        cfg.num_heads = cs.H;
        cfg.num_kv_heads = cs.Hkv;
        cfg.kdim = cs.kdim;
        cfg.vdim = cs.vdim;
        cfg.norm = cs.norm;
        if (!splits(cfg)) continue;  // refused: the refusal test covers it
        const Model m(cfg, 100 + static_cast<uint32_t>(cs.E + cs.Hkv + cs.kdim));
        const LayerConfig &c = m.c;
        const int64_t B = 2, Lq = 5, Lk = cs.cross ? 7 : Lq, E = c.embed_dim;
        const auto q = random_floats(static_cast<size_t>(B * Lq * E), 11);
        const auto k = random_floats(static_cast<size_t>(B * Lk * c.kdim), 12);
        const auto v = random_floats(static_cast<size_t>(B * Lk * c.vdim), 13);
        const float *kp = cs.cross ? k.data() : nullptr, *vp = cs.cross ? v.data() : nullptr;
        std::vector<uint8_t> mask(static_cast<size_t>(B * Lq * Lk), 1);
        const int32_t valid[2] = {static_cast<int32_t>(Lk), static_cast<int32_t>(Lk - 2)};
        LayerForward p;
        p.batch = B;
        p.q_len = Lq;
        p.kv_len = Lk;
        p.causal = cs.causal;
        if (cs.masks) {
            for (size_t i = 0; i < mask.size(); i += 3) mask[i] = 0;
            for (int64_t b = 0; b < B; ++b)  // every row keeps key 1, so none is fully masked
                for (int64_t i = 0; i < Lq; ++i) mask[static_cast<size_t>((b * Lq + i) * Lk + 1)] = 1;
            p.mask = mask.data();
            p.mask_batch_stride = Lq * Lk;
            p.mask_row_stride = Lk;
            p.kv_valid_lens = valid;
        }

        const TpLayer tp(rt1, MPI_COMM_WORLD, c, m.view());
        CHECK(tp.shard().size == g_size);
        CHECK(tp.shard().num_kv_heads == c.num_kv_heads / g_size);
        CHECK(tp.shard().num_heads == c.num_heads / g_size);
        CHECK(tp.shard().head_begin == g_rank * c.num_heads / g_size);
        const SplitReference split(rt1, m, g_size);
        const auto want = split.forward(rt1, p, q.data(), kp, vp);
        const auto got1 = tp_forward_of(rt1, tp, p, q.data(), kp, vp);
        const auto got2 = tp_forward_of(rt2, tp, p, q.data(), kp, vp);
        CHECK(same_bits(got1, want));
        CHECK(same_bits(got2, got1));

        // Built from per-rank shards, the same layer.
        const Model::Shard mine = m.shard(g_rank, g_size);
        const TpLayer from_shard(rt1, MPI_COMM_WORLD, c, mine.view(m, true), TpLayer::Weights::shard);
        CHECK(same_bits(tp_forward_of(rt2, from_shard, p, q.data(), kp, vp), got1));

        // Against the unsharded layer: the bound without a norm, close with one.
        const Layer one(rt1, c, m.view());
        const auto unsharded = forward_of(rt1, one, p, q.data(), kp, vp);
        if (c.norm == Norm::none) {
            double worst = 0;
            CHECK(check_bound(rt1, m, p, q.data(), kp, vp, got1, unsharded, &worst) == 0);
            if (g_rank == 0)
                MESSAGE(std::string(cs.name) << ": worst |sharded - unsharded| / bound = " << worst << " on " << g_size
                                             << " rank(s)");
        } else {
            double worst = 0;
            for (size_t i = 0; i < got1.size(); ++i)
                worst = std::max(worst, std::abs(static_cast<double>(got1[i]) - unsharded[i]));
            CHECK(worst < 1e-4);
        }

        // The attention weights: every head's, on every rank, with the unsharded layer's bits.
        std::vector<float> probs(static_cast<size_t>(B * c.num_heads * Lq * Lk), test::kSentinel), probs1(probs.size());
        LayerForward pw = p;
        pw.weights = probs.data();
        CHECK(same_bits(tp_forward_of(rt2, tp, pw, q.data(), kp, vp), got1));
        pw.weights = probs1.data();
        forward_of(rt1, one, pw, q.data(), kp, vp);
        CHECK(same_bits(probs, probs1));
    }
}

TEST_CASE("the sharded layer in place (out == query) and with empty calls") {
    Runtime rt(RuntimeOptions{1, {}, {}, {}});
    LayerConfig cfg;
    cfg.embed_dim = 32;
    cfg.num_heads = 4;
    cfg.norm = Norm::post;
    if (!splits(cfg)) return;
    const Model m(cfg, 7);
    const TpLayer tp(rt, MPI_COMM_WORLD, m.c, m.view());
    const int64_t B = 1, L = 9, E = 32;
    auto x = random_floats(static_cast<size_t>(B * L * E), 3);
    LayerForward p;
    p.batch = B;
    p.q_len = L;
    const auto want = tp_forward_of(rt, tp, p, x.data(), nullptr, nullptr);
    tp.forward(rt, p, x.data(), nullptr, nullptr, x.data());
    CHECK(same_bits(x, want));
    p.batch = 0;  // nothing to compute: every rank agrees and returns
    CHECK_NOTHROW(tp.forward(rt, p, nullptr, nullptr, nullptr, nullptr));
    CHECK(tp.timing().calls == 3);
    CHECK(tp.timing().comm_seconds <= tp.timing().seconds);
    CHECK(tp.timing().wait_seconds <= tp.timing().comm_seconds);
    CHECK(tp.timing().wait_seconds > 0);
}

TEST_CASE("the sharded layer's ragged and cached forms") {
    Runtime rt1(RuntimeOptions{1, {}, {}, {}}), rt2(RuntimeOptions{2, {}, {}, {}});
    for (const auto &[H, Hkv, norm] : {std::tuple{8, 8, Norm::none}, {8, 2, Norm::pre}, {8, 2, Norm::post}}) {
        LayerConfig cfg;
        cfg.embed_dim = 64;
        cfg.num_heads = H;
        cfg.num_kv_heads = Hkv;
        cfg.norm = norm;
        CAPTURE(Hkv);
        CAPTURE(static_cast<int>(norm));
        if (!splits(cfg)) continue;
        const Model m(cfg, 31 + static_cast<uint32_t>(Hkv));
        const LayerConfig &c = m.c;
        const int64_t E = c.embed_dim;
        const TpLayer tp(rt1, MPI_COMM_WORLD, c, m.view());
        const SplitReference split(rt1, m, g_size);
        const Layer one(rt1, c, m.view());

        // Ragged: two sequences of 6 and 3 tokens, causal.
        const int64_t offs[3] = {0, 6, 9};
        const auto x = random_floats(static_cast<size_t>(9 * E), 41);
        std::vector<float> got(x.size()), want(x.size());
        tp.forward_varlen(rt2, {2, offs, true}, x.data(), got.data());
        {
            std::vector<float> xn;
            const float *xin = split.pre(rt1, 9, x.data(), xn);
            std::vector<std::vector<float>> parts;
            for (int r = 0; r < g_size; ++r) {
                parts.emplace_back(x.size());
                split.layers[static_cast<size_t>(r)]->forward_varlen(rt1, {2, offs, true}, xin, parts.back().data());
            }
            want = split.finish(rt1, 9, x.data(), parts);
        }
        CHECK(same_bits(got, want));

        // Cached: a prefill of 5 and 3 tokens, then two decode steps, through this rank's cache.
        KVCacheConfig cc;
        cc.num_kv_heads = tp.shard().num_kv_heads;
        cc.head_dim = c.head_dim;
        cc.value_dim = c.value_dim;
        cc.max_tokens = 1024;
        KVCache cache(rt1, cc);
        std::vector<std::unique_ptr<KVCache>> ref_caches;
        for (int r = 0; r < g_size; ++r) ref_caches.push_back(std::make_unique<KVCache>(rt1, cc));
        KVCacheConfig full_cc = cc;
        full_cc.num_kv_heads = c.num_kv_heads;
        KVCache full_cache(rt1, full_cc);
        const int64_t ids[2] = {4, 9};
        for (int step = 0; step < 3; ++step) {
            CAPTURE(step);
            const int64_t q_offs[3] = {0, step ? 1 : 5, step ? 2 : 8};
            const int64_t rows = q_offs[2];
            const auto xs = random_floats(static_cast<size_t>(rows * E), 50 + static_cast<uint32_t>(step));
            const LayerCachedForward p{2, ids, q_offs, true};
            std::vector<float> y(xs.size()), y_one(xs.size());
            tp.forward_cached(step == 1 ? rt2 : rt1, cache, p, xs.data(), y.data());
            std::vector<float> xn;
            const float *xin = split.pre(rt1, rows, xs.data(), xn);
            std::vector<std::vector<float>> parts;
            for (int r = 0; r < g_size; ++r) {
                parts.emplace_back(xs.size());
                split.layers[static_cast<size_t>(r)]->forward_cached(rt1, *ref_caches[static_cast<size_t>(r)], p, xin,
                                                                    parts.back().data());
            }
            CHECK(same_bits(y, split.finish(rt1, rows, xs.data(), parts)));
            one.forward_cached(rt1, full_cache, p, xs.data(), y_one.data());
            double worst = 0;
            for (size_t i = 0; i < y.size(); ++i) worst = std::max(worst, std::abs(static_cast<double>(y[i]) - y_one[i]));
            CHECK(worst < 1e-4);
        }
        CHECK(cache.seq_len(4) == 7);
        CHECK(cache.seq_len(9) == 5);
    }
}

TEST_CASE("rank counts that do not divide the KV heads are refused on every rank, with a message") {
    Runtime rt(RuntimeOptions{1, {}, {}, {}});
    for (const auto &[H, Hkv] : {std::pair{6, 3}, {8, 2}, {8, 1}}) {
        LayerConfig cfg;
        cfg.embed_dim = 48;
        cfg.num_heads = H;
        cfg.num_kv_heads = Hkv;
        const Model m(cfg, 5);
        CAPTURE(Hkv);
        if (Hkv % g_size == 0) {
            CHECK_NOTHROW(TpLayer(rt, MPI_COMM_WORLD, m.c, m.view()));
            continue;
        }
        std::string message;
        try {
            TpLayer tp(rt, MPI_COMM_WORLD, m.c, m.view());
        } catch (const Error &e) {
            message = e.what();
            CHECK(e.status() == Status::invalid_argument);
        }
        CAPTURE(message);
        CHECK(message.find("cannot be split over " + std::to_string(g_size) + " ranks") != std::string::npos);
        // The C ABI: the same refusal, and no layer.
        mha_runtime *crt = nullptr;
        CHECK(mha_runtime_create(1, &crt) == MHA_OK);
        mha_layer_config ccfg{};
        ccfg.embed_dim = 48;
        ccfg.num_heads = H;
        ccfg.num_kv_heads = Hkv;
        mha_layer_weights cw{};
        cw.q_weight = m.wq.data();
        cw.k_weight = m.wk.data();
        cw.v_weight = m.wv.data();
        cw.out_weight = m.wo.data();
        mha_tp_layer *l = reinterpret_cast<mha_tp_layer *>(&ccfg);
        CHECK(mha_tp_layer_create(crt, MPI_COMM_WORLD, &ccfg, &cw, &l) == MHA_INVALID_ARGUMENT);
        CHECK(l == nullptr);
        CHECK(std::string(mha_last_error()).find("cannot be split") != std::string::npos);
        mha_tp_shard s{};
        CHECK(mha_tp_shard_for(&ccfg, 0, g_size, &s) == MHA_INVALID_ARGUMENT);
        mha_runtime_destroy(crt);
    }
}

TEST_CASE("a rank that fails its checks makes every rank fail, never a hang") {
    Runtime rt(RuntimeOptions{1, {}, {}, {}});
    LayerConfig cfg;
    cfg.embed_dim = 32;
    cfg.num_heads = 4;
    cfg.num_kv_heads = 4;
    const Model m(cfg, 9);
    const TpLayer tp(rt, MPI_COMM_WORLD, m.c, m.view());
    const int64_t B = 1, L = 4, E = 32;
    const auto x = random_floats(static_cast<size_t>(B * L * E), 1);
    LayerForward p;
    p.batch = B;
    p.q_len = L;
    const int last = g_size - 1;
    const std::string last_name = "rank " + std::to_string(last) + " of " + std::to_string(g_size);

    // The last rank passes no query; every rank throws its error and writes nothing.
    std::vector<float> out(x.size(), test::kSentinel);
    std::string message;
    Status status = Status::ok;
    try {
        tp.forward(rt, p, g_rank == last ? nullptr : x.data(), nullptr, nullptr, out.data());
    } catch (const Error &e) {
        message = e.what();
        status = e.status();
    }
    CAPTURE(message);
    CHECK(status == Status::invalid_argument);
    CHECK(message.find(last_name + ": query is NULL") != std::string::npos);
    CHECK(std::all_of(out.begin(), out.end(), [](float f) { return f == test::kSentinel; }));

    // Calls that disagree (rank 0 asks for one more row) are refused on every rank.
    message.clear();
    std::vector<float> big(x.size() + static_cast<size_t>(E));
    LayerForward pb = p;
    if (g_rank == 0) pb.q_len = L + 1;
    try {
        tp.forward(rt, pb, g_rank == 0 ? big.data() : x.data(), nullptr, nullptr, big.data());
    } catch (const Error &e) {
        message = e.what();
    }
    CAPTURE(message);
    if (g_size > 1)
        CHECK(message.find("disagree on q_len") != std::string::npos);
    else
        CHECK(message.empty());

    // The C ABI: a NULL p or rt on the last rank fails every rank's call.
    mha_runtime *crt = nullptr;
    CHECK(mha_runtime_create(1, &crt) == MHA_OK);
    mha_layer_config ccfg{};
    ccfg.embed_dim = 32;
    ccfg.num_heads = 4;
    mha_layer_weights cw{};
    cw.q_weight = m.wq.data();
    cw.k_weight = m.wk.data();
    cw.v_weight = m.wv.data();
    cw.out_weight = m.wo.data();
    mha_tp_layer *l = nullptr;
    CHECK(mha_tp_layer_create(crt, MPI_COMM_WORLD, &ccfg, &cw, &l) == MHA_OK);
    mha_layer_forward_params cp{};
    cp.batch = B;
    cp.q_len = L;
    CHECK(mha_tp_layer_forward(crt, l, g_rank == last ? nullptr : &cp, x.data(), nullptr, nullptr, out.data()) ==
          MHA_INVALID_ARGUMENT);
    CHECK(std::string(mha_last_error()).find(last_name + ": p is NULL") != std::string::npos);
    CHECK(mha_tp_layer_forward(g_rank == last ? nullptr : crt, l, &cp, x.data(), nullptr, nullptr, out.data()) ==
          MHA_INVALID_ARGUMENT);
    CHECK(std::string(mha_last_error()).find(last_name + ": rt is NULL") != std::string::npos);
    CHECK(std::all_of(out.begin(), out.end(), [](float f) { return f == test::kSentinel; }));
    CHECK(mha_tp_layer_forward(crt, l, &cp, x.data(), nullptr, nullptr, out.data()) == MHA_OK);
    mha_tp_timing t{};
    CHECK(mha_tp_layer_timing(l, &t) == MHA_OK);
    CHECK(t.calls == 3);
    CHECK(mha_tp_layer_reset_timing(l) == MHA_OK);
    CHECK(mha_tp_layer_timing(l, &t) == MHA_OK);
    CHECK(t.calls == 0);
    mha_tp_shard s{};
    CHECK(mha_tp_layer_get_shard(l, &s) == MHA_OK);
    CHECK(s.rank == g_rank);
    CHECK(s.size == g_size);
    mha_layer_config got{};
    CHECK(mha_tp_layer_get_config(l, &got) == MHA_OK);
    CHECK(got.head_dim == 8);
    CHECK(got.num_kv_heads == 4);

    // A failed create on the last rank (NULL weights) fails everywhere and leaves no layer.
    mha_tp_layer *l2 = l;
    CHECK(mha_tp_layer_create(crt, MPI_COMM_WORLD, &ccfg, g_rank == last ? nullptr : &cw, &l2) == MHA_INVALID_ARGUMENT);
    CHECK(l2 == nullptr);
    CHECK(std::string(mha_last_error()).find(last_name + ": weights is NULL") != std::string::npos);
    l2 = l;
    CHECK(mha_tp_layer_create(crt, MPI_COMM_WORLD, &ccfg, &cw, g_rank == last ? nullptr : &l2) == MHA_INVALID_ARGUMENT);
    if (g_rank != last) CHECK(l2 == nullptr);
    // Configs that differ between the ranks.
    mha_layer_config odd = ccfg;
    if (g_rank == 0) odd.norm = MHA_NORM_POST;
    const mha_status st = mha_tp_layer_create(crt, MPI_COMM_WORLD, &odd, &cw, &l2);
    if (g_size > 1) {
        CHECK(st == MHA_INVALID_ARGUMENT);
        CHECK(std::string(mha_last_error()).find("disagree on norm") != std::string::npos);
    } else {
        CHECK(st == MHA_OK);
        mha_tp_layer_destroy(l2);
    }

    // Local bad arguments: no communicator, NULL outputs of the getters, bad shards.
    CHECK(mha_tp_layer_create(crt, MPI_COMM_NULL, &ccfg, &cw, &l2) == MHA_INVALID_ARGUMENT);
    CHECK(std::string(mha_last_error()).find("MPI_COMM_NULL") != std::string::npos);
    CHECK(mha_tp_layer_forward(crt, nullptr, &cp, x.data(), nullptr, nullptr, out.data()) == MHA_INVALID_ARGUMENT);
    CHECK(mha_tp_layer_get_shard(l, nullptr) == MHA_INVALID_ARGUMENT);
    CHECK(mha_tp_layer_get_shard(nullptr, &s) == MHA_INVALID_ARGUMENT);
    CHECK(mha_tp_layer_timing(l, nullptr) == MHA_INVALID_ARGUMENT);
    CHECK(mha_tp_shard_for(&ccfg, g_size, g_size, &s) == MHA_INVALID_ARGUMENT);
    CHECK(mha_tp_shard_for(&ccfg, 0, 0, &s) == MHA_INVALID_ARGUMENT);
    CHECK(mha_tp_shard_for(nullptr, 0, 1, &s) == MHA_INVALID_ARGUMENT);
    CHECK(mha_tp_shard_for(&ccfg, 1, 2, &s) == MHA_OK);
    CHECK(s.head_begin == 2);
    CHECK(s.num_heads == 2);
    mha_tp_layer_destroy(l);
    mha_tp_layer_destroy(nullptr);
    mha_runtime_destroy(crt);
}

TEST_CASE("a rank whose cache cannot take the tokens fails every rank, and no rank's cache changes") {
    Runtime rt(RuntimeOptions{1, {}, {}, {}});
    LayerConfig cfg;
    cfg.embed_dim = 32;
    cfg.num_heads = 4;
    cfg.num_kv_heads = 4;
    const Model m(cfg, 13);
    const TpLayer tp(rt, MPI_COMM_WORLD, m.c, m.view());
    const int last = g_size - 1;
    KVCacheConfig cc;
    cc.num_kv_heads = tp.shard().num_kv_heads;
    cc.head_dim = m.c.head_dim;
    cc.value_dim = m.c.value_dim;
    cc.max_tokens = 1;  // the last rank's cache: one block
    KVCache probe(rt, cc);
    const int64_t block = probe.config().block_tokens, E = 32;
    if (g_rank != last) cc.max_tokens = 4 * block;  // the others have room
    KVCache cache(rt, cc);
    const int64_t ids[1] = {3};
    const int64_t two[2] = {0, 2}, many[2] = {0, block};
    const auto x = random_floats(static_cast<size_t>(block * E), 2);
    std::vector<float> out(x.size(), test::kSentinel);
    CHECK_NOTHROW(tp.forward_cached(rt, cache, {1, ids, two, true}, x.data(), out.data()));
    const int64_t free_before = cache.free_tokens();
    std::fill(out.begin(), out.end(), test::kSentinel);
    std::string message;
    Status status = Status::ok;
    try {
        tp.forward_cached(rt, cache, {1, ids, many, true}, x.data(), out.data());
    } catch (const Error &e) {
        message = e.what();
        status = e.status();
    }
    CAPTURE(message);
    CHECK(status == Status::out_of_memory);
    CHECK(message.find("rank " + std::to_string(last) + " of " + std::to_string(g_size)) != std::string::npos);
    CHECK(cache.seq_len(3) == 2);
    CHECK(cache.free_tokens() == free_before);
    CHECK(std::all_of(out.begin(), out.end(), [](float f) { return f == test::kSentinel; }));

    // A cache of the wrong width, and caches that disagree on a sequence's length, are refused alike.
    message.clear();
    try {
        KVCacheConfig wide = cc;
        wide.num_kv_heads = m.c.num_kv_heads + (g_rank == last ? 1 : 0);
        KVCache other(rt, wide);
        tp.forward_cached(rt, g_rank == last ? other : cache, {1, ids, two, true}, x.data(), out.data());
    } catch (const Error &e) {
        message = e.what();
    }
    CAPTURE(message);
    CHECK(message.find("kv cache holds num_kv_heads") != std::string::npos);
    CHECK(cache.seq_len(3) == 2);
    if (g_size > 1) {
        message.clear();
        const int64_t ids7[1] = {7};
        const int64_t one[2] = {0, 1};
        KVCacheConfig roomy = cc;
        roomy.max_tokens = 4 * block;
        KVCache fresh(rt, roomy);
        if (g_rank == 0) fresh.append(7, 1, x.data(), x.data());  // rank 0 alone holds sequence 7
        try {
            tp.forward_cached(rt, fresh, {1, ids7, one, true}, x.data(), out.data());
        } catch (const Error &e) {
            message = e.what();
        }
        CAPTURE(message);
        CHECK(message.find("disagree on the cached lengths") != std::string::npos);
        CHECK(fresh.contains(7) == (g_rank == 0));
        if (g_rank == 0) CHECK(fresh.seq_len(7) == 1);
    }
    // And the caches still work together afterwards.
    const int64_t one[2] = {0, 1};
    CHECK_NOTHROW(tp.forward_cached(rt, cache, {1, ids, one, true}, x.data(), out.data()));
    CHECK(cache.seq_len(3) == 3);
}

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &g_rank);
    MPI_Comm_size(MPI_COMM_WORLD, &g_size);
    doctest::Context ctx(argc, argv);
    const int failed = ctx.run();
    int any = failed != 0;
    MPI_Allreduce(MPI_IN_PLACE, &any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    MPI_Finalize();
    return any;
}
