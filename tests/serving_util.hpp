// The serving tests' runtimes, sequences, references, comparisons, cache and layer, shared by the
// test_serving_*.cpp files. Serving is tested through the C ABI: ragged attention
// (mha_attention_varlen, test_serving_varlen), the paged KV cache (mha_kv_cache_*) and attention
// over it (mha_attention_cached, test_serving_cache; its int8 storage and window,
// test_serving_i8_window), against the double reference, on every ISA the host has, with the
// default tiles and with tiny ones; the bit-identity of a token however it is batched, the layer's
// incremental forward (mha_layer_forward_cached) included (issue 13, section 5; test_serving_bits);
// bad input that must leave everything as it was (test_serving_bad_input); and host threads that
// share one cache (test_serving_threads).
#pragma once

#include <doctest/doctest.h>

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <initializer_list>
#include <optional>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "mha/isa.hpp"
#include "mha/mha.h"
#include "mha/tile_config.hpp"
#include "reference.hpp"
#include "test_util.hpp"

namespace serving_test {

using namespace mha;
using test::random_floats;

// ---- Runtimes: an ISA and a tile config, through the C ABI ------------------------------------

struct Setup {
    std::string name;
    Isa isa;
    std::optional<TileConfig> tiles;  // unset: the runtime's defaults
};

inline TileConfig default_tiles(Isa isa) { return default_tile_config(isa, detect_cache_sizes()); }
inline TileConfig tiles_of(const Setup &s) { return s.tiles ? *s.tiles : default_tiles(s.isa); }

// The microkernel's NR, from its name ("avx2_6x16" -> 16).
inline int64_t nr_of(const TileConfig &t) {
    const size_t x = t.gemm_ukernel.rfind('x');
    REQUIRE(x != std::string::npos);
    return std::stoll(t.gemm_ukernel.substr(x + 1));
}

inline Setup default_setup(Isa isa) { return {std::string(isa_name(isa)) + " default tiles", isa, std::nullopt}; }

inline Setup tiles_setup(Isa isa, int64_t block_q, int64_t block_k, int64_t kv_chunk) {
    TileConfig t = default_tiles(isa);
    t.attn_block_q = block_q;
    t.attn_block_k = block_k;
    t.attn_kv_chunk = kv_chunk;
    return {std::string(isa_name(isa)) + " tiles " + std::to_string(block_q) + "/" + std::to_string(block_k) + "/" +
                std::to_string(kv_chunk),
            isa, t};
}

// Every ISA the host has, with the default tiles and with small ones (block_q / block_k / kv_chunk).
inline std::vector<Setup> setups(int64_t block_q, int64_t block_k, int64_t kv_chunk) {
    std::vector<Setup> v;
    for (Isa isa : supported_isas()) {
        v.push_back(default_setup(isa));
        v.push_back(tiles_setup(isa, block_q, block_k, kv_chunk));
    }
    return v;
}

// Without a cache: the defaults and tiny tiles that put edges everywhere (as test_attention).
inline std::vector<Setup> varlen_setups() { return setups(5, 7, 14); }

// With a cache: block_tokens must divide attn_block_k and be a multiple of NR, so the small tiles
// keep attn_block_k = 64 (a multiple of every NR up to 64 ... 2 x 32, 4 x 16) with 2 key tiles per chunk.
inline std::vector<Setup> cache_setups() { return setups(5, 64, 128); }

inline Setup best_default() { return default_setup(supported_isas().back()); }

// A C runtime with this ISA (through MHA_ISA) and these tiles (through a tile config file).
class Rt {
public:
    Rt(int threads, const Setup &s) {
        static std::atomic<int> counter{0};
        const char *env = std::getenv("MHA_ISA");
        const std::optional<std::string> saved = env ? std::optional<std::string>(env) : std::nullopt;
        setenv("MHA_ISA", std::string(isa_name(s.isa)).c_str(), 1);
        std::string path;
        if (s.tiles) {
            path = (std::filesystem::temp_directory_path() /
                    ("mha_test_serving_" + std::to_string(getpid()) + "_" + std::to_string(counter++) + ".json"))
                       .string();
            TileConfigFile f;
            f.isa = s.isa;
            f.tiles = *s.tiles;
            std::ofstream(path) << tile_config_json(f);
        }
        const mha_status st = mha_runtime_create_with_config(threads, path.empty() ? nullptr : path.c_str(), &rt_);
        const std::string err = mha_last_error();
        if (saved)
            setenv("MHA_ISA", saved->c_str(), 1);
        else
            unsetenv("MHA_ISA");
        if (!path.empty()) std::filesystem::remove(path);
        REQUIRE_MESSAGE(st == MHA_OK, s.name << ": " << err);
    }
    ~Rt() { mha_runtime_destroy(rt_); }
    Rt(const Rt &) = delete;
    Rt &operator=(const Rt &) = delete;
    operator mha_runtime *() const { return rt_; }

private:
    mha_runtime *rt_ = nullptr;
};

// ---- Shapes, sequences, references and comparisons --------------------------------------------

struct Shape {
    int64_t H, Hkv, D, Dv;
    int64_t q_row() const { return H * D; }
    int64_t k_row() const { return Hkv * D; }
    int64_t v_row() const { return Hkv * Dv; }
    int64_t o_row() const { return H * Dv; }
};

inline size_t sz(int64_t n) { return static_cast<size_t>(n); }

// One sequence: Lq query rows (the last Lq positions when Lq <= Lk) over Lk key/value rows.
struct SeqData {
    int64_t Lq = 0, Lk = 0;
    std::vector<float> q, k, v;
    SeqData(const Shape &s, int64_t lq, int64_t lk, uint32_t seed)
        : Lq(lq), Lk(lk), q(random_floats(sz(lq * s.q_row()), seed)), k(random_floats(sz(lk * s.k_row()), seed + 1)),
          v(random_floats(sz(lk * s.v_row()), seed + 2)) {}
    SeqData(const Shape &s, int64_t L, uint32_t seed) : SeqData(s, L, L, seed) {}
};

// The score modifiers every helper below passes (mha_attention, varlen, cached, the reference):
// none, unless a test sets them (with VariantScope).
inline mha_attention_variant g_variant{};
struct VariantScope {
    explicit VariantScope(const mha_attention_variant &v) { g_variant = v; }
    ~VariantScope() { g_variant = mha_attention_variant{}; }
};

// The double reference of one sequence (batch 1): q [Lq, H, D], k [Lk, Hkv, D], v [Lk, Hkv, Dv].
inline std::vector<double> reference(const Shape &s, int64_t Lq, int64_t Lk, bool causal, const float *q, const float *k,
                              const float *v, double scale = 0) {
    ref::AttentionCase c{1, Lq, Lk, s.H, s.Hkv, s.D, s.Dv, scale != 0 ? scale : 1.0 / std::sqrt(static_cast<double>(s.D)),
                         causal};
    c.window = g_variant.window;
    c.softcap = g_variant.softcap;
    c.alibi = g_variant.alibi_slopes;
    c.sinks = g_variant.sink_logits;
    std::vector<double> out;
    ref::attention(c, q, k, v, out);
    return out;
}

// got against the reference within test_attention's tolerance; a row that sees no key (the
// reference gives exactly 0) must be exactly 0.
inline bool close_to(const float *got, const std::vector<double> &want, const std::string &what) {
    int bad = 0;
    for (size_t i = 0; i < want.size(); ++i) {
        const bool ok = want[i] == 0.0 ? got[i] == 0.0f : std::fabs(got[i] - want[i]) <= 5e-5;
        if (!ok && bad++ < 3) FAIL_CHECK(what << ": [" << i << "] = " << got[i] << ", want " << want[i]);
    }
    if (bad) FAIL_CHECK(what << ": " << bad << " of " << want.size() << " values off the reference");
    return bad == 0;
}

// Rows [0, rows) of got and want, row_floats each, compared bit for bit (memcmp).
inline bool same_rows(const float *got, const float *want, int64_t rows, int64_t row_floats, const std::string &what,
               int64_t first_row = 0) {
    for (int64_t r = 0; r < rows; ++r) {
        const float *a = got + r * row_floats, *b = want + r * row_floats;
        if (std::memcmp(a, b, sz(row_floats) * sizeof(float)) != 0) {
            int64_t c = 0;
            while (c < row_floats && std::memcmp(a + c, b + c, sizeof(float)) == 0) ++c;
            FAIL_CHECK(what << ": row " << first_row + r << " differs, first at [" << c << "]: " << a[c] << " vs "
                            << b[c] << " (diff " << static_cast<double>(a[c]) - b[c] << ")");
            return false;
        }
    }
    return true;
}

inline bool contains_any(const std::string &msg, const std::vector<std::string> &needles) {
    if (needles.empty()) return true;
    for (const auto &n : needles)
        if (msg.find(n) != std::string::npos) return true;
    return false;
}

inline bool all_sentinel(const std::vector<float> &x, size_t from = 0) {
    for (size_t i = from; i < x.size(); ++i)
        if (std::memcmp(&x[i], &test::kSentinel, sizeof(float)) != 0) return false;
    return true;
}

// The fields mha_attention_params and mha_varlen_params share: the heads, the scale, the mask and
// the score modifiers.
template <class Params>
void set_heads(Params &p, const Shape &s, bool causal, float scale) {
    p.num_heads = s.H;
    p.num_kv_heads = s.Hkv;
    p.head_dim = s.D;
    p.value_dim = s.Dv;
    p.scale = scale;
    p.causal = causal;
    p.variant = g_variant;
}

// mha_attention on one sequence alone (batch 1, bottom-right causal as in every path).
inline std::vector<float> dense(mha_runtime *rt, const Shape &s, int64_t Lq, int64_t Lk, bool causal, const float *q,
                         const float *k, const float *v, float scale = 0) {
    mha_attention_params p{};
    p.batch = 1;
    p.q_len = Lq;
    p.kv_len = Lk;
    set_heads(p, s, causal, scale);
    std::vector<float> out(sz(Lq * s.o_row()), test::kSentinel);
    const mha_status st = mha_attention(rt, &p, q, k, v, out.data());
    REQUIRE_MESSAGE(st == MHA_OK, mha_last_error());
    return out;
}

// A ragged batch of sequences, concatenated.
struct Ragged {
    Shape s;
    std::vector<int64_t> qo{0}, ko{0};
    std::vector<float> q, k, v;
    explicit Ragged(const Shape &shape) : s(shape) {}
    void add(const SeqData &d) {
        q.insert(q.end(), d.q.begin(), d.q.end());
        k.insert(k.end(), d.k.begin(), d.k.end());
        v.insert(v.end(), d.v.begin(), d.v.end());
        qo.push_back(qo.back() + d.Lq);
        ko.push_back(ko.back() + d.Lk);
    }
    int64_t num_seqs() const { return static_cast<int64_t>(qo.size()) - 1; }
    int64_t total_q() const { return qo.back(); }
    mha_varlen_params params(bool causal, float scale = 0) const {
        mha_varlen_params p{};
        p.num_seqs = num_seqs();
        p.q_offsets = qo.data();
        p.kv_offsets = ko.data();
        set_heads(p, s, causal, scale);
        return p;
    }
    // Runs it; out gets total_q rows (plus whatever tail the caller put past them).
    void run(mha_runtime *rt, bool causal, float *out, float scale = 0) const {
        const mha_varlen_params p = params(causal, scale);
        static const float none[1] = {0};  // empty tensors are passed as valid pointers
        const mha_status st = mha_attention_varlen(rt, &p, q.empty() ? none : q.data(), k.empty() ? none : k.data(),
                                                   v.empty() ? none : v.data(), out);
        REQUIRE_MESSAGE(st == MHA_OK, mha_last_error());
    }
};

// ---- The cache --------------------------------------------------------------------------------

class Cache {
public:
    Cache(mha_runtime *rt, const Shape &s, int64_t max_tokens, int64_t block_tokens = 0, mha_dtype dtype = MHA_F32) {
        mha_kv_cache_config cfg{};
        cfg.num_kv_heads = s.Hkv;
        cfg.head_dim = s.D;
        cfg.value_dim = s.Dv;
        cfg.block_tokens = block_tokens;
        cfg.max_tokens = max_tokens;
        cfg.dtype = dtype;
        const mha_status st = mha_kv_cache_create(rt, &cfg, &c_);
        REQUIRE_MESSAGE(st == MHA_OK, mha_last_error());
        REQUIRE(c_ != nullptr);
    }
    ~Cache() { mha_kv_cache_destroy(c_); }
    Cache(const Cache &) = delete;
    Cache &operator=(const Cache &) = delete;
    operator mha_kv_cache *() const { return c_; }

    mha_kv_cache_config config() const {
        mha_kv_cache_config c{};
        REQUIRE(mha_kv_cache_get_config(c_, &c) == MHA_OK);
        return c;
    }
    int64_t block_tokens() const { return config().block_tokens; }
    int64_t free_tokens() const {
        int64_t t = -1;
        REQUIRE_MESSAGE(mha_kv_cache_free_tokens(c_, &t) == MHA_OK, mha_last_error());
        return t;
    }
    // -1 for an id the cache does not hold.
    int64_t seq_len(int64_t id) const {
        int64_t n = -7;
        return mha_kv_cache_seq_len(c_, id, &n) == MHA_OK ? n : -1;
    }
    void read(int64_t id, int64_t start, int64_t n, const Shape &s, std::vector<float> &k, std::vector<float> &v) const {
        k.assign(sz(n * s.k_row()), test::kSentinel);
        v.assign(sz(n * s.v_row()), test::kSentinel);
        const mha_status st = mha_kv_cache_read(c_, id, start, n, k.data(), v.data());
        REQUIRE_MESSAGE(st == MHA_OK, mha_last_error());
    }

private:
    mha_kv_cache *c_ = nullptr;
};

// Tokens a cache must hold for sequences of these lengths (whole blocks each).
inline int64_t capacity(int64_t bt, std::initializer_list<int64_t> lens) {
    int64_t t = 0;
    for (int64_t n : lens) t += (n + bt - 1) / bt * bt;
    return t;
}

const float kNone[1] = {0};  // a valid pointer for appends of 0 tokens

// The resolved block size the runtime picks for these dims.
inline int64_t block_tokens_for(mha_runtime *rt, const Shape &s, int64_t block_tokens = 0) {
    Cache probe(rt, s, 1, block_tokens);
    return probe.block_tokens();
}

inline void append(mha_runtime *rt, mha_kv_cache *c, const Shape &s, int64_t id, const SeqData &d, int64_t from, int64_t n) {
    const mha_status st = mha_kv_cache_append(rt, c, id, n, d.k.data() + from * s.k_row(), d.v.data() + from * s.v_row());
    REQUIRE_MESSAGE(st == MHA_OK, mha_last_error());
}

inline mha_status cached(mha_runtime *rt, mha_kv_cache *c, const std::vector<int64_t> &ids, const std::vector<int64_t> &qo,
                  int64_t H, bool causal, const float *q, float *out, float scale = 0) {
    mha_cached_params p{};
    p.num_seqs = static_cast<int64_t>(ids.size());
    p.seq_ids = ids.data();
    p.q_offsets = qo.data();
    p.num_heads = H;
    p.scale = scale;
    p.causal = causal;
    p.variant = g_variant;
    return mha_attention_cached(rt, c, &p, q, out);
}

// Chunk sizes that cover L: the given ones while they fit, then the rest.
inline std::vector<int64_t> chunks_of(int64_t L, std::initializer_list<int64_t> sizes) {
    std::vector<int64_t> v;
    int64_t pos = 0;
    for (int64_t n : sizes)
        if (pos + n < L) {
            v.push_back(n);
            pos += n;
        }
    if (pos < L) v.push_back(L - pos);
    return v;
}

// Sequence 2 appended and attended in chunks (`sizes`, on r2), then sequence 3 token by token
// (decode, the runtimes alternating), each output row against the prefill's F bit for bit
// (`what` names the cache in the messages). Returns how many chunks and steps differed.
inline int64_t chunks_then_steps(mha_runtime *r1, mha_runtime *r2, mha_kv_cache *c, const Shape &s, const SeqData &t,
                          const std::vector<float> &F, int64_t L, std::initializer_list<int64_t> sizes,
                          const std::string &what) {
    const int64_t row = s.o_row();
    int64_t pos = 0, bad = 0;
    for (int64_t n : chunks_of(L, sizes)) {
        append(r2, c, s, 2, t, pos, n);
        std::vector<float> out(sz(n * row), test::kSentinel);
        REQUIRE(cached(r2, c, {2}, {0, n}, s.H, true, t.q.data() + pos * s.q_row(), out.data()) == MHA_OK);
        bad += !same_rows(out.data(), F.data() + pos * row, n, row, what + "chunk", pos);
        pos += n;
    }
    for (int64_t i = 0; i < L && bad < 3; ++i) {
        mha_runtime *rt = i % 2 ? r2 : r1;
        append(rt, c, s, 3, t, i, 1);
        std::vector<float> out(sz(row), test::kSentinel);
        REQUIRE(cached(rt, c, {3}, {0, 1}, s.H, true, t.q.data() + i * s.q_row(), out.data()) == MHA_OK);
        bad += !same_rows(out.data(), F.data() + i * row, 1, row, what + "decode step", i);
    }
    return bad;
}

// ---- The layer --------------------------------------------------------------------------------

struct LayerBox {
    mha_layer_config cfg{};
    std::vector<float> wq, wk, wv, wo, bq, bk, bv, bo;
    mha_layer *layer = nullptr;
    // cfg with num_kv_heads, head_dim and value_dim given; kdim = vdim = E unless given.
    LayerBox(mha_runtime *rt, const mha_layer_config &c, uint32_t seed) : cfg(c) {
        const int64_t E = c.embed_dim, kdim = c.kdim ? c.kdim : E, vdim = c.vdim ? c.vdim : E;
        const int64_t nq = c.num_heads * c.head_dim, nk = c.num_kv_heads * c.head_dim, nv = c.num_kv_heads * c.value_dim;
        auto w = [&](int64_t out, int64_t in, uint32_t s) {
            const float a = 1.0f / std::sqrt(static_cast<float>(in));
            return random_floats(sz(out * in), seed + s, -a, a);
        };
        wq = w(nq, E, 1);
        wk = w(nk, kdim, 2);
        wv = w(nv, vdim, 3);
        wo = w(E, c.num_heads * c.value_dim, 4);
        bq = random_floats(sz(nq), seed + 5, -0.5f, 0.5f);
        bk = random_floats(sz(nk), seed + 6, -0.5f, 0.5f);
        bv = random_floats(sz(nv), seed + 7, -0.5f, 0.5f);
        bo = random_floats(sz(E), seed + 8, -0.5f, 0.5f);
        mha_layer_weights lw{};
        lw.q_weight = wq.data();
        lw.k_weight = wk.data();
        lw.v_weight = wv.data();
        lw.out_weight = wo.data();
        lw.q_bias = bq.data();
        lw.k_bias = bk.data();
        lw.v_bias = bv.data();
        lw.out_bias = bo.data();
        const mha_status st = mha_layer_create(rt, &cfg, &lw, &layer);
        REQUIRE_MESSAGE(st == MHA_OK, mha_last_error());
    }
    ~LayerBox() { mha_layer_destroy(layer); }
    LayerBox(const LayerBox &) = delete;
    LayerBox &operator=(const LayerBox &) = delete;
    Shape cache_shape() const { return {cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.value_dim}; }

    // mha_layer_forward: causal self-attention over the first L rows of x, batch 1.
    std::vector<float> full(mha_runtime *rt, int64_t L, const float *x) const {
        mha_layer_forward_params p{};
        p.batch = 1;
        p.q_len = p.kv_len = L;
        p.causal = 1;
        std::vector<float> out(sz(L * cfg.embed_dim), test::kSentinel);
        const mha_status st = mha_layer_forward(rt, layer, &p, x, nullptr, nullptr, out.data());
        REQUIRE_MESSAGE(st == MHA_OK, mha_last_error());
        return out;
    }
    mha_status step(mha_runtime *rt, mha_kv_cache *c, const std::vector<int64_t> &ids, const std::vector<int64_t> &qo,
                    bool causal, const float *x, float *out) const {
        mha_layer_cached_params p{};
        p.num_seqs = static_cast<int64_t>(ids.size());
        p.seq_ids = ids.data();
        p.q_offsets = qo.data();
        p.causal = causal;
        return mha_layer_forward_cached(rt, layer, c, &p, x, out);
    }
};

inline mha_layer_config layer_cfg(int64_t E, int64_t H, int64_t Hkv, int64_t hd, int64_t vd, int64_t kdim = 0) {
    mha_layer_config c{};
    c.embed_dim = E;
    c.num_heads = H;
    c.num_kv_heads = Hkv;
    c.head_dim = hd;
    c.value_dim = vd;
    c.kdim = kdim;
    c.vdim = kdim;
    return c;
}

} // namespace serving_test
