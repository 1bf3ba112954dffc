// Serving, through the C ABI: ragged attention (mha_attention_varlen), the paged KV cache
// (mha_kv_cache_*), attention over it (mha_attention_cached) and the layer's incremental forward
// (mha_layer_forward_cached). Against the double reference, on every ISA the host has, with the
// default tiles and with tiny ones; then the bit-identity of a token however it is batched
// (issue 13, section 5), bad input that must leave everything as it was, and host threads that
// share one cache.
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

using namespace mha;
using test::random_floats;

namespace {

// ---- Runtimes: an ISA and a tile config, through the C ABI ------------------------------------

struct Setup {
    std::string name;
    Isa isa;
    std::optional<TileConfig> tiles;  // unset: the runtime's defaults
};

TileConfig default_tiles(Isa isa) { return default_tile_config(isa, detect_cache_sizes()); }
TileConfig tiles_of(const Setup &s) { return s.tiles ? *s.tiles : default_tiles(s.isa); }

// The microkernel's NR, from its name ("avx2_6x16" -> 16).
int64_t nr_of(const TileConfig &t) {
    const size_t x = t.gemm_ukernel.rfind('x');
    REQUIRE(x != std::string::npos);
    return std::stoll(t.gemm_ukernel.substr(x + 1));
}

Setup default_setup(Isa isa) { return {std::string(isa_name(isa)) + " default tiles", isa, std::nullopt}; }

Setup tiles_setup(Isa isa, int64_t block_q, int64_t block_k, int64_t kv_chunk) {
    TileConfig t = default_tiles(isa);
    t.attn_block_q = block_q;
    t.attn_block_k = block_k;
    t.attn_kv_chunk = kv_chunk;
    return {std::string(isa_name(isa)) + " tiles " + std::to_string(block_q) + "/" + std::to_string(block_k) + "/" +
                std::to_string(kv_chunk),
            isa, t};
}

// Without a cache: the defaults and tiny tiles that put edges everywhere (as test_attention).
std::vector<Setup> varlen_setups() {
    std::vector<Setup> v;
    for (Isa isa : supported_isas()) {
        v.push_back(default_setup(isa));
        v.push_back(tiles_setup(isa, 5, 7, 14));
    }
    return v;
}

// With a cache: block_tokens must divide attn_block_k and be a multiple of NR, so the small tiles
// keep attn_block_k = 64 (a multiple of every NR up to 64 ... 2 x 32, 4 x 16) with 2 key tiles per chunk.
std::vector<Setup> cache_setups() {
    std::vector<Setup> v;
    for (Isa isa : supported_isas()) {
        v.push_back(default_setup(isa));
        v.push_back(tiles_setup(isa, 5, 64, 128));
    }
    return v;
}

Setup best_default() { return default_setup(supported_isas().back()); }

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

size_t sz(int64_t n) { return static_cast<size_t>(n); }

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
mha_attention_variant g_variant{};
struct VariantScope {
    explicit VariantScope(const mha_attention_variant &v) { g_variant = v; }
    ~VariantScope() { g_variant = mha_attention_variant{}; }
};

// The double reference of one sequence (batch 1): q [Lq, H, D], k [Lk, Hkv, D], v [Lk, Hkv, Dv].
std::vector<double> reference(const Shape &s, int64_t Lq, int64_t Lk, bool causal, const float *q, const float *k,
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
bool close_to(const float *got, const std::vector<double> &want, const std::string &what) {
    int bad = 0;
    for (size_t i = 0; i < want.size(); ++i) {
        const bool ok = want[i] == 0.0 ? got[i] == 0.0f : std::fabs(got[i] - want[i]) <= 5e-5;
        if (!ok && bad++ < 3) FAIL_CHECK(what << ": [" << i << "] = " << got[i] << ", want " << want[i]);
    }
    if (bad) FAIL_CHECK(what << ": " << bad << " of " << want.size() << " values off the reference");
    return bad == 0;
}

// Rows [0, rows) of got and want, row_floats each, compared bit for bit (memcmp).
bool same_rows(const float *got, const float *want, int64_t rows, int64_t row_floats, const std::string &what,
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

bool contains_any(const std::string &msg, const std::vector<std::string> &needles) {
    if (needles.empty()) return true;
    for (const auto &n : needles)
        if (msg.find(n) != std::string::npos) return true;
    return false;
}

bool all_sentinel(const std::vector<float> &x, size_t from = 0) {
    for (size_t i = from; i < x.size(); ++i)
        if (std::memcmp(&x[i], &test::kSentinel, sizeof(float)) != 0) return false;
    return true;
}

// mha_attention on one sequence alone (batch 1, bottom-right causal as in every path).
std::vector<float> dense(mha_runtime *rt, const Shape &s, int64_t Lq, int64_t Lk, bool causal, const float *q,
                         const float *k, const float *v, float scale = 0) {
    mha_attention_params p{};
    p.batch = 1;
    p.q_len = Lq;
    p.kv_len = Lk;
    p.num_heads = s.H;
    p.num_kv_heads = s.Hkv;
    p.head_dim = s.D;
    p.value_dim = s.Dv;
    p.scale = scale;
    p.causal = causal;
    p.variant = g_variant;
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
        p.num_heads = s.H;
        p.num_kv_heads = s.Hkv;
        p.head_dim = s.D;
        p.value_dim = s.Dv;
        p.scale = scale;
        p.causal = causal;
        p.variant = g_variant;
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
int64_t capacity(int64_t bt, std::initializer_list<int64_t> lens) {
    int64_t t = 0;
    for (int64_t n : lens) t += (n + bt - 1) / bt * bt;
    return t;
}

const float kNone[1] = {0};  // a valid pointer for appends of 0 tokens

// The resolved block size the runtime picks for these dims.
int64_t block_tokens_for(mha_runtime *rt, const Shape &s, int64_t block_tokens = 0) {
    Cache probe(rt, s, 1, block_tokens);
    return probe.block_tokens();
}

void append(mha_runtime *rt, mha_kv_cache *c, const Shape &s, int64_t id, const SeqData &d, int64_t from, int64_t n) {
    const mha_status st = mha_kv_cache_append(rt, c, id, n, d.k.data() + from * s.k_row(), d.v.data() + from * s.v_row());
    REQUIRE_MESSAGE(st == MHA_OK, mha_last_error());
}

mha_status cached(mha_runtime *rt, mha_kv_cache *c, const std::vector<int64_t> &ids, const std::vector<int64_t> &qo,
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
std::vector<int64_t> chunks_of(int64_t L, std::initializer_list<int64_t> sizes) {
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
int64_t chunks_then_steps(mha_runtime *r1, mha_runtime *r2, mha_kv_cache *c, const Shape &s, const SeqData &t,
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

} // namespace

// ================================================================================================
// 1. Ragged attention against the double reference
// ================================================================================================

namespace {

// (queries, keys) per sequence: no queries, queries and no keys, length 1, Lq < Lk, Lq > Lk
// (causal rows that see nothing), no keys and no queries, and one past a default key tile.
const std::pair<int64_t, int64_t> kRagged[] = {{3, 11}, {0, 5},   {4, 0},   {1, 1},     {1, 17}, {9, 9},
                                               {0, 0},  {13, 30}, {20, 20}, {6, 3},     {17, 270}, {2, 40}};

struct VarlenCase {
    const char *what;
    Shape s;
    bool causal;
    float scale;
};

const VarlenCase kVarlenCases[] = {
    {"MHA", {4, 4, 16, 16}, false, 0},
    {"MHA causal", {4, 4, 16, 16}, true, 0},
    {"GQA 8/2 causal", {8, 2, 32, 32}, true, 0},
    {"GQA 8/2, scale 0.3", {8, 2, 32, 32}, false, 0.3f},
    {"MQA, Dv != Dqk", {4, 1, 16, 24}, false, 0},
    {"MQA causal, Dv < Dqk", {4, 1, 24, 8}, true, 0},
    {"odd head dims 13/7", {2, 1, 13, 7}, false, 0},
    {"odd head dims 13/7, GQA 6/3, causal", {6, 3, 13, 7}, true, 0},
    {"head dims past a register tile", {2, 2, 65, 33}, true, 0},
};

} // namespace

TEST_CASE("varlen: ragged batches against the double reference, every ISA, default and tiny tiles, 1 and 2 threads") {
    for (const Setup &su : varlen_setups()) {
        Rt r1(1, su), r2(2, su);
        for (const VarlenCase &vc : kVarlenCases) {
            CAPTURE(su.name);
            CAPTURE(vc.what);
            const Shape &s = vc.s;
            Ragged rg(s);
            std::vector<SeqData> seqs;
            uint32_t seed = 100;
            for (auto [nq, nk] : kRagged) {
                seqs.emplace_back(s, nq, nk, seed += 3);
                rg.add(seqs.back());
            }
            const size_t n = sz(rg.total_q() * s.o_row()), pad = 37;
            std::vector<float> out(n + pad, test::kSentinel);
            rg.run(r1, vc.causal, out.data(), vc.scale);
            CHECK_MESSAGE(all_sentinel(out, n), "written past total_q rows");
            for (size_t i = 0; i < seqs.size(); ++i) {
                const SeqData &d = seqs[i];
                const float *got = out.data() + rg.qo[i] * s.o_row();
                const std::string what = "sequence " + std::to_string(i) + " (" + std::to_string(d.Lq) + " queries, " +
                                         std::to_string(d.Lk) + " keys)";
                close_to(got, reference(s, d.Lq, d.Lk, vc.causal, d.q.data(), d.k.data(), d.v.data(), vc.scale), what);
                if (d.Lq > 0 && d.Lk == 0)
                    for (int64_t j = 0; j < d.Lq * s.o_row(); ++j) REQUIRE(got[j] == 0.0f);
                // The same bits as mha_attention on the sequence alone.
                if (d.Lq > 0 && d.Lk > 0)
                    same_rows(got, dense(r2, s, d.Lq, d.Lk, vc.causal, d.q.data(), d.k.data(), d.v.data(), vc.scale).data(),
                              d.Lq, s.o_row(), what + " vs mha_attention alone");
            }
            std::vector<float> out2(n + pad, test::kSentinel);
            rg.run(r2, vc.causal, out2.data(), vc.scale);
            CHECK(all_sentinel(out2, n));
            same_rows(out2.data(), out.data(), rg.total_q(), s.o_row(), "2 threads vs 1 thread");
        }
    }
}

TEST_CASE("varlen: nothing to do (no sequences, or none with queries) writes nothing") {
    Rt rt(2, best_default());
    const Shape s{4, 2, 8, 8};
    Ragged rg(s);
    std::vector<float> out(64, test::kSentinel);
    rg.run(rt, true, out.data());  // num_seqs = 0
    CHECK(all_sentinel(out));
    for (int64_t nk : {0, 5, 300}) rg.add(SeqData(s, 0, nk, 9));
    rg.run(rt, true, out.data());
    rg.run(rt, false, out.data());
    CHECK(all_sentinel(out));
}

// ================================================================================================
// 2. The paged cache
// ================================================================================================

TEST_CASE("kv cache: append in pieces, read back bitwise, seq_len, free_tokens by whole blocks, release and reuse") {
    for (const Setup &su : cache_setups())
        for (const Shape s : {Shape{4, 2, 13, 7}, Shape{4, 2, 32, 16}}) {
            CAPTURE(su.name);
            CAPTURE(s.D);
            Rt rt(1, su);
            const TileConfig t = tiles_of(su);
            const int64_t nr = nr_of(t);
            std::vector<int64_t> block_choices = {0};
            if (t.attn_block_k % nr == 0 && nr != t.attn_block_k) block_choices.push_back(nr);
            for (int64_t want_bt : block_choices) {
                CAPTURE(want_bt);
                const int64_t bt = block_tokens_for(rt, s, want_bt);
                REQUIRE(bt > 0);
                if (want_bt) CHECK(bt == want_bt);
                CHECK(t.attn_block_k % bt == 0);
                CHECK((bt % nr == 0 || bt == t.attn_block_k));
                const int64_t nblocks = 6;
                Cache c(rt, s, nblocks * bt - 3, want_bt);  // rounded up to 6 blocks
                const mha_kv_cache_config cfg = c.config();
                CHECK(cfg.num_kv_heads == s.Hkv);
                CHECK(cfg.head_dim == s.D);
                CHECK(cfg.value_dim == s.Dv);
                CHECK(cfg.block_tokens == bt);
                CHECK(cfg.dtype == MHA_F32);
                CHECK(c.free_tokens() == nblocks * bt);
                uint64_t bytes = 0;
                REQUIRE(mha_kv_cache_bytes(c, &bytes) == MHA_OK);
                CHECK(bytes >= static_cast<uint64_t>(nblocks * bt * (s.k_row() + s.v_row())) * 4);
                CHECK(c.seq_len(42) == -1);

                auto blocks = [&](int64_t len) { return (len + bt - 1) / bt; };
                const SeqData a(s, 4 * bt, 7), b(s, 2 * bt, 8);
                std::vector<float> k, v;
                int64_t len_a = 0, len_b = 0;
                auto check_a = [&](const char *when) {
                    CAPTURE(when);
                    CHECK(c.seq_len(42) == len_a);
                    c.read(42, 0, len_a, s, k, v);
                    CHECK(std::memcmp(k.data(), a.k.data(), sz(len_a * s.k_row()) * 4) == 0);
                    CHECK(std::memcmp(v.data(), a.v.data(), sz(len_a * s.v_row()) * 4) == 0);
                };
                // Pieces that end mid-block, on a block edge, and cross one; an empty one.
                for (int64_t n : {int64_t{1}, bt - 1, bt + 3, int64_t{0}, int64_t{2}, int64_t{5}}) {
                    append(rt, c, s, 42, a, len_a, n);
                    len_a += n;
                    check_a("after a piece");
                    if (len_b < bt / 2 + 1) {  // a second sequence growing beside it
                        append(rt, c, s, 7, b, len_b, bt / 2 + 1);
                        len_b += bt / 2 + 1;
                    }
                    CHECK(c.free_tokens() == (nblocks - blocks(len_a) - blocks(len_b)) * bt);
                }
                // A window, and k or v alone.
                const int64_t st = 3, n = len_a - 5;
                c.read(42, st, n, s, k, v);
                CHECK(std::memcmp(k.data(), a.k.data() + st * s.k_row(), sz(n * s.k_row()) * 4) == 0);
                CHECK(std::memcmp(v.data(), a.v.data() + st * s.v_row(), sz(n * s.v_row()) * 4) == 0);
                std::vector<float> konly(sz(n * s.k_row()), test::kSentinel), vonly(sz(n * s.v_row()), test::kSentinel);
                REQUIRE(mha_kv_cache_read(c, 42, st, n, konly.data(), nullptr) == MHA_OK);
                REQUIRE(mha_kv_cache_read(c, 42, st, n, nullptr, vonly.data()) == MHA_OK);
                CHECK(test::same_bits(konly, k));
                CHECK(test::same_bits(vonly, v));
                c.read(7, 0, len_b, s, k, v);
                CHECK(std::memcmp(k.data(), b.k.data(), sz(len_b * s.k_row()) * 4) == 0);
                CHECK(std::memcmp(v.data(), b.v.data(), sz(len_b * s.v_row()) * 4) == 0);

                // Release gives the blocks back; the id is gone.
                REQUIRE(mha_kv_cache_release(c, 42) == MHA_OK);
                CHECK(c.seq_len(42) == -1);
                CHECK(c.free_tokens() == (nblocks - blocks(len_b)) * bt);
                // A new sequence takes every free block (its data must not leak the old blocks'),
                // then the cache is full.
                const int64_t room = c.free_tokens();
                const SeqData r(s, room + bt, 9);
                append(rt, c, s, 1000, r, 0, room / 2 + 1);
                append(rt, c, s, 1000, r, room / 2 + 1, room - (room / 2 + 1));
                CHECK(c.free_tokens() == 0);
                c.read(1000, 0, room, s, k, v);
                CHECK(std::memcmp(k.data(), r.k.data(), sz(room * s.k_row()) * 4) == 0);
                CHECK(std::memcmp(v.data(), r.v.data(), sz(room * s.v_row()) * 4) == 0);
                CHECK(mha_kv_cache_append(rt, c, 1000, 1, r.k.data(), r.v.data()) == MHA_OUT_OF_MEMORY);
                CHECK(c.seq_len(1000) == room);
                // Attention over the reused blocks: the last 3 queries against the reference.
                const int64_t H = s.H;
                std::vector<float> out(sz(3 * s.o_row()), test::kSentinel);
                REQUIRE(cached(rt, c, {1000}, {0, 3}, H, true, r.q.data() + (room - 3) * s.q_row(), out.data()) == MHA_OK);
                close_to(out.data(), reference(s, 3, room, true, r.q.data() + (room - 3) * s.q_row(), r.k.data(), r.v.data()),
                         "attention over reused blocks");
                // Release the other: its block serves the full sequence's next append.
                REQUIRE(mha_kv_cache_release(c, 7) == MHA_OK);
                CHECK(c.free_tokens() == blocks(len_b) * bt);
                append(rt, c, s, 1000, r, room, 1);
                CHECK(c.seq_len(1000) == room + 1);
                CHECK(c.free_tokens() == (blocks(len_b) - 1) * bt);
                c.read(1000, room - 2, 3, s, k, v);
                CHECK(std::memcmp(k.data(), r.k.data() + (room - 2) * s.k_row(), sz(3 * s.k_row()) * 4) == 0);
                CHECK(std::memcmp(v.data(), r.v.data() + (room - 2) * s.v_row(), sz(3 * s.v_row()) * 4) == 0);
                REQUIRE(mha_kv_cache_release(c, 1000) == MHA_OK);
                CHECK(c.free_tokens() == nblocks * bt);
                // A released id starts over.
                append(rt, c, s, 7, a, 0, 2);
                CHECK(c.seq_len(7) == 2);
                c.read(7, 0, 2, s, k, v);
                CHECK(std::memcmp(k.data(), a.k.data(), sz(2 * s.k_row()) * 4) == 0);
                CHECK(std::memcmp(v.data(), a.v.data(), sz(2 * s.v_row()) * 4) == 0);
                // An empty append starts an empty sequence.
                REQUIRE(mha_kv_cache_append(rt, c, 5, 0, kNone, kNone) == MHA_OK);
                CHECK(c.seq_len(5) == 0);
                REQUIRE(mha_kv_cache_release(c, 7) == MHA_OK);
                REQUIRE(mha_kv_cache_release(c, 5) == MHA_OK);
                CHECK(c.free_tokens() == nblocks * bt);
            }
        }
}

TEST_CASE("kv cache: fork in the middle of a block, then diverge: copy-on-write keeps both right") {
    for (const Setup &su : cache_setups()) {
        CAPTURE(su.name);
        Rt rt(1, su);
        const Shape s{4, 2, 16, 8};
        const int64_t bt = block_tokens_for(rt, s), nblocks = 8;
        Cache c(rt, s, nblocks * bt);
        std::vector<float> k, v;
        auto expect_seq = [&](int64_t id, const std::vector<const SeqData *> &parts, const std::vector<int64_t> &lens,
                              const char *what) {
            CAPTURE(what);
            CAPTURE(id);
            int64_t len = 0;
            for (int64_t n : lens) len += n;
            REQUIRE(c.seq_len(id) == len);
            c.read(id, 0, len, s, k, v);
            int64_t pos = 0;
            for (size_t i = 0; i < parts.size(); ++i) {
                CHECK(std::memcmp(k.data() + pos * s.k_row(), parts[i]->k.data(), sz(lens[i] * s.k_row()) * 4) == 0);
                CHECK(std::memcmp(v.data() + pos * s.v_row(), parts[i]->v.data(), sz(lens[i] * s.v_row()) * 4) == 0);
                pos += lens[i];
            }
        };
        // Source: one full block and part of a second.
        const int64_t P = bt + bt / 2 + 1, nA = 3, nB = bt + 2;
        const SeqData pre(s, P, 1), da(s, nA, 2), db(s, nB, 3);
        append(rt, c, s, 1, pre, 0, P);
        CHECK(c.free_tokens() == (nblocks - 2) * bt);
        REQUIRE(mha_kv_cache_fork(c, 1, 2) == MHA_OK);
        CHECK(c.free_tokens() == (nblocks - 2) * bt);  // shared, nothing copied
        expect_seq(2, {&pre}, {P}, "the fork reads as its source");
        // Diverge: 1's append lands in the shared partial block (a copy), 2's then owns the
        // original alone (no copy) and crosses into a new block.
        append(rt, c, s, 1, da, 0, nA);
        append(rt, c, s, 2, db, 0, nB);
        expect_seq(1, {&pre, &da}, {P, nA}, "source after diverging");
        expect_seq(2, {&pre, &db}, {P, nB}, "fork after diverging");
        CHECK(c.free_tokens() == (nblocks - 4) * bt);
        // Attention over each matches the reference and mha_attention on its dense K/V, bit for bit.
        for (int which = 0; which < 2; ++which) {
            const int64_t id = which == 0 ? 1 : 2, L = which == 0 ? P + nA : P + nB;
            CAPTURE(id);
            c.read(id, 0, L, s, k, v);
            const auto q = random_floats(sz(L * s.q_row()), 40 + static_cast<uint32_t>(which));
            std::vector<float> out(sz(L * s.o_row()), test::kSentinel);
            REQUIRE(cached(rt, c, {id}, {0, L}, s.H, true, q.data(), out.data()) == MHA_OK);
            close_to(out.data(), reference(s, L, L, true, q.data(), k.data(), v.data()), "attention over a forked sequence");
            same_rows(out.data(), dense(rt, s, L, L, true, q.data(), k.data(), v.data()).data(), L, s.o_row(),
                      "forked sequence vs mha_attention");
        }
        // The source goes; the fork keeps the shared block.
        REQUIRE(mha_kv_cache_release(c, 1) == MHA_OK);
        CHECK(c.free_tokens() == (nblocks - 3) * bt);
        expect_seq(2, {&pre, &db}, {P, nB}, "fork after its source is released");
        REQUIRE(mha_kv_cache_release(c, 2) == MHA_OK);
        CHECK(c.free_tokens() == nblocks * bt);

        // Fork on a block edge: appends to either need a new block, none a copy. A fork of a
        // fork outlives both.
        const SeqData two(s, 2 * bt, 4), one(s, 1, 5), other(s, 1, 6);
        append(rt, c, s, 3, two, 0, 2 * bt);
        REQUIRE(mha_kv_cache_fork(c, 3, 4) == MHA_OK);
        append(rt, c, s, 3, one, 0, 1);
        append(rt, c, s, 4, other, 0, 1);
        CHECK(c.free_tokens() == (nblocks - 4) * bt);
        expect_seq(3, {&two, &one}, {2 * bt, 1}, "edge fork, source");
        expect_seq(4, {&two, &other}, {2 * bt, 1}, "edge fork, fork");
        REQUIRE(mha_kv_cache_fork(c, 4, 5) == MHA_OK);
        REQUIRE(mha_kv_cache_release(c, 3) == MHA_OK);
        REQUIRE(mha_kv_cache_release(c, 4) == MHA_OK);
        expect_seq(5, {&two, &other}, {2 * bt, 1}, "fork of a fork");
        CHECK(c.free_tokens() == (nblocks - 3) * bt);
        // An empty sequence forks too.
        REQUIRE(mha_kv_cache_append(rt, c, 6, 0, kNone, kNone) == MHA_OK);
        REQUIRE(mha_kv_cache_fork(c, 6, 7) == MHA_OK);
        CHECK(c.seq_len(7) == 0);
        append(rt, c, s, 7, one, 0, 1);
        CHECK(c.seq_len(6) == 0);
        CHECK(c.seq_len(7) == 1);
        for (int64_t id : {5, 6, 7}) REQUIRE(mha_kv_cache_release(c, id) == MHA_OK);
        CHECK(c.free_tokens() == nblocks * bt);
    }
}

TEST_CASE("kv cache: bytes within 2% of max_tokens x one token's K and V (H8 D128), and bf16 is unsupported") {
    Rt rt(1, best_default());
    for (const Shape s : {Shape{8, 8, 128, 128}, Shape{32, 8, 128, 128}, Shape{8, 2, 128, 64}}) {
        CAPTURE(s.Hkv);
        CAPTURE(s.Dv);
        const int64_t bt = block_tokens_for(rt, s), max_tokens = bt * std::max<int64_t>(4, 2048 / bt);
        Cache c(rt, s, max_tokens);
        uint64_t bytes = 0;
        REQUIRE(mha_kv_cache_bytes(c, &bytes) == MHA_OK);
        const double want = static_cast<double>(max_tokens) * static_cast<double>(s.Hkv * (s.D + s.Dv)) * 4.0;
        CHECK_MESSAGE(std::fabs(static_cast<double>(bytes) - want) <= 0.02 * want, bytes << " bytes, want " << want);
        CHECK(c.free_tokens() == max_tokens);
    }
    mha_kv_cache_config cfg{};
    cfg.num_kv_heads = 2;
    cfg.head_dim = 64;
    cfg.value_dim = 64;
    cfg.max_tokens = 1024;
    cfg.dtype = MHA_BF16;
    mha_kv_cache *c = nullptr;
    CHECK(mha_kv_cache_create(rt, &cfg, &c) == MHA_UNSUPPORTED);
    CHECK(c == nullptr);
    const std::string msg = mha_last_error();
    CHECK_MESSAGE(contains_any(msg, {"bf16", "BF16", "dtype"}), msg);
    mha_kv_cache_destroy(c);
    mha_kv_cache_destroy(nullptr);
}

// ================================================================================================
// 3. Attention over the cache against the dense reference
// ================================================================================================

TEST_CASE("attention_cached: chunked prefill and decode against the dense causal reference, and non-causal") {
    for (const Setup &su : cache_setups())
        for (const Shape s : {Shape{8, 2, 32, 32}, Shape{4, 1, 16, 24}, Shape{2, 1, 13, 7}})
            for (int blocks : {0, 1, 2}) {
                if (test::reduced() && s.H != 8) continue;  // tools/tsan: the GQA shape only (1 thread)
                CAPTURE(su.name);
                CAPTURE(s.H);
                CAPTURE(s.Hkv);
                CAPTURE(s.D);
                CAPTURE(s.Dv);
                Rt rt(1, su);
                const TileConfig t = tiles_of(su);
                // block_tokens: the runtime's choice, NR (several blocks per key tile), and, if the runtime
                // takes it (mha.h says block_tokens must divide attn_block_k; the implementation also
                // accepts multiples of it), two key tiles per block.
                int64_t bt = 0;
                if (blocks == 1) {
                    bt = nr_of(t);
                    if (t.attn_block_k % bt != 0 || bt == block_tokens_for(rt, s)) continue;
                } else if (blocks == 2) {
                    mha_kv_cache_config cfg{s.Hkv, s.D, s.Dv, 2 * t.attn_block_k, 1, MHA_F32, 0};
                    mha_kv_cache *probe = nullptr;
                    const mha_status st = mha_kv_cache_create(rt, &cfg, &probe);
                    mha_kv_cache_destroy(probe);
                    if (st != MHA_OK) continue;
                    bt = 2 * t.attn_block_k;
                }
                CAPTURE(bt);
                const int64_t L = 300;  // past a default key tile, and 4 small ones (2 chunks)
                const SeqData d(s, L, 77);
                const auto want = reference(s, L, L, true, d.q.data(), d.k.data(), d.v.data());
                const auto F = dense(rt, s, L, L, true, d.q.data(), d.k.data(), d.v.data());
                Cache c(rt, s, L, bt);
                int64_t pos = 0;
                std::vector<int64_t> steps = {37, 1, 100, 2, 60};
                for (int64_t i = 200; i < L; ++i) steps.push_back(1);  // then decode one token at a time to L
                for (int64_t n : steps) {
                    CAPTURE(pos);
                    CAPTURE(n);
                    append(rt, c, s, 9, d, pos, n);
                    const float *q = d.q.data() + pos * s.q_row();
                    std::vector<float> out(sz(n * s.o_row()) + 5, test::kSentinel);
                    REQUIRE_MESSAGE(cached(rt, c, {9}, {0, n}, s.H, true, q, out.data()) == MHA_OK, mha_last_error());
                    CHECK(all_sentinel(out, sz(n * s.o_row())));
                    bool ok = close_to(out.data(), std::vector<double>(want.begin() + pos * s.o_row(), want.begin() + (pos + n) * s.o_row()),
                                       "causal chunk");
                    ok &= same_rows(out.data(), F.data() + pos * s.o_row(), n, s.o_row(), "causal chunk vs mha_attention", pos);
                    // Non-causal: each of the chunk's queries sees every cached position.
                    std::fill(out.begin(), out.end(), test::kSentinel);
                    REQUIRE(cached(rt, c, {9}, {0, n}, s.H, false, q, out.data()) == MHA_OK);
                    ok &= close_to(out.data(), reference(s, n, pos + n, false, q, d.k.data(), d.v.data()), "non-causal chunk");
                    pos += n;
                    if (!ok) break;
                }
                CHECK(pos == L);
                CHECK(c.free_tokens() == 0);
            }
}

TEST_CASE("attention_cached: one call serves prefill chunks and decode steps of different sequences (GQA)") {
    for (const Setup &su : cache_setups())
        for (const Shape s : {Shape{8, 2, 16, 16}, Shape{6, 3, 13, 7}}) {
            CAPTURE(su.name);
            CAPTURE(s.D);
            Rt rt(2, su);
            // id, cached before the step, new tokens in the step (then one more decode step each).
            struct S {
                int64_t id, before, now;
            };
            const std::vector<S> seqs = {{11, 50, 40}, {3, 59, 1}, {500, 0, 1}, {8, 28, 12}, {77, 10, 0}, {9, 0, 270}, {4, 1, 1}};
            std::vector<SeqData> data;
            const int64_t bt = block_tokens_for(rt, s);
            int64_t cap = 0;
            for (const S &x : seqs) cap += capacity(bt, {x.before + x.now + 1});
            Cache c(rt, s, cap);
            for (size_t i = 0; i < seqs.size(); ++i) {
                data.emplace_back(s, seqs[i].before + seqs[i].now + 1, 300 + 5 * static_cast<uint32_t>(i));
                if (seqs[i].before) append(rt, c, s, seqs[i].id, data[i], 0, seqs[i].before);
            }
            for (int step = 0; step < 2; ++step)
                for (bool causal : {true, false}) {
                    CAPTURE(step);
                    CAPTURE(causal);
                    std::vector<int64_t> ids, qo = {0};
                    std::vector<float> q;
                    for (size_t i = 0; i < seqs.size(); ++i) {
                        const int64_t start = step == 0 ? seqs[i].before : seqs[i].before + seqs[i].now,
                                      n = step == 0 ? seqs[i].now : 1;
                        if (causal && n)  // append once per step (before the causal run)
                            append(rt, c, s, seqs[i].id, data[i], start, n);
                        else if (causal && c.seq_len(seqs[i].id) < 0)
                            REQUIRE(mha_kv_cache_append(rt, c, seqs[i].id, 0, kNone, kNone) == MHA_OK);
                        ids.push_back(seqs[i].id);
                        qo.push_back(qo.back() + n);
                        q.insert(q.end(), data[i].q.begin() + start * s.q_row(), data[i].q.begin() + (start + n) * s.q_row());
                    }
                    std::vector<float> out(sz(qo.back() * s.o_row()) + 3, test::kSentinel);
                    REQUIRE_MESSAGE(cached(rt, c, ids, qo, s.H, causal, q.data(), out.data()) == MHA_OK, mha_last_error());
                    CHECK(all_sentinel(out, sz(qo.back() * s.o_row())));
                    for (size_t i = 0; i < seqs.size(); ++i) {
                        const int64_t n = qo[i + 1] - qo[i], len = c.seq_len(seqs[i].id);
                        CAPTURE(seqs[i].id);
                        close_to(out.data() + qo[i] * s.o_row(),
                                 reference(s, n, len, causal, q.data() + qo[i] * s.q_row(), data[i].k.data(), data[i].v.data()),
                                 "sequence in a continuous batch");
                    }
                }
        }
}

// ================================================================================================
// 4. The same bits however a token is batched
// ================================================================================================

namespace {

struct InvCase {
    const char *what;
    Shape s;
    int64_t L;
    bool small_tiles;
};

// L = 1100 crosses 4 default key tiles and a 1024-key chunk, L = 2100 two chunks; L = 300 crosses 4
// small tiles and 2 chunks.
const InvCase kInvCases[] = {
    {"default tiles, L 1100", {4, 2, 32, 32}, 1100, false},
    {"default tiles, GQA 8/2 D64, L 2100 (two chunks)", {8, 2, 64, 64}, 2100, false},
    {"default tiles, odd dims 13/7, L 600", {6, 3, 13, 7}, 600, false},
    {"tiles 5/64/128, L 300", {4, 2, 32, 32}, 300, true},
    {"tiles 5/64/128, MQA odd dims, L 150", {4, 1, 13, 7}, 150, true},
};

} // namespace

TEST_CASE("bit-identity: mha_attention alone = varlen beside others = cached prefill, chunks, decode; 1 and 2 threads") {
    for (Isa isa : supported_isas())
        for (const InvCase &ic : kInvCases) {
            // Reduced (tools/tsan): not L 2100, most of the time; L 1100 still crosses a chunk with
            // default tiles, and L 300 two with small ones.
            if (test::reduced() && ic.L > 1100) continue;
            const Setup su = ic.small_tiles ? tiles_setup(isa, 5, 64, 128) : default_setup(isa);
            CAPTURE(su.name);
            CAPTURE(ic.what);
            const Shape &s = ic.s;
            const int64_t L = ic.L, row = s.o_row();
            Rt r1(1, su), r2(2, su);
            const SeqData t(s, L, 1000);
            const auto F = dense(r1, s, L, L, true, t.q.data(), t.k.data(), t.v.data());
            same_rows(dense(r2, s, L, L, true, t.q.data(), t.k.data(), t.v.data()).data(), F.data(), L, row,
                      "mha_attention on 2 threads");
            // Sanity against the reference: the first 40 rows and the last 24 (which see every key).
            close_to(F.data(), reference(s, 40, 40, true, t.q.data(), t.k.data(), t.v.data()), "first rows vs reference");
            close_to(F.data() + (L - 24) * row, reference(s, 24, L, true, t.q.data() + (L - 24) * s.q_row(), t.k.data(), t.v.data()),
                     "last rows vs reference");

            // Varlen with other sequences before and after it.
            {
                const SeqData a(s, 37, 1001), b(s, 3, 300, 1002), e(s, 0, 9, 1003), f(s, L / 2 + 5, 1004), g(s, 4, 0, 1005);
                {
                    Ragged rg(s);
                    for (const SeqData *d : {&a, &t, &b, &e, &f, &g}) rg.add(*d);
                    std::vector<float> out(sz(rg.total_q() * row), test::kSentinel);
                    rg.run(r2, true, out.data());
                    same_rows(out.data() + rg.qo[1] * row, F.data(), L, row, "varlen, second of six, 2 threads");
                    same_rows(out.data(), dense(r1, s, 37, 37, true, a.q.data(), a.k.data(), a.v.data()).data(), 37, row,
                              "varlen, a neighbour vs alone");
                    same_rows(out.data() + rg.qo[2] * row, dense(r1, s, 3, 300, true, b.q.data(), b.k.data(), b.v.data()).data(), 3,
                              row, "varlen, a neighbour with Lq < Lk vs alone");
                }
                {
                    Ragged rg(s);
                    for (const SeqData *d : {&t, &f, &b}) rg.add(*d);
                    std::vector<float> out(sz(rg.total_q() * row), test::kSentinel);
                    rg.run(r1, true, out.data());
                    same_rows(out.data(), F.data(), L, row, "varlen, first of three, 1 thread");
                }
                {
                    Ragged rg(s);
                    rg.add(t);
                    std::vector<float> out(sz(L * row), test::kSentinel);
                    rg.run(r2, true, out.data());
                    same_rows(out.data(), F.data(), L, row, "varlen, alone");
                }
            }

            // Through the cache: one prefill, two chunkings (one beside a decoding neighbour), decode
            // one token at a time.
            {
                const int64_t bt = block_tokens_for(r1, s);
                Cache c(r1, s, capacity(bt, {L, L, L, L, L}));
                // One call.
                append(r1, c, s, 1, t, 0, L);
                {
                    std::vector<float> out(sz(L * row), test::kSentinel);
                    REQUIRE_MESSAGE(cached(r1, c, {1}, {0, L}, s.H, true, t.q.data(), out.data()) == MHA_OK, mha_last_error());
                    same_rows(out.data(), F.data(), L, row, "cached prefill in one call");
                    std::vector<float> k, v;
                    c.read(1, 0, L, s, k, v);
                    CHECK(test::same_bits(k, t.k));
                    CHECK(test::same_bits(v, t.v));
                    // Non-causal over the whole cache: the last 5 queries = mha_attention without the mask.
                    std::vector<float> nc(sz(5 * row), test::kSentinel);
                    const float *q5 = t.q.data() + (L - 5) * s.q_row();
                    REQUIRE(cached(r2, c, {1}, {0, 5}, s.H, false, q5, nc.data()) == MHA_OK);
                    same_rows(nc.data(), dense(r1, s, 5, L, false, q5, t.k.data(), t.v.data()).data(), 5, row,
                              "cached non-causal vs mha_attention non-causal");
                }
                // Chunks 1, 7, 64, 100, rest on 2 threads, each call beside a neighbour's decode step.
                const auto chunks_a = chunks_of(L, {1, 7, 64, 100});
                const int64_t nb0 = 10, nbL = nb0 + static_cast<int64_t>(chunks_a.size());
                const SeqData nb(s, nbL, 1010);
                const auto Fnb = dense(r1, s, nbL, nbL, true, nb.q.data(), nb.k.data(), nb.v.data());
                append(r1, c, s, 3, nb, 0, nb0);
                int64_t pos = 0, npos = nb0, bad = 0;
                for (int64_t n : chunks_a) {
                    append(r2, c, s, 2, t, pos, n);
                    append(r2, c, s, 3, nb, npos, 1);
                    std::vector<float> q(nb.q.begin() + npos * s.q_row(), nb.q.begin() + (npos + 1) * s.q_row());
                    q.insert(q.end(), t.q.begin() + pos * s.q_row(), t.q.begin() + (pos + n) * s.q_row());
                    std::vector<float> out(sz((n + 1) * row), test::kSentinel);
                    REQUIRE_MESSAGE(cached(r2, c, {3, 2}, {0, 1, 1 + n}, s.H, true, q.data(), out.data()) == MHA_OK,
                                    mha_last_error());
                    bad += !same_rows(out.data() + row, F.data() + pos * row, n, row, "chunk beside a neighbour", pos);
                    bad += !same_rows(out.data(), Fnb.data() + npos * row, 1, row, "the neighbour's decode step", npos);
                    pos += n;
                    ++npos;
                }
                CHECK(bad == 0);
                // Other chunk sizes, alone, on 1 thread.
                pos = 0;
                for (int64_t n : chunks_of(L, {100, 64, 7, 1, 1, 33})) {
                    append(r1, c, s, 4, t, pos, n);
                    std::vector<float> out(sz(n * row), test::kSentinel);
                    REQUIRE(cached(r1, c, {4}, {0, n}, s.H, true, t.q.data() + pos * s.q_row(), out.data()) == MHA_OK);
                    bad += !same_rows(out.data(), F.data() + pos * row, n, row, "chunk alone", pos);
                    pos += n;
                }
                CHECK(bad == 0);
                // Decode every token, one per call, alternating 1 and 2 threads.
                for (int64_t i = 0; i < L && bad < 3; ++i) {
                    mha_runtime *rt = i % 2 ? static_cast<mha_runtime *>(r2) : static_cast<mha_runtime *>(r1);
                    append(rt, c, s, 5, t, i, 1);
                    std::vector<float> out(sz(row), test::kSentinel);
                    REQUIRE(cached(rt, c, {5}, {0, 1}, s.H, true, t.q.data() + i * s.q_row(), out.data()) == MHA_OK);
                    bad += !same_rows(out.data(), F.data() + i * row, 1, row, "decode step", i);
                }
                CHECK(bad == 0);
                CHECK(c.seq_len(5) == L);
            }
        }
}

TEST_CASE("in place (out == q) through varlen and the cache (f32 and int8): the bits of a separate out; refused where Dv != Dqk") {
    const Shape s{8, 2, 32, 32};
    const int64_t row = s.o_row();
    for (const Setup &su : cache_setups())
        for (int threads : {1, 2}) {
            CAPTURE(su.name);
            CAPTURE(threads);
            Rt rt(threads, su);
            // Varlen: a long sequence (several key tiles and chunks), a few rows over many keys (the
            // direct path), one with queries and no keys, and a short one.
            {
                const SeqData a(s, 300, 1101), b(s, 3, 300, 1102), e(s, 4, 0, 1103), f(s, 37, 1104);
                Ragged rg(s);
                for (const SeqData *d : {&a, &b, &e, &f}) rg.add(*d);
                std::vector<float> want(sz(rg.total_q() * row), test::kSentinel);
                rg.run(rt, true, want.data());
                Ragged in_place = rg;
                in_place.run(rt, true, in_place.q.data());
                CHECK(test::same_bits(in_place.q, want));
            }
            // The cache: a prefill chunk beside another sequence's decode step, f32 and int8.
            for (mha_dtype dtype : {MHA_F32, MHA_I8}) {
                CAPTURE(static_cast<int>(dtype));
                const int64_t bt = block_tokens_for(rt, s);
                Cache c(rt, s, capacity(bt, {300, 60}), 0, dtype);
                const SeqData t(s, 300, 1110), nb(s, 60, 1111);
                append(rt, c, s, 1, t, 0, 300);
                append(rt, c, s, 2, nb, 0, 60);
                std::vector<float> q(nb.q.end() - s.q_row(), nb.q.end());  // the neighbour's last token, then 200 of t's
                q.insert(q.end(), t.q.end() - 200 * s.q_row(), t.q.end());
                std::vector<float> want(sz(201 * row), test::kSentinel);
                REQUIRE_MESSAGE(cached(rt, c, {2, 1}, {0, 1, 201}, s.H, true, q.data(), want.data()) == MHA_OK, mha_last_error());
                REQUIRE_MESSAGE(cached(rt, c, {2, 1}, {0, 1, 201}, s.H, true, q.data(), q.data()) == MHA_OK, mha_last_error());
                CHECK(test::same_bits(q, want));
            }
        }
    // Dv != Dqk: a head's output would cover another head's query; refused, nothing written.
    Rt rt(1, best_default());
    const Shape w{2, 1, 8, 4};
    const SeqData d(w, 5, 1120);
    Ragged rg(w);
    rg.add(d);
    const mha_varlen_params p = rg.params(false);
    std::vector<float> x = rg.q;
    CHECK(mha_attention_varlen(rt, &p, x.data(), rg.k.data(), rg.v.data(), x.data()) == MHA_INVALID_ARGUMENT);
    CHECK(std::string(mha_last_error()).find("in-place attention (out == q) needs value_dim == head_dim") != std::string::npos);
    CHECK(test::same_bits(x, rg.q));
    Cache c(rt, w, capacity(block_tokens_for(rt, w), {5}));
    append(rt, c, w, 1, d, 0, 5);
    CHECK(cached(rt, c, {1}, {0, 5}, w.H, true, x.data(), x.data()) == MHA_INVALID_ARGUMENT);
    CHECK(std::string(mha_last_error()).find("in-place attention (out == q) needs value_dim == head_dim") != std::string::npos);
    CHECK(test::same_bits(x, rg.q));
}

TEST_CASE("variant: window, softcap, ALiBi, sinks through varlen and the cache (prefill, chunks, decode) = mha_attention") {
    const Shape s{8, 2, 32, 32};
    const int64_t L = 300, row = s.o_row();
    std::vector<float> slopes, sinks;
    for (int64_t h = 0; h < s.H; ++h) {
        slopes.push_back(std::exp2(-8.0f * static_cast<float>(h + 1) / static_cast<float>(s.H)));
        sinks.push_back(0.3f * static_cast<float>(h) - 1.0f);
    }
    const struct {
        const char *what;
        mha_attention_variant v;
    } variants[] = {{"window 40", {40, 0.0f, nullptr, nullptr}},
                    {"window 100, softcap, ALiBi, sinks", {100, 0.7f, slopes.data(), sinks.data()}},
                    {"softcap, ALiBi, sinks, no window", {0, 0.7f, slopes.data(), sinks.data()}}};
    for (Isa isa : supported_isas())
        for (const Setup &su : {default_setup(isa), tiles_setup(isa, 5, 64, 128)})
            for (const auto &var : variants) {
                CAPTURE(su.name);
                CAPTURE(var.what);
                const VariantScope scope(var.v);
                Rt r1(1, su), r2(2, su);
                const SeqData t(s, L, 2000);
                const auto F = dense(r1, s, L, L, true, t.q.data(), t.k.data(), t.v.data());
                close_to(F.data(), reference(s, L, L, true, t.q.data(), t.k.data(), t.v.data()), "causal vs reference");
                same_rows(dense(r2, s, L, L, true, t.q.data(), t.k.data(), t.v.data()).data(), F.data(), L, row, "2 threads");
                // Varlen beside others, one with Lq < Lk (its queries at the last positions).
                const SeqData a(s, 37, 2001), b(s, 3, 250, 2002);
                {
                    Ragged rg(s);
                    for (const SeqData *d : {&a, &t, &b}) rg.add(*d);
                    std::vector<float> out(sz(rg.total_q() * row), test::kSentinel);
                    rg.run(r2, true, out.data());
                    same_rows(out.data() + rg.qo[1] * row, F.data(), L, row, "varlen, second of three");
                    const auto Fb = dense(r1, s, 3, 250, true, b.q.data(), b.k.data(), b.v.data());
                    same_rows(out.data() + rg.qo[2] * row, Fb.data(), 3, row, "varlen, Lq < Lk vs alone");
                    close_to(Fb.data(), reference(s, 3, 250, true, b.q.data(), b.k.data(), b.v.data()), "Lq < Lk vs reference");
                    rg.run(r1, false, out.data());
                    close_to(out.data() + rg.qo[2] * row, reference(s, 3, 250, false, b.q.data(), b.k.data(), b.v.data()),
                             "varlen not causal vs reference");
                }
                // The cache: prefill in one call, chunks beside nothing, decode token by token.
                const int64_t bt = block_tokens_for(r1, s);
                Cache c(r1, s, capacity(bt, {L, L, L}));
                append(r1, c, s, 1, t, 0, L);
                {
                    std::vector<float> out(sz(L * row), test::kSentinel);
                    REQUIRE_MESSAGE(cached(r2, c, {1}, {0, L}, s.H, true, t.q.data(), out.data()) == MHA_OK, mha_last_error());
                    same_rows(out.data(), F.data(), L, row, "cached prefill");
                    std::vector<float> nc(sz(5 * row), test::kSentinel);
                    const float *q5 = t.q.data() + (L - 5) * s.q_row();
                    REQUIRE(cached(r1, c, {1}, {0, 5}, s.H, false, q5, nc.data()) == MHA_OK);
                    same_rows(nc.data(), dense(r2, s, 5, L, false, q5, t.k.data(), t.v.data()).data(), 5, row,
                              "cached not causal vs mha_attention");
                    close_to(nc.data(), reference(s, 5, L, false, q5, t.k.data(), t.v.data()), "cached not causal vs reference");
                }
                CHECK(chunks_then_steps(r1, r2, c, s, t, F, L, {1, 7, 64, 100}, "") == 0);
            }
}

// ================================================================================================
// int8 KV cache (MHA_I8)
// ================================================================================================

TEST_CASE("int8 cache: rows round-trip within half a step, saturated rows exactly, zero rows as zeros; 0.27x the bytes") {
    Rt rt(1, best_default());
    const Shape s{4, 2, 24, 40};
    Cache c(rt, s, 64, 0, MHA_I8);
    std::vector<float> k = random_floats(sz(6 * s.k_row()), 3, -3.0f, 3.0f), v = random_floats(sz(6 * s.v_row()), 4, -3.0f, 3.0f);
    // Token 0: saturated rows (all equal, of several magnitudes and signs); token 1: zeros; token 2:
    // one value and zeros.
    const float sat[] = {0.7f, -1e-3f, 3.3e7f, -123.456f};
    for (int64_t h = 0; h < s.Hkv; ++h) {
        std::fill(k.begin() + h * s.D, k.begin() + (h + 1) * s.D, sat[h]);
        std::fill(v.begin() + h * s.Dv, v.begin() + (h + 1) * s.Dv, sat[h + 2]);
    }
    std::fill(k.begin() + s.k_row(), k.begin() + 2 * s.k_row(), 0.0f);
    std::fill(v.begin() + s.v_row(), v.begin() + 2 * s.v_row(), 0.0f);
    std::fill(k.begin() + 2 * s.k_row(), k.begin() + 3 * s.k_row(), 0.0f);
    k[sz(2 * s.k_row() + 5)] = -2.5f;
    REQUIRE(mha_kv_cache_append(rt, c, 7, 6, k.data(), v.data()) == MHA_OK);
    std::vector<float> kr, vr;
    c.read(7, 0, 6, s, kr, vr);
    for (int64_t i = 0; i < s.k_row(); ++i) CHECK(kr[sz(i)] == k[sz(i)]);  // saturated: exact
    for (int64_t i = 0; i < s.v_row(); ++i) CHECK(vr[sz(i)] == v[sz(i)]);
    for (int64_t i = s.k_row(); i < 3 * s.k_row(); ++i) CHECK(kr[sz(i)] == k[sz(i)]);  // zeros, and a lone value
    auto within_half_step = [](const float *x, const float *y, int64_t n) {
        float m = 0;
        for (int64_t i = 0; i < n; ++i) m = std::max(m, std::fabs(x[i]));
        for (int64_t i = 0; i < n; ++i) REQUIRE(std::fabs(x[i] - y[i]) <= m / 127.0f * 0.5f * 1.0001f);
    };
    for (int64_t t = 3; t < 6; ++t)
        for (int64_t h = 0; h < s.Hkv; ++h) {
            within_half_step(&k[sz(t * s.k_row() + h * s.D)], &kr[sz(t * s.k_row() + h * s.D)], s.D);
            within_half_step(&v[sz(t * s.v_row() + h * s.Dv)], &vr[sz(t * s.v_row() + h * s.Dv)], s.Dv);
        }
    // Bytes: H8 D128, int8 plus a scale per token and head, against fp32.
    const Shape big{8, 8, 128, 128};
    Cache f32(rt, big, 4096), i8(rt, big, 4096, 0, MHA_I8);
    uint64_t bf = 0, bi = 0;
    REQUIRE(mha_kv_cache_bytes(f32, &bf) == MHA_OK);
    REQUIRE(mha_kv_cache_bytes(i8, &bi) == MHA_OK);
    CHECK(static_cast<double>(bi) <= 0.27 * static_cast<double>(bf));
    CHECK(i8.config().dtype == MHA_I8);
    // A non-finite value: refused, nothing appended; a dtype outside the enum: refused.
    k[5] = NAN;
    CHECK(mha_kv_cache_append(rt, c, 7, 6, k.data(), v.data()) == MHA_INVALID_ARGUMENT);
    CHECK(std::string(mha_last_error()).find("non-finite") != std::string::npos);
    CHECK(c.seq_len(7) == 6);
    mha_kv_cache_config bad{};
    bad.num_kv_heads = 1; bad.head_dim = 8; bad.value_dim = 8; bad.max_tokens = 16;
    int bad_dtype = 3;
    std::memcpy(&bad.dtype, &bad_dtype, sizeof bad_dtype);
    mha_kv_cache *none = nullptr;
    CHECK(mha_kv_cache_create(rt, &bad, &none) == MHA_INVALID_ARGUMENT);
    CHECK(std::string(mha_last_error()).find("dtype") != std::string::npos);
    CHECK(none == nullptr);
}

TEST_CASE("int8 cache: attention adds no error beyond storage (double reference on the widened K and V) and keeps every bit-identity across paths and threads") {
    for (Isa isa : supported_isas())
        for (const Setup &su : {default_setup(isa), tiles_setup(isa, 5, 64, 128)})
            // GQA groups of 1 to 6 rows: decode's int8 scores take two key panels at a time up to 6.
            for (const Shape &s : {Shape{8, 2, 32, 32}, Shape{4, 1, 13, 7}, Shape{6, 1, 16, 16}, Shape{3, 3, 16, 20},
                                   Shape{6, 3, 40, 16}}) {
                CAPTURE(su.name);
                CAPTURE(s.D);
                CAPTURE(s.H / s.Hkv);
                const int64_t L = 200, row = s.o_row();
                Rt r1(1, su), r2(2, su);
                const SeqData t(s, L, 3000);
                const int64_t bt = block_tokens_for(r1, s);
                Cache c(r1, s, capacity(bt, {L, L, L}), 0, MHA_I8);
                append(r1, c, s, 1, t, 0, L);
                std::vector<float> kw, vw;  // the widened values the cache holds
                c.read(1, 0, L, s, kw, vw);
                // The prefill in one call on one thread: within 1e-5 of the double reference on the
                // widened K and V (the int8 arithmetic scales scores and probabilities, not the stored
                // values, so it differs from fp32 on the widened values in the last bits), and what
                // every other cached path must give, bit for bit.
                std::vector<float> F(sz(L * row), test::kSentinel);
                REQUIRE_MESSAGE(cached(r1, c, {1}, {0, L}, s.H, true, t.q.data(), F.data()) == MHA_OK, mha_last_error());
                const auto want = reference(s, L, L, true, t.q.data(), kw.data(), vw.data());
                int bad = 0;
                for (size_t i = 0; i < want.size(); ++i)
                    if (!(std::fabs(F[i] - want[i]) <= 1e-5 * std::max(1.0, std::fabs(want[i]))) && bad++ < 3)
                        FAIL_CHECK("[" << i << "] = " << F[i] << ", want " << want[i]);
                std::vector<float> out(sz(L * row), test::kSentinel);
                REQUIRE_MESSAGE(cached(r2, c, {1}, {0, L}, s.H, true, t.q.data(), out.data()) == MHA_OK, mha_last_error());
                same_rows(out.data(), F.data(), L, row, "int8 cached prefill on 2 threads = on 1");
                if (bad < 3) bad += static_cast<int>(chunks_then_steps(r1, r2, c, s, t, F, L, {1, 7, 64}, "int8 "));
                CHECK(bad == 0);
            }
}

TEST_CASE("kv cache window: blocks outside every future window go back, attention keeps its bits, and what they held is refused") {
    const Shape s{8, 2, 16, 16};
    const int64_t W = 100, L = 700;
    for (Isa isa : supported_isas())
        for (mha_dtype dtype : {MHA_F32, MHA_I8}) {
            CAPTURE(std::string(isa_name(isa)));
            CAPTURE(static_cast<int>(dtype));
            const Setup su = tiles_setup(isa, 5, 64, 128);
            Rt r1(1, su), r2(2, su);
            const SeqData t(s, L, 4000);
            mha_kv_cache_config cfg{};
            cfg.num_kv_heads = s.Hkv; cfg.head_dim = s.D; cfg.value_dim = s.Dv;
            cfg.max_tokens = 2048;
            cfg.dtype = dtype;
            cfg.window = W;
            mha_kv_cache *c = nullptr;
            REQUIRE_MESSAGE(mha_kv_cache_create(r1, &cfg, &c) == MHA_OK, mha_last_error());
            mha_kv_cache_config got{};
            REQUIRE(mha_kv_cache_get_config(c, &got) == MHA_OK);
            CHECK(got.window == W);
            const int64_t bt = got.block_tokens;
            int64_t all_free = 0;
            REQUIRE(mha_kv_cache_free_tokens(c, &all_free) == MHA_OK);
            // The reference: the same tokens in a cache that keeps everything, attended with the window.
            Cache full(r1, s, 2048, 0, dtype);
            append(r1, full, s, 1, t, 0, L);
            const VariantScope scope(mha_attention_variant{W, 0.0f, nullptr, nullptr});
            std::vector<float> want(sz(L * s.o_row()));
            REQUIRE(cached(r1, full, {1}, {0, L}, s.H, true, t.q.data(), want.data()) == MHA_OK);
            int64_t pos = 0, bad = 0, most_held = 0;
            for (int64_t n : chunks_of(L, {50, 1, 7, 64, 100, 1, 1, 200})) {
                mha_runtime *rt = pos % 2 ? static_cast<mha_runtime *>(r2) : static_cast<mha_runtime *>(r1);
                append(rt, c, s, 7, t, pos, n);
                std::vector<float> out(sz(n * s.o_row()), test::kSentinel);
                REQUIRE_MESSAGE(cached(rt, c, {7}, {0, n}, s.H, true, t.q.data() + pos * s.q_row(), out.data()) == MHA_OK,
                                std::string(mha_last_error()));
                bad += !same_rows(out.data(), want.data() + pos * s.o_row(), n, s.o_row(), "window cache chunk", pos);
                pos += n;
                int64_t free_now = 0;
                REQUIRE(mha_kv_cache_free_tokens(c, &free_now) == MHA_OK);
                most_held = std::max(most_held, all_free - free_now);
                // Held: what the last append's first token can see, plus that append, in whole blocks.
                CHECK(all_free - free_now <= (W + n + 2 * bt) / bt * bt);
            }
            CHECK(bad == 0);
            CHECK(most_held < L);
            // A window past the cache's, or none, is refused; so are queries whose window reaches
            // released positions, and reading them.
            std::vector<float> out(sz(400 * s.o_row()), test::kSentinel);
            {
                const VariantScope wide(mha_attention_variant{W + 1, 0.0f, nullptr, nullptr});
                CHECK(cached(r1, c, {7}, {0, 1}, s.H, true, t.q.data() + (L - 1) * s.q_row(), out.data()) == MHA_INVALID_ARGUMENT);
                CHECK(std::string(mha_last_error()).find("variant.window") != std::string::npos);
            }
            {
                const VariantScope none(mha_attention_variant{});
                CHECK(cached(r1, c, {7}, {0, 1}, s.H, true, t.q.data() + (L - 1) * s.q_row(), out.data()) == MHA_INVALID_ARGUMENT);
            }
            {
                const VariantScope again(mha_attention_variant{W, 0.0f, nullptr, nullptr});  // (scopes reset to none)
                // The last append (276 tokens at 424) released what precedes 325 - 325 % bt: queries from 300 see 201 on.
                CHECK(cached(r1, c, {7}, {0, 400}, s.H, true, t.q.data() + (L - 400) * s.q_row(), out.data()) ==
                      MHA_INVALID_ARGUMENT);
                CHECK(std::string(mha_last_error()).find("released") != std::string::npos);
            }
            CHECK(all_sentinel(out));
            std::vector<float> k(sz(s.k_row())), v(sz(s.v_row()));
            CHECK(mha_kv_cache_read(c, 7, 0, 1, k.data(), v.data()) == MHA_INVALID_ARGUMENT);
            CHECK(mha_kv_cache_read(c, 7, L - 1, 1, k.data(), v.data()) == MHA_OK);
            // Fork shares what is left; releasing both gives every block back.
            REQUIRE(mha_kv_cache_fork(c, 7, 8) == MHA_OK);
            append(r1, c, s, 8, t, 0, 1);
            REQUIRE(mha_kv_cache_release(c, 7) == MHA_OK);
            REQUIRE(mha_kv_cache_release(c, 8) == MHA_OK);
            int64_t free_end = 0;
            REQUIRE(mha_kv_cache_free_tokens(c, &free_end) == MHA_OK);
            CHECK(free_end == all_free);
            cfg.window = -1;
            mha_kv_cache *none = nullptr;
            CHECK(mha_kv_cache_create(r1, &cfg, &none) == MHA_INVALID_ARGUMENT);
            CHECK(std::string(mha_last_error()).find("window") != std::string::npos);
            mha_kv_cache_destroy(c);
        }
}

TEST_CASE("bit-identity with tiles 5/7/14: a cache with blocks of attn_block_k tokens, chunks and decode = mha_attention") {
    // block_tokens 0 must resolve to something legal: with attn_block_k = 7 only 7 itself.
    for (Isa isa : supported_isas()) {
        const Setup su = tiles_setup(isa, 5, 7, 14);
        CAPTURE(su.name);
        Rt r1(1, su), r2(2, su);
        const Shape s{4, 2, 16, 8};
        const int64_t L = 40, row = s.o_row();
        const int64_t bt = block_tokens_for(r1, s);
        CHECK(bt == 7);
        const SeqData t(s, L, 55);
        const auto F = dense(r1, s, L, L, true, t.q.data(), t.k.data(), t.v.data());
        close_to(F.data(), reference(s, L, L, true, t.q.data(), t.k.data(), t.v.data()), "mha_attention vs reference");
        Cache c(r1, s, 3 * L);
        int64_t pos = 0, bad = 0;
        for (int64_t n : chunks_of(L, {1, 7, 5, 13})) {
            append(r1, c, s, 1, t, pos, n);
            std::vector<float> out(sz(n * row), test::kSentinel);
            REQUIRE_MESSAGE(cached(r2, c, {1}, {0, n}, s.H, true, t.q.data() + pos * s.q_row(), out.data()) == MHA_OK,
                            mha_last_error());
            bad += !same_rows(out.data(), F.data() + pos * row, n, row, "chunk", pos);
            pos += n;
        }
        for (int64_t i = 0; i < L; ++i) {
            append(r1, c, s, 2, t, i, 1);
            std::vector<float> out(sz(row), test::kSentinel);
            REQUIRE(cached(i % 2 ? static_cast<mha_runtime *>(r2) : static_cast<mha_runtime *>(r1), c, {2}, {0, 1}, s.H, true,
                           t.q.data() + i * s.q_row(), out.data()) == MHA_OK);
            bad += !same_rows(out.data(), F.data() + i * row, 1, row, "decode", i);
        }
        CHECK(bad == 0);
    }
}

namespace {

mha_layer_config layer_cfg(int64_t E, int64_t H, int64_t Hkv, int64_t hd, int64_t vd, int64_t kdim = 0) {
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

} // namespace

TEST_CASE("bit-identity, layer: mha_layer_forward causal = forward_cached prefill + decode, and chunked, 1 and 2 threads") {
    for (Isa isa : supported_isas())
        for (bool small : {false, true}) {
            const Setup su = small ? tiles_setup(isa, 5, 64, 128) : default_setup(isa);
            CAPTURE(su.name);
            Rt r1(1, su), r2(2, su);
            const int64_t E = 32, L = small ? 200 : 1100, P = small ? 100 : 1000;  // decode crosses a chunk
            LayerBox lb(r1, layer_cfg(E, 4, 2, 12, 10), 21);
            const Shape cs = lb.cache_shape();
            const auto x = random_floats(sz(L * E), 22);
            const auto F = lb.full(r1, L, x.data());
            same_rows(lb.full(r2, L, x.data()).data(), F.data(), L, E, "mha_layer_forward on 2 threads");
            Cache c(r1, cs, capacity(block_tokens_for(r1, cs), {L, L}));
            int64_t bad = 0;
            // Prefill P in one call, then decode one token per call, alternating the runtimes.
            {
                std::vector<float> out(sz(P * E), test::kSentinel);
                REQUIRE_MESSAGE(lb.step(r1, c, {5}, {0, P}, true, x.data(), out.data()) == MHA_OK, mha_last_error());
                bad += !same_rows(out.data(), F.data(), P, E, "layer prefill");
                for (int64_t i = P; i < L && bad < 3; ++i) {
                    std::vector<float> o(sz(E), test::kSentinel);
                    REQUIRE(lb.step(i % 2 ? static_cast<mha_runtime *>(r2) : static_cast<mha_runtime *>(r1), c, {5}, {0, 1}, true,
                                    x.data() + i * E, o.data()) == MHA_OK);
                    bad += !same_rows(o.data(), F.data() + i * E, 1, E, "layer decode step", i);
                }
                CHECK(c.seq_len(5) == L);
            }
            // Chunks 1, 7, 64, 100, rest on 2 threads.
            int64_t pos = 0;
            for (int64_t n : chunks_of(L, {1, 7, 64, 100})) {
                std::vector<float> o(sz(n * E), test::kSentinel);
                REQUIRE(lb.step(r2, c, {6}, {0, n}, true, x.data() + pos * E, o.data()) == MHA_OK);
                bad += !same_rows(o.data(), F.data() + pos * E, n, E, "layer chunk", pos);
                pos += n;
            }
            CHECK(bad == 0);
            // Both ways projected the same K and V.
            std::vector<float> k5, v5, k6, v6;
            c.read(5, 0, L, cs, k5, v5);
            c.read(6, 0, L, cs, k6, v6);
            CHECK(test::same_bits(k5, k6));
            CHECK(test::same_bits(v5, v6));
        }
}

TEST_CASE("bit-identity, layer: sequences batched in one forward_cached call = each alone = the full forward") {
    for (const Setup &su : cache_setups()) {
        CAPTURE(su.name);
        Rt r1(1, su), r2(2, su);
        const int64_t E = 24, steps = 6;
        LayerBox lb(r1, layer_cfg(E, 4, 1, 8, 6), 31);  // MQA
        const Shape cs = lb.cache_shape();
        const int64_t LA = 40, LB = 70, LC = 30;
        const auto xa = random_floats(sz((LA + steps) * E), 32), xb = random_floats(sz((LB + steps) * E), 33),
                   xc = random_floats(sz((LC + steps) * E), 34);
        const auto FA = lb.full(r1, LA + steps, xa.data()), FB = lb.full(r1, LB + steps, xb.data()),
                   FC = lb.full(r1, LC + steps, xc.data());
        const int64_t cap = capacity(block_tokens_for(r1, cs), {LA + steps, LB + steps, LC + steps});
        Cache batched(r1, cs, cap), alone(r1, cs, cap);
        int64_t bad = 0;
        struct Part {
            const std::vector<float> *x;
            int64_t from, to;
        };
        auto cat = [&](std::initializer_list<Part> parts) {
            std::vector<float> x;
            for (const Part &p : parts) x.insert(x.end(), p.x->begin() + p.from * E, p.x->begin() + p.to * E);
            return x;
        };
        // Prefill A and B together (B first), and each alone.
        {
            const auto x = cat({{&xb, 0, LB}, {&xa, 0, LA}});
            std::vector<float> out(sz((LA + LB) * E), test::kSentinel);
            REQUIRE_MESSAGE(lb.step(r2, batched, {2, 1}, {0, LB, LB + LA}, true, x.data(), out.data()) == MHA_OK, mha_last_error());
            bad += !same_rows(out.data(), FB.data(), LB, E, "batched prefill, B");
            bad += !same_rows(out.data() + LB * E, FA.data(), LA, E, "batched prefill, A");
            std::vector<float> oa(sz(LA * E)), ob(sz(LB * E));
            REQUIRE(lb.step(r1, alone, {1}, {0, LA}, true, xa.data(), oa.data()) == MHA_OK);
            REQUIRE(lb.step(r1, alone, {2}, {0, LB}, true, xb.data(), ob.data()) == MHA_OK);
            bad += !same_rows(oa.data(), FA.data(), LA, E, "prefill alone, A");
            bad += !same_rows(ob.data(), FB.data(), LB, E, "prefill alone, B");
        }
        // Decode steps of A and B in one call; at step 2, C joins with a prefill chunk of LC.
        int64_t c_len = 0;
        for (int64_t st = 0; st < steps; ++st) {
            CAPTURE(st);
            std::vector<int64_t> ids = {2, 1}, qo = {0, 1, 2};
            auto x = cat({{&xb, LB + st, LB + st + 1}, {&xa, LA + st, LA + st + 1}});
            int64_t c_n = 0;
            if (st >= 2) {
                c_n = st == 2 ? LC : 1;
                ids.insert(ids.begin() + 1, 3);
                qo = {0, 1, 1 + c_n, 2 + c_n};
                const auto xcn = cat({{&xc, c_len, c_len + c_n}});
                x.insert(x.begin() + E, xcn.begin(), xcn.end());
            }
            std::vector<float> out(sz(qo.back() * E), test::kSentinel);
            REQUIRE_MESSAGE(lb.step(st % 2 ? static_cast<mha_runtime *>(r2) : static_cast<mha_runtime *>(r1), batched, ids, qo, true,
                                    x.data(), out.data()) == MHA_OK,
                            mha_last_error());
            bad += !same_rows(out.data(), FB.data() + (LB + st) * E, 1, E, "batched decode, B", LB + st);
            bad += !same_rows(out.data() + (qo.back() - 1) * E, FA.data() + (LA + st) * E, 1, E, "batched decode, A", LA + st);
            if (c_n) bad += !same_rows(out.data() + E, FC.data() + c_len * E, c_n, E, "C beside the decodes", c_len);
            c_len += c_n;
            std::vector<float> oa(sz(E)), ob(sz(E));
            REQUIRE(lb.step(r2, alone, {1}, {0, 1}, true, xa.data() + (LA + st) * E, oa.data()) == MHA_OK);
            REQUIRE(lb.step(r1, alone, {2}, {0, 1}, true, xb.data() + (LB + st) * E, ob.data()) == MHA_OK);
            bad += !same_rows(oa.data(), out.data() + (qo.back() - 1) * E, 1, E, "decode alone = batched, A", LA + st);
            bad += !same_rows(ob.data(), out.data(), 1, E, "decode alone = batched, B", LB + st);
        }
        CHECK(bad == 0);
        CHECK(batched.seq_len(1) == LA + steps);
        CHECK(batched.seq_len(2) == LB + steps);
        CHECK(batched.seq_len(3) == c_len);
    }
}

// ================================================================================================
// 5. Bad input
// ================================================================================================

namespace {

std::vector<std::string> null_names(const std::string &name) {
    return {name + " is NULL", name + " must not be NULL", name + " = NULL", name + " is null", name + " == NULL"};
}

// A failed call with a known message, so a stale message cannot pass for a new one.
void reset_error(mha_runtime *rt) {
    float c = 0;
    REQUIRE(mha_sgemm(rt, 'Z', 'N', 1, 1, 1, 1, &c, 1, &c, 1, 0, &c, 1) == MHA_INVALID_ARGUMENT);
}

struct Snapshot {
    int64_t free = -1;
    std::vector<int64_t> lens;
    std::vector<std::vector<float>> k, v;
    bool operator==(const Snapshot &) const = default;
};

Snapshot snapshot(const Cache &c, const Shape &s, const std::vector<int64_t> &ids) {
    Snapshot sn;
    sn.free = c.free_tokens();
    for (int64_t id : ids) {
        const int64_t len = c.seq_len(id);
        sn.lens.push_back(len);
        std::vector<float> k, v;
        if (len > 0) c.read(id, 0, len, s, k, v);
        sn.k.push_back(k);
        sn.v.push_back(v);
    }
    return sn;
}

} // namespace

TEST_CASE("bad input: a status, a message naming the field, and the cache and every output left as they were") {
    const Setup su = best_default();
    Rt rt(1, su);
    const Shape s{4, 2, 8, 4};
    const int64_t bt = block_tokens_for(rt, s), nblocks = 8;
    Cache c(rt, s, nblocks * bt);
    const SeqData d1(s, 5, 1), d2(s, bt + 1, 2);
    append(rt, c, s, 1, d1, 0, 5);
    append(rt, c, s, 2, d2, 0, bt + 1);
    const std::vector<int64_t> ids = {1, 2, 3, 9, 50};
    const Snapshot before = snapshot(c, s, ids);
    REQUIRE(before.free == (nblocks - 3) * bt);

    // Big enough for every call below (the layer's overflowing batch has about 6 blocks of rows).
    const size_t big = sz(std::max<int64_t>(4096, (8 * bt + 64) * 16));
    std::vector<float> out(big, test::kSentinel), rk(4096, test::kSentinel), rv(4096, test::kSentinel);
    const auto q = random_floats(big, 3), k = random_floats(big, 4), v = random_floats(big, 5);
    std::vector<std::function<bool()>> extra_unchanged;

    auto expect = [&](const std::string &what, const std::function<mha_status()> &call, std::initializer_list<mha_status> want,
                      const std::vector<std::string> &needles) {
        reset_error(rt);
        const std::string stale = mha_last_error();
        const mha_status got = call();
        const std::string msg = mha_last_error();
        bool status_ok = false;
        for (mha_status w : want) status_ok |= got == w;
        CHECK_MESSAGE(status_ok, what << ": status " << static_cast<int>(got) << ", message '" << msg << "'");
        CHECK_MESSAGE((!msg.empty() && msg != stale), what << ": no message of its own");
        CHECK_MESSAGE(contains_any(msg, needles), what << ": the message '" << msg << "' does not name the field");
        CHECK_MESSAGE(snapshot(c, s, ids) == before, what << ": the cache changed");
        CHECK_MESSAGE(all_sentinel(out), what << ": out was written");
        CHECK_MESSAGE((all_sentinel(rk) && all_sentinel(rv)), what << ": a read buffer was written");
        for (auto &f : extra_unchanged) CHECK_MESSAGE(f(), what << ": another cache changed");
    };
    constexpr auto INV = MHA_INVALID_ARGUMENT;
    const int64_t huge = INT64_C(1) << 62;

    SUBCASE("mha_attention_varlen") {
        const std::vector<int64_t> qo = {0, 2, 5}, ko = {0, 3, 7};
        mha_varlen_params good{};
        good.num_seqs = 2;
        good.q_offsets = qo.data();
        good.kv_offsets = ko.data();
        good.num_heads = 4;
        good.num_kv_heads = 2;
        good.head_dim = 8;
        good.value_dim = 4;
        {
            std::vector<float> o(5 * 4 * 4);
            REQUIRE_MESSAGE(mha_attention_varlen(rt, &good, q.data(), k.data(), v.data(), o.data()) == MHA_OK, mha_last_error());
        }
        auto with = [&](const std::string &what, const std::function<void(mha_varlen_params &)> &edit,
                        std::initializer_list<mha_status> want, const std::vector<std::string> &needles) {
            expect(what, [&] {
                mha_varlen_params p = good;
                edit(p);
                return mha_attention_varlen(rt, &p, q.data(), k.data(), v.data(), out.data());
            }, want, needles);
        };
        expect("rt NULL", [&] { return mha_attention_varlen(nullptr, &good, q.data(), k.data(), v.data(), out.data()); }, {INV}, null_names("rt"));
        expect("p NULL", [&] { return mha_attention_varlen(rt, nullptr, q.data(), k.data(), v.data(), out.data()); }, {INV}, null_names("p"));
        expect("q NULL", [&] { return mha_attention_varlen(rt, &good, nullptr, k.data(), v.data(), out.data()); }, {INV}, null_names("q"));
        expect("k NULL", [&] { return mha_attention_varlen(rt, &good, q.data(), nullptr, v.data(), out.data()); }, {INV}, null_names("k"));
        expect("v NULL", [&] { return mha_attention_varlen(rt, &good, q.data(), k.data(), nullptr, out.data()); }, {INV}, null_names("v"));
        expect("out NULL", [&] { return mha_attention_varlen(rt, &good, q.data(), k.data(), v.data(), nullptr); }, {INV}, null_names("out"));
        with("q_offsets NULL", [](auto &p) { p.q_offsets = nullptr; }, {INV}, {"q_offsets"});
        with("kv_offsets NULL", [](auto &p) { p.kv_offsets = nullptr; }, {INV}, {"kv_offsets"});
        with("num_seqs < 0", [](auto &p) { p.num_seqs = -1; }, {INV}, {"num_seqs"});
        static const int64_t q_first[] = {1, 2, 5}, q_down[] = {0, 3, 2}, k_first[] = {2, 3, 7}, k_down[] = {0, 4, 3},
                             q_huge[] = {0, 2, INT64_C(1) << 62}, k_huge[] = {0, 3, INT64_C(1) << 62};
        with("q_offsets[0] != 0", [](auto &p) { p.q_offsets = q_first; }, {INV}, {"q_offsets"});
        with("q_offsets decreasing", [](auto &p) { p.q_offsets = q_down; }, {INV}, {"q_offsets"});
        with("kv_offsets[0] != 0", [](auto &p) { p.kv_offsets = k_first; }, {INV}, {"kv_offsets"});
        with("kv_offsets decreasing", [](auto &p) { p.kv_offsets = k_down; }, {INV}, {"kv_offsets"});
        with("num_heads not a multiple of num_kv_heads", [](auto &p) { p.num_heads = 3; }, {INV}, {"num_heads", "num_kv_heads"});
        with("num_heads 0", [](auto &p) { p.num_heads = 0; }, {INV}, {"num_heads"});
        with("num_kv_heads 0", [](auto &p) { p.num_kv_heads = 0; }, {INV}, {"num_kv_heads"});
        with("head_dim 0", [](auto &p) { p.head_dim = 0; }, {INV}, {"head_dim"});
        with("value_dim < 0", [](auto &p) { p.value_dim = -4; }, {INV}, {"value_dim"});
        with("scale NaN", [](auto &p) { p.scale = NAN; }, {INV}, {"scale"});
        with("window < 0", [](auto &p) { p.variant.window = -3; }, {INV}, {"variant.window"});
        with("softcap NaN", [](auto &p) { p.variant.softcap = NAN; }, {INV}, {"variant.softcap"});
        with("softcap < 0", [](auto &p) { p.variant.softcap = -2.0f; }, {INV}, {"variant.softcap"});
        with("q rows overflow", [](auto &p) { p.q_offsets = q_huge; }, {INV}, {"overflow", "q_offsets"});
        with("kv rows overflow", [](auto &p) { p.kv_offsets = k_huge; }, {INV}, {"overflow", "kv_offsets"});
        with("head sizes overflow", [](auto &p) { p.num_heads = INT64_C(1) << 31; p.head_dim = INT64_C(1) << 40; }, {INV},
             {"overflow", "head_dim", "num_heads"});
    }

    SUBCASE("mha_kv_cache_create") {
        mha_kv_cache_config good{};
        good.num_kv_heads = 2;
        good.head_dim = 8;
        good.value_dim = 4;
        good.max_tokens = 100;
        mha_kv_cache *made = nullptr;
        auto with = [&](const std::string &what, const std::function<void(mha_kv_cache_config &)> &edit,
                        std::initializer_list<mha_status> want, const std::vector<std::string> &needles) {
            expect(what, [&] {
                mha_kv_cache_config cfg = good;
                edit(cfg);
                return mha_kv_cache_create(rt, &cfg, &made);
            }, want, needles);
            CHECK_MESSAGE(made == nullptr, what << ": a cache was made");
            mha_kv_cache_destroy(made);
            made = nullptr;
        };
        expect("rt NULL", [&] { return mha_kv_cache_create(nullptr, &good, &made); }, {INV}, null_names("rt"));
        expect("config NULL", [&] { return mha_kv_cache_create(rt, nullptr, &made); }, {INV}, null_names("config"));
        expect("out NULL", [&] { return mha_kv_cache_create(rt, &good, nullptr); }, {INV}, null_names("out"));
        CHECK(made == nullptr);
        const TileConfig t = tiles_of(su);
        const int64_t nr = nr_of(t);
        with("num_kv_heads 0", [](auto &x) { x.num_kv_heads = 0; }, {INV}, {"num_kv_heads"});
        with("head_dim 0", [](auto &x) { x.head_dim = 0; }, {INV}, {"head_dim"});
        with("value_dim < 0", [](auto &x) { x.value_dim = -1; }, {INV}, {"value_dim"});
        with("max_tokens < 0", [](auto &x) { x.max_tokens = -5; }, {INV}, {"max_tokens"});
        with("block_tokens < 0", [](auto &x) { x.block_tokens = -16; }, {INV}, {"block_tokens"});
        with("block_tokens 3 (divides nothing)", [](auto &x) { x.block_tokens = 3; }, {INV}, {"block_tokens"});
        // Neither divides attn_block_k nor is a multiple of it (mha.h allows only divisors; the
        // implementation also takes multiples of attn_block_k, see the attention_cached test).
        with("block_tokens = attn_block_k + NR", [&](auto &x) { x.block_tokens = t.attn_block_k + nr; }, {INV}, {"block_tokens"});
        if (nr % 2 == 0 && t.attn_block_k % (nr / 2) == 0)
            with("block_tokens not a multiple of NR", [&](auto &x) { x.block_tokens = nr / 2; }, {INV}, {"block_tokens"});
        with("dtype unknown", [](auto &x) { x.dtype = static_cast<mha_dtype>(7); }, {INV, MHA_UNSUPPORTED}, {"dtype"});
        with("dtype bf16", [](auto &x) { x.dtype = MHA_BF16; }, {MHA_UNSUPPORTED}, {});
        with("max_tokens whose bytes overflow", [&](auto &x) { x.max_tokens = huge; x.head_dim = 128; x.value_dim = 128; }, {INV},
             {"overflow", "max_tokens"});
    }

    SUBCASE("mha_kv_cache_append, fork, release, seq_len, free_tokens, bytes, get_config, read") {
        expect("append: rt NULL", [&] { return mha_kv_cache_append(nullptr, c, 1, 1, k.data(), v.data()); }, {INV}, null_names("rt"));
        expect("append: cache NULL", [&] { return mha_kv_cache_append(rt, nullptr, 1, 1, k.data(), v.data()); }, {INV}, null_names("cache"));
        expect("append: k NULL", [&] { return mha_kv_cache_append(rt, c, 1, 1, nullptr, v.data()); }, {INV}, null_names("k"));
        expect("append: v NULL", [&] { return mha_kv_cache_append(rt, c, 1, 1, k.data(), nullptr); }, {INV}, null_names("v"));
        expect("append: negative seq_id", [&] { return mha_kv_cache_append(rt, c, -1, 1, k.data(), v.data()); }, {INV}, {"seq_id"});
        expect("append: negative n_tokens", [&] { return mha_kv_cache_append(rt, c, 1, -1, k.data(), v.data()); }, {INV}, {"n_tokens"});
        const int64_t room = before.free + (bt - 5);  // seq 1's tail plus the free blocks
        expect("append past the capacity (existing sequence)",
               [&] { return mha_kv_cache_append(rt, c, 1, room + 1, k.data(), v.data()); }, {MHA_OUT_OF_MEMORY}, {});
        expect("append past the capacity (new sequence)",
               [&] { return mha_kv_cache_append(rt, c, 9, before.free + 1, k.data(), v.data()); }, {MHA_OUT_OF_MEMORY}, {});
        expect("append: n_tokens whose extent overflows",
               [&] { return mha_kv_cache_append(rt, c, 9, huge, k.data(), v.data()); }, {INV, MHA_OUT_OF_MEMORY}, {});
        expect("fork: cache NULL", [&] { return mha_kv_cache_fork(nullptr, 1, 3); }, {INV}, null_names("cache"));
        expect("fork onto an existing id", [&] { return mha_kv_cache_fork(c, 1, 2); }, {INV}, {"dst_seq"});
        expect("fork onto itself", [&] { return mha_kv_cache_fork(c, 1, 1); }, {INV}, {"dst_seq"});
        expect("fork from an unknown id", [&] { return mha_kv_cache_fork(c, 9, 3); }, {INV}, {"src_seq"});
        expect("fork from a negative id", [&] { return mha_kv_cache_fork(c, -2, 3); }, {INV}, {"src_seq"});
        expect("fork onto a negative id", [&] { return mha_kv_cache_fork(c, 1, -3); }, {INV}, {"dst_seq"});
        expect("release: cache NULL", [&] { return mha_kv_cache_release(nullptr, 1); }, {INV}, null_names("cache"));
        expect("release of an unknown id", [&] { return mha_kv_cache_release(c, 9); }, {INV}, {"seq_id"});
        expect("release of a negative id", [&] { return mha_kv_cache_release(c, -1); }, {INV}, {"seq_id"});
        int64_t n = -3;
        uint64_t b = 3;
        mha_kv_cache_config cfg{};
        cfg.head_dim = -9;
        expect("seq_len: cache NULL", [&] { return mha_kv_cache_seq_len(nullptr, 1, &n); }, {INV}, null_names("cache"));
        expect("seq_len: len NULL", [&] { return mha_kv_cache_seq_len(c, 1, nullptr); }, {INV}, null_names("len"));
        expect("seq_len: unknown id", [&] { return mha_kv_cache_seq_len(c, 9, &n); }, {INV}, {"seq_id"});
        expect("free_tokens: cache NULL", [&] { return mha_kv_cache_free_tokens(nullptr, &n); }, {INV}, null_names("cache"));
        expect("free_tokens: tokens NULL", [&] { return mha_kv_cache_free_tokens(c, nullptr); }, {INV}, null_names("tokens"));
        expect("bytes: cache NULL", [&] { return mha_kv_cache_bytes(nullptr, &b); }, {INV}, null_names("cache"));
        expect("bytes: bytes NULL", [&] { return mha_kv_cache_bytes(c, nullptr); }, {INV}, null_names("bytes"));
        expect("get_config: cache NULL", [&] { return mha_kv_cache_get_config(nullptr, &cfg); }, {INV}, null_names("cache"));
        expect("get_config: config NULL", [&] { return mha_kv_cache_get_config(c, nullptr); }, {INV}, null_names("config"));
        CHECK(n == -3);
        CHECK(b == 3);
        CHECK(cfg.head_dim == -9);
        expect("read: cache NULL", [&] { return mha_kv_cache_read(nullptr, 1, 0, 1, rk.data(), rv.data()); }, {INV}, null_names("cache"));
        expect("read: unknown id", [&] { return mha_kv_cache_read(c, 9, 0, 1, rk.data(), rv.data()); }, {INV}, {"seq_id"});
        expect("read: negative start", [&] { return mha_kv_cache_read(c, 1, -1, 2, rk.data(), rv.data()); }, {INV}, {"start"});
        expect("read: negative n_tokens", [&] { return mha_kv_cache_read(c, 1, 0, -1, rk.data(), rv.data()); }, {INV}, {"n_tokens"});
        expect("read past the sequence", [&] { return mha_kv_cache_read(c, 1, 2, 4, rk.data(), rv.data()); }, {INV},
               {"n_tokens", "start"});
        expect("read: huge n_tokens", [&] { return mha_kv_cache_read(c, 1, 2, huge, rk.data(), rv.data()); }, {INV},
               {"n_tokens", "start", "overflow"});
        // What fits is accepted: the capacity arithmetic above is right.
        REQUIRE(mha_kv_cache_append(rt, c, 1, room, k.data(), v.data()) == MHA_OK);
        CHECK(c.free_tokens() == 0);
    }

    SUBCASE("mha_attention_cached") {
        const std::vector<int64_t> gids = {1, 2}, gqo = {0, 2, 5};
        mha_cached_params good{};
        good.num_seqs = 2;
        good.seq_ids = gids.data();
        good.q_offsets = gqo.data();
        good.num_heads = 4;
        good.causal = 1;
        {
            std::vector<float> o(5 * 4 * 4);
            REQUIRE_MESSAGE(mha_attention_cached(rt, c, &good, q.data(), o.data()) == MHA_OK, mha_last_error());
        }
        auto with = [&](const std::string &what, const std::function<void(mha_cached_params &)> &edit,
                        std::initializer_list<mha_status> want, const std::vector<std::string> &needles) {
            expect(what, [&] {
                mha_cached_params p = good;
                edit(p);
                return mha_attention_cached(rt, c, &p, q.data(), out.data());
            }, want, needles);
        };
        expect("rt NULL", [&] { return mha_attention_cached(nullptr, c, &good, q.data(), out.data()); }, {INV}, null_names("rt"));
        expect("cache NULL", [&] { return mha_attention_cached(rt, nullptr, &good, q.data(), out.data()); }, {INV}, null_names("cache"));
        expect("p NULL", [&] { return mha_attention_cached(rt, c, nullptr, q.data(), out.data()); }, {INV}, null_names("p"));
        expect("q NULL", [&] { return mha_attention_cached(rt, c, &good, nullptr, out.data()); }, {INV}, null_names("q"));
        expect("out NULL", [&] { return mha_attention_cached(rt, c, &good, q.data(), nullptr); }, {INV}, null_names("out"));
        static const int64_t unknown[] = {1, 99}, dup[] = {2, 2}, neg[] = {-1, 2}, first[] = {1, 2, 5}, down[] = {0, 3, 2},
                             too_many[] = {0, 6, 7}, huge_qo[] = {0, 2, INT64_C(1) << 62};
        with("seq_ids NULL", [](auto &p) { p.seq_ids = nullptr; }, {INV}, {"seq_ids"});
        with("q_offsets NULL", [](auto &p) { p.q_offsets = nullptr; }, {INV}, {"q_offsets"});
        with("num_seqs < 0", [](auto &p) { p.num_seqs = -1; }, {INV}, {"num_seqs"});
        with("unknown seq_id", [](auto &p) { p.seq_ids = unknown; }, {INV}, {"seq_ids"});
        with("duplicate seq_ids", [](auto &p) { p.seq_ids = dup; }, {INV}, {"seq_ids"});
        with("negative seq_id", [](auto &p) { p.seq_ids = neg; }, {INV}, {"seq_ids"});
        with("q_offsets[0] != 0", [](auto &p) { p.q_offsets = first; }, {INV}, {"q_offsets"});
        with("q_offsets decreasing", [](auto &p) { p.q_offsets = down; }, {INV}, {"q_offsets"});
        with("more queries than cached tokens", [](auto &p) { p.q_offsets = too_many; }, {INV}, {"q_offsets"});
        with("offsets past everything", [](auto &p) { p.q_offsets = huge_qo; }, {INV}, {"q_offsets", "overflow"});
        with("num_heads not a multiple of the cache's num_kv_heads", [](auto &p) { p.num_heads = 3; }, {INV}, {"num_heads"});
        with("num_heads 0", [](auto &p) { p.num_heads = 0; }, {INV}, {"num_heads"});
        with("scale NaN", [](auto &p) { p.scale = NAN; }, {INV}, {"scale"});
        with("window < 0", [](auto &p) { p.variant.window = -1; }, {INV}, {"variant.window"});
        with("softcap inf", [](auto &p) { p.variant.softcap = INFINITY; }, {INV}, {"variant.softcap"});
        // A runtime with other attention tiles than the cache's.
        const Setup other = tiles_setup(su.isa, 5, 64, 128);
        Rt rt_other(1, other);
        expect("a runtime with other tiles", [&] { return mha_attention_cached(rt_other, c, &good, q.data(), out.data()); },
               {INV, MHA_UNSUPPORTED}, {});
    }

    SUBCASE("mha_layer_forward_cached") {
        const int64_t E = 16;
        LayerBox lb(rt, layer_cfg(E, 4, 2, 8, 4), 61);  // dims of the cache
        const auto x = random_floats(big, 62);
        const std::vector<int64_t> gids = {1, 3}, gqo = {0, 2, 3};
        mha_layer_cached_params good{};
        good.num_seqs = 2;
        good.seq_ids = gids.data();
        good.q_offsets = gqo.data();
        good.causal = 1;
        auto with = [&](const std::string &what, const std::function<void(mha_layer_cached_params &)> &edit,
                        std::initializer_list<mha_status> want, const std::vector<std::string> &needles) {
            expect(what, [&] {
                mha_layer_cached_params p = good;
                edit(p);
                return mha_layer_forward_cached(rt, lb.layer, c, &p, x.data(), out.data());
            }, want, needles);
        };
        expect("rt NULL", [&] { return mha_layer_forward_cached(nullptr, lb.layer, c, &good, x.data(), out.data()); }, {INV},
               null_names("rt"));
        expect("layer NULL", [&] { return mha_layer_forward_cached(rt, nullptr, c, &good, x.data(), out.data()); }, {INV},
               null_names("layer"));
        expect("cache NULL", [&] { return mha_layer_forward_cached(rt, lb.layer, nullptr, &good, x.data(), out.data()); }, {INV},
               null_names("cache"));
        expect("p NULL", [&] { return mha_layer_forward_cached(rt, lb.layer, c, nullptr, x.data(), out.data()); }, {INV},
               null_names("p"));
        expect("x NULL", [&] { return mha_layer_forward_cached(rt, lb.layer, c, &good, nullptr, out.data()); }, {INV},
               null_names("x"));
        expect("out NULL", [&] { return mha_layer_forward_cached(rt, lb.layer, c, &good, x.data(), nullptr); }, {INV},
               null_names("out"));
        static const int64_t dup[] = {3, 3}, neg[] = {1, -3}, first[] = {1, 2, 3}, down[] = {0, 2, 1},
                             huge_qo[] = {0, 1, INT64_C(1) << 62};
        with("seq_ids NULL", [](auto &p) { p.seq_ids = nullptr; }, {INV}, {"seq_ids"});
        with("q_offsets NULL", [](auto &p) { p.q_offsets = nullptr; }, {INV}, {"q_offsets"});
        with("num_seqs < 0", [](auto &p) { p.num_seqs = -2; }, {INV}, {"num_seqs"});
        with("duplicate seq_ids", [](auto &p) { p.seq_ids = dup; }, {INV}, {"seq_ids"});
        with("negative seq_id", [](auto &p) { p.seq_ids = neg; }, {INV}, {"seq_ids"});
        with("q_offsets[0] != 0", [](auto &p) { p.q_offsets = first; }, {INV}, {"q_offsets"});
        with("q_offsets decreasing", [](auto &p) { p.q_offsets = down; }, {INV}, {"q_offsets"});
        with("huge q_offsets", [](auto &p) { p.q_offsets = huge_qo; }, {INV, MHA_OUT_OF_MEMORY}, {});
        // Caches whose dims differ from the layer's.
        for (auto [what, shape, field] : {std::tuple{"cache head_dim differs", Shape{4, 2, 16, 4}, "head_dim"},
                                          std::tuple{"cache num_kv_heads differs", Shape{4, 4, 8, 4}, "num_kv_heads"},
                                          std::tuple{"cache value_dim differs", Shape{4, 2, 8, 8}, "value_dim"}}) {
            Cache other(rt, shape, 4 * bt);
            const int64_t free_other = other.free_tokens();
            extra_unchanged = {[&] { return other.free_tokens() == free_other && other.seq_len(1) == -1 && other.seq_len(3) == -1; }};
            expect(what, [&] { return mha_layer_forward_cached(rt, lb.layer, other, &good, x.data(), out.data()); }, {INV},
                   {field});
            extra_unchanged.clear();
        }
        // A cross-attention layer (kdim != E) cannot run incrementally.
        {
            LayerBox cross(rt, layer_cfg(E, 4, 2, 8, 4, 12), 63);
            expect("cross-attention layer", [&] { return mha_layer_forward_cached(rt, cross.layer, c, &good, x.data(), out.data()); },
                   {INV}, {});
        }
        // Each sequence's new tokens fit alone, but not all of them: nothing is appended to any.
        const int64_t tail1 = bt - 5, na = tail1 + bt, nb = before.free - bt + 1;
        REQUIRE(nb > 0);
        REQUIRE(sz((na + nb) * E) <= big);
        static std::vector<int64_t> ids2 = {1, 50}, qo2;
        qo2 = {0, na, na + nb};
        with("the new tokens of all sequences overflow the cache", [](auto &p) {
            p.seq_ids = ids2.data();
            p.q_offsets = qo2.data();
        }, {MHA_OUT_OF_MEMORY}, {});
        // And each alone does fit.
        std::vector<float> o(big);
        const std::vector<int64_t> only_b = {50}, qob = {0, nb};
        mha_layer_cached_params pb = good;
        pb.num_seqs = 1;
        pb.seq_ids = only_b.data();
        pb.q_offsets = qob.data();
        REQUIRE_MESSAGE(mha_layer_forward_cached(rt, lb.layer, c, &pb, x.data(), o.data()) == MHA_OK, mha_last_error());
        CHECK(c.seq_len(50) == nb);
        REQUIRE(mha_kv_cache_release(c, 50) == MHA_OK);
        // The good call itself is fine.
        REQUIRE_MESSAGE(mha_layer_forward_cached(rt, lb.layer, c, &good, x.data(), o.data()) == MHA_OK, mha_last_error());
        CHECK(c.seq_len(1) == 7);
        CHECK(c.seq_len(3) == 1);
    }
}

// ================================================================================================
// 6. Host threads sharing one cache
// ================================================================================================

TEST_CASE("8 host threads append to and attend over their own sequences of one cache, on one 2-thread runtime") {
    Rt rt(2, best_default());
    const Shape s{4, 2, 16, 16};
    const std::vector<int64_t> steps = {7, 1, 1, 13, 1, 1, 30, 1, 2, 1};
    int64_t total = 0;
    for (int64_t n : steps) total += n;
    constexpr int T = 8;
    const int64_t bt = block_tokens_for(rt, s);
    Cache c(rt, s, 2 * T * (total + bt));
    const int64_t all_free = c.free_tokens();
    std::vector<SeqData> data;
    for (int t = 0; t < T; ++t) data.emplace_back(s, total, 500 + 3 * static_cast<uint32_t>(t));

    // Appends and attends step by step; returns "" or what failed.
    auto run = [&](int64_t id, const SeqData &d, std::vector<float> &out) -> std::string {
        out.assign(sz(total * s.o_row()), test::kSentinel);
        int64_t pos = 0;
        for (int64_t n : steps) {
            if (mha_kv_cache_append(rt, c, id, n, d.k.data() + pos * s.k_row(), d.v.data() + pos * s.v_row()) != MHA_OK)
                return std::string("append: ") + mha_last_error();
            if (cached(rt, c, {id}, {0, n}, s.H, true, d.q.data() + pos * s.q_row(), out.data() + pos * s.o_row()) != MHA_OK)
                return std::string("attention: ") + mha_last_error();
            pos += n;
        }
        std::vector<float> k(sz(total * s.k_row())), v(sz(total * s.v_row()));
        if (mha_kv_cache_read(c, id, 0, total, k.data(), v.data()) != MHA_OK) return std::string("read: ") + mha_last_error();
        if (k != d.k || v != d.v) return "read back differs";
        return "";
    };
    std::vector<std::vector<float>> want(T);
    for (int t = 0; t < T; ++t) {
        REQUIRE(run(1000 + t, data[sz(t)], want[sz(t)]) == "");
        close_to(want[sz(t)].data(), reference(s, total, total, true, data[sz(t)].q.data(), data[sz(t)].k.data(), data[sz(t)].v.data()),
                 "sequential run vs reference");
        REQUIRE(mha_kv_cache_release(c, 1000 + t) == MHA_OK);
    }
    for (int round = 0; round < 3; ++round) {
        CAPTURE(round);
        std::vector<std::vector<float>> got(T);
        std::vector<std::string> err(T);
        std::vector<std::thread> threads;
        for (int t = 0; t < T; ++t)
            threads.emplace_back([&, t] {
                err[sz(t)] = run(100 + t, data[sz(t)], got[sz(t)]);
                if (err[sz(t)].empty() && mha_kv_cache_release(c, 100 + t) != MHA_OK) err[sz(t)] = "release failed";
            });
        for (auto &th : threads) th.join();
        for (int t = 0; t < T; ++t) {
            CAPTURE(t);
            CHECK(err[sz(t)] == "");
            CHECK(test::same_bits(got[sz(t)], want[sz(t)]));
        }
        CHECK(c.free_tokens() == all_free);
    }
}

TEST_CASE("8 host threads fork one shared prefix (mid-block) at once, diverge and attend, while the prefix is attended") {
    // Every fork shares the prefix's partial last block, so the first appends copy it on write
    // from 8 threads at once; the prefix itself is attended by every thread meanwhile.
    Rt rt(2, best_default());
    const Shape s{4, 2, 16, 16};
    constexpr int T = 8;
    const int64_t bt = block_tokens_for(rt, s), P = bt + bt / 2 + 3;  // mid-block
    const std::vector<int64_t> steps = {1, 5, 1, 1, 20, 1};
    int64_t own = 0;
    for (int64_t n : steps) own += n;
    const int64_t L = P + own;
    Cache c(rt, s, capacity(bt, {P}) + 2 * T * capacity(bt, {L}));
    const SeqData pre(s, P, 900);
    append(rt, c, s, 7, pre, 0, P);
    const auto q_pre = random_floats(sz(4 * s.q_row()), 901);
    // Sequence t: the prefix, then its own tokens; its data as one dense sequence.
    std::vector<SeqData> data;
    for (int t = 0; t < T; ++t) {
        data.emplace_back(s, L, 910 + 3 * static_cast<uint32_t>(t));
        std::copy(pre.k.begin(), pre.k.end(), data.back().k.begin());
        std::copy(pre.v.begin(), pre.v.end(), data.back().v.begin());
    }
    // The prefix's last 4 queries, non-causal, as every thread attends it.
    std::vector<float> want_pre(sz(4 * s.o_row()));
    REQUIRE(cached(rt, c, {7}, {0, 4}, s.H, false, q_pre.data(), want_pre.data()) == MHA_OK);

    auto run = [&](int64_t id, const SeqData &d, std::vector<float> &out, std::vector<float> &pre_out) -> std::string {
        out.assign(sz(own * s.o_row()), test::kSentinel);
        pre_out.assign(want_pre.size(), test::kSentinel);
        if (mha_kv_cache_fork(c, 7, id) != MHA_OK) return std::string("fork: ") + mha_last_error();
        int64_t pos = P;
        for (int64_t n : steps) {
            if (mha_kv_cache_append(rt, c, id, n, d.k.data() + pos * s.k_row(), d.v.data() + pos * s.v_row()) != MHA_OK)
                return std::string("append: ") + mha_last_error();
            if (cached(rt, c, {id}, {0, n}, s.H, true, d.q.data() + pos * s.q_row(), out.data() + (pos - P) * s.o_row()) != MHA_OK)
                return std::string("attention: ") + mha_last_error();
            if (cached(rt, c, {7}, {0, 4}, s.H, false, q_pre.data(), pre_out.data()) != MHA_OK)
                return std::string("attention over the prefix: ") + mha_last_error();
            pos += n;
        }
        std::vector<float> k(sz(L * s.k_row())), v(sz(L * s.v_row()));
        if (mha_kv_cache_read(c, id, 0, L, k.data(), v.data()) != MHA_OK) return std::string("read: ") + mha_last_error();
        if (k != d.k || v != d.v) return "read back differs";
        return "";
    };
    // Alone, one after the other; each against mha_attention on its dense K/V.
    std::vector<std::vector<float>> want(T);
    for (int t = 0; t < T; ++t) {
        std::vector<float> pre_out;
        REQUIRE(run(2000 + t, data[sz(t)], want[sz(t)], pre_out) == "");
        const SeqData &d = data[sz(t)];
        same_rows(want[sz(t)].data(), dense(rt, s, L, L, true, d.q.data(), d.k.data(), d.v.data()).data() + P * s.o_row(), own,
                  s.o_row(), "forked sequence vs mha_attention", P);
        REQUIRE(mha_kv_cache_release(c, 2000 + t) == MHA_OK);
    }
    const int64_t free_before = c.free_tokens();
    for (int round = 0; round < 3; ++round) {
        CAPTURE(round);
        std::vector<std::vector<float>> got(T), got_pre(T);
        std::vector<std::string> err(T);
        std::vector<std::thread> threads;
        for (int t = 0; t < T; ++t)
            threads.emplace_back([&, t] {
                err[sz(t)] = run(100 + t, data[sz(t)], got[sz(t)], got_pre[sz(t)]);
                if (err[sz(t)].empty() && mha_kv_cache_release(c, 100 + t) != MHA_OK) err[sz(t)] = "release failed";
            });
        for (auto &th : threads) th.join();
        for (int t = 0; t < T; ++t) {
            CAPTURE(t);
            CHECK(err[sz(t)] == "");
            CHECK(test::same_bits(got[sz(t)], want[sz(t)]));
            CHECK(test::same_bits(got_pre[sz(t)], want_pre));
        }
        CHECK(c.seq_len(7) == P);
        CHECK(c.free_tokens() == free_before);
        std::vector<float> k, v;
        c.read(7, 0, P, s, k, v);
        CHECK(test::same_bits(k, pre.k));
        CHECK(test::same_bits(v, pre.v));
    }
}
