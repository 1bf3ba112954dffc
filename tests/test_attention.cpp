// Fused attention against the double-precision definition: cross attention, GQA/MQA, Dv != Dqk,
// odd sizes, causal with Lq != Lk, valid lengths including 0, broadcast and full masks, weights;
// on every ISA, with the default tiles and with tiny tiles that put edges everywhere. Then
// determinism (threads, batch), concurrency and bad input.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <iterator>
#include <xmmintrin.h>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <thread>

#include "attention/attention_shape.hpp"
#include "mha/attention.hpp"
#include "mha/mha.h"
#include "reference.hpp"
#include "runtime/runtime_state.hpp"
#include "test_util.hpp"

using namespace mha;

namespace {

struct Case {
    const char *what;
    int64_t B, Lq, Lk, H, Hkv, D, Dv;
    bool causal = false;
    int valid = 0;      // 0: none; 1: per-batch lengths including 0
    int mask = 0;       // 0: none; 1: [B, 1, Lk] broadcast over queries; 2: full [B, Lq, Lk]; 3: [1, Lq, Lk] over batches
    bool weights = false;
};

std::vector<RuntimeOptions> runtimes(int threads) {
    std::vector<RuntimeOptions> v;
    for (Isa isa : supported_isas()) {
        RuntimeOptions o{threads, isa, {}, {}};
        v.push_back(o);
        TileConfig t = default_tile_config(isa, detect_cache_sizes());
        t.attn_block_q = 5;  // tiny tiles: every edge, many tiles per row
        t.attn_block_k = 7;
        t.attn_kv_chunk = 14;  // many chunks: the merge of chunk states is exercised too
        o.tiles = t;
        v.push_back(o);
    }
    return v;
}

struct Data {
    std::vector<float> q, k, v;
    std::vector<int32_t> valid;
    std::vector<uint8_t> mask;
    ref::AttentionCase rc;
    AttentionParams p;
};

Data make(const Case &c, uint32_t seed) {
    Data d;
    d.q = test::random_floats(static_cast<size_t>(c.B * c.Lq * c.H * c.D), seed);
    d.k = test::random_floats(static_cast<size_t>(c.B * c.Lk * c.Hkv * c.D), seed + 1);
    d.v = test::random_floats(static_cast<size_t>(c.B * c.Lk * c.Hkv * c.Dv), seed + 2);
    d.p.batch = c.B;
    d.p.q_len = c.Lq;
    d.p.kv_len = c.Lk;
    d.p.num_heads = c.H;
    d.p.num_kv_heads = c.Hkv;
    d.p.head_dim = c.D;
    d.p.value_dim = c.Dv;
    d.p.causal = c.causal;
    d.rc = {c.B, c.Lq, c.Lk, c.H, c.Hkv, c.D, c.Dv, 1.0 / std::sqrt(static_cast<double>(c.D)), c.causal};
    if (c.valid) {
        for (int64_t b = 0; b < c.B; ++b) d.valid.push_back(static_cast<int32_t>(b == 0 ? 0 : (b * 7 + 3) % (c.Lk + 1)));
        d.p.kv_valid_lens = d.rc.valid = d.valid.data();
    }
    if (c.mask) {
        const int64_t rows = c.mask == 1 ? 1 : c.Lq, batches = c.mask == 3 ? 1 : c.B;
        d.mask.resize(static_cast<size_t>(batches * rows * c.Lk));
        for (size_t i = 0; i < d.mask.size(); ++i) d.mask[i] = ((i * 2654435761u) >> 7) % 4 != 0;
        d.p.mask = d.rc.mask = d.mask.data();
        d.p.mask_row_stride = d.rc.mrs = c.mask == 1 ? 0 : c.Lk;
        d.p.mask_batch_stride = d.rc.mbs = c.mask == 3 ? 0 : rows * c.Lk;
    }
    return d;
}

// Output and weights of one run.
struct Result {
    std::vector<float> out, w;
};

Result run(Runtime &rt, const Case &c, Data &d) {
    Result r{std::vector<float>(static_cast<size_t>(c.B * c.Lq * c.H * c.Dv)),
             std::vector<float>(static_cast<size_t>(c.B * c.H * c.Lq * c.Lk))};
    d.p.weights = r.w.data();
    attention(rt, d.p, d.q.data(), d.k.data(), d.v.data(), r.out.data());
    d.p.weights = nullptr;
    return r;
}

// The same problem on 1 and 2 threads of these options must give the same bits.
Result check_same_bits_1_2_threads(const Case &c, Data &d, RuntimeOptions o) {
    o.num_threads = 1;
    Runtime r1(o);
    o.num_threads = 2;
    Runtime r2(o);
    const Result a = run(r1, c, d), b = run(r2, c, d);
    CHECK(test::same_bits(a.out, b.out));
    CHECK(test::same_bits(a.w, b.w));
    return a;
}

void check(const Case &c, const RuntimeOptions &o) {
    Runtime rt(o);
    Data d = make(c, 11);
    std::vector<float> out(static_cast<size_t>(c.B * c.Lq * c.H * c.Dv), test::kSentinel), w;
    if (c.weights) {
        w.assign(static_cast<size_t>(c.B * c.H * c.Lq * c.Lk), test::kSentinel);
        d.p.weights = w.data();
    }
    attention(rt, d.p, d.q.data(), d.k.data(), d.v.data(), out.data());
    std::vector<double> want, want_w;
    ref::attention(d.rc, d.q.data(), d.k.data(), d.v.data(), want, c.weights ? &want_w : nullptr);
    int bad = 0;
    for (size_t i = 0; i < out.size(); ++i)
        if (!(std::fabs(out[i] - want[i]) <= 5e-5) && bad++ < 3)
            FAIL_CHECK(c.what << " out[" << i << "] = " << out[i] << ", want " << want[i]);
    for (size_t i = 0; i < w.size(); ++i)
        if (!(std::fabs(w[i] - want_w[i]) <= 5e-5) && bad++ < 6)
            FAIL_CHECK(c.what << " weights[" << i << "] = " << w[i] << ", want " << want_w[i]);
    CHECK_MESSAGE(bad == 0, c.what);
}

const Case kCases[] = {
    {"self, MHA", 2, 37, 37, 4, 4, 16, 16},
    {"cross, several key tiles", 2, 5, 300, 2, 2, 64, 32},
    {"GQA", 2, 19, 23, 8, 2, 32, 32},
    {"MQA", 1, 9, 40, 4, 1, 32, 48},
    {"Dv != Dqk", 1, 13, 17, 2, 1, 24, 40},
    {"odd head dims", 2, 6, 11, 3, 3, 3, 5},
    {"head dims past a register tile", 1, 4, 9, 2, 2, 65, 33},
    {"causal, Lq == Lk", 2, 30, 30, 2, 1, 16, 16, true},
    {"causal, Lq < Lk (KV cache)", 2, 7, 20, 4, 2, 16, 8, true},
    {"causal, Lq > Lk: early rows see nothing", 1, 12, 5, 2, 2, 8, 8, true},
    {"valid lengths including 0", 3, 8, 19, 2, 2, 16, 16, false, 1},
    {"mask broadcast over queries (seed 000)", 2, 9, 14, 2, 2, 16, 16, false, 0, 1},
    {"full mask [B, Lq, Lk]", 2, 9, 14, 2, 1, 16, 16, false, 0, 2},
    {"mask broadcast over batches", 3, 9, 14, 2, 2, 16, 16, false, 0, 3},
    {"all masks at once", 3, 11, 16, 4, 2, 8, 12, true, 1, 2},
    {"weights", 2, 10, 13, 4, 2, 16, 8, false, 0, 0, true},
    {"weights with masks and causal", 3, 9, 12, 2, 1, 8, 8, true, 1, 2, true},
    {"decode: one query", 3, 1, 50, 8, 2, 32, 32, true, 1},
};

} // namespace

TEST_CASE("attention against double: every feature and combination, every ISA, two tilings") {
    for (const auto &o : runtimes(1))
        for (const auto &c : kCases) {
            CAPTURE(std::string(isa_name(*o.isa)));
            CAPTURE(o.tiles.has_value());
            check(c, o);
        }
}

TEST_CASE("the direct path (few rows per KV head): edge tiles of keys, head dims and rows, every ISA") {
    // Rows per KV head (G x Lq) of 1, 3, 4, 5, 8 and 12 (kDirectRows) against its 4-row blocks;
    // head dims and key counts around its tiles: 16 keys per tile, one vector (8 or 16 lanes) per
    // key dot product, 4 vectors of V per block.
    const std::pair<int64_t, int64_t> rows[] = {{1, 1}, {3, 1}, {4, 1}, {8, 1}, {2, 2}, {4, 2}, {5, 1}, {4, 3}, {6, 2}};
    const int64_t dims[] = {1, 15, 16, 17, 33}, vdims[] = {1, 31, 64, 65, 129}, lens[] = {1, 15, 16, 17, 50};
    int n = 0;
    for (const auto &o : runtimes(1))
        for (auto [G, Lq] : rows)
            for (int64_t D : dims)
                for (int64_t Dv : vdims) {
                    ++n;
                    const Case c{"direct", 2, Lq, lens[n % 5], 2 * G, 2, D, Dv, n % 2 == 0, n % 3 == 0 ? 1 : 0,
                                 n % 4 == 1 ? 2 : 0, n % 5 == 0};
                    CAPTURE(std::string(isa_name(*o.isa)));
                    CAPTURE(o.tiles.has_value());
                    CAPTURE(G);
                    CAPTURE(Lq);
                    CAPTURE(c.Lk);
                    CAPTURE(D);
                    CAPTURE(Dv);
                    check(c, o);
                }
}

TEST_CASE("keys split over threads: chunks on different threads, same bits as one thread") {
    // One KV head: decode (the direct path, whose keys are always split) and one block of 20
    // queries (the packed path: a single work item, so only two threads split its key chunks,
    // while one thread walks them into its running state).
    for (const Case &c : {Case{"decode split", 1, 1, 3000, 4, 1, 64, 64, true, 0, 0, true},
                         Case{"query block split", 1, 20, 3000, 4, 1, 64, 40, true, 0, 1, true}}) {
        CAPTURE(c.what);
        Data d = make(c, 21);
        for (const auto &o : runtimes(1)) {
            const Result r = check_same_bits_1_2_threads(c, d, o);
            std::vector<double> want;
            ref::attention(d.rc, d.q.data(), d.k.data(), d.v.data(), want);
            for (size_t i = 0; i < r.out.size(); ++i) CHECK(std::fabs(r.out[i] - want[i]) <= 5e-5);
        }
    }
}

TEST_CASE("a decode of one sequence: its KV heads or its key chunks split over threads, same bits as one thread") {
    // A direct item whose KV heads share out over the threads that pay more evenly than its key
    // chunks is cut into groups of its KV heads, one a thread (run_attention): 1 to 4 groups, even
    // and uneven (6 KV heads on 2 and 4 threads, 3 on 2), one or two queries, keys from 1 to one
    // chunk, past it unevenly (1500: chunks of 1024 and 476) and evenly (2048, 4 KV heads: the
    // chunks stay on 2 threads), none (valid length 0: zeros), a key mask, weights.
    for (const Case &c : {Case{"H8/8 1 key", 1, 1, 1, 8, 8, 64, 40, false, 0, 0, true},
                          Case{"H8/8", 1, 1, 300, 8, 8, 64, 40, true, 0, 0, true},
                          Case{"H8/2 two queries", 1, 2, 1024, 8, 2, 32, 64, true, 0, 2, true},
                          Case{"H6/6", 1, 1, 700, 6, 6, 16, 24, false, 0, 1, false},
                          Case{"H6/3", 1, 2, 129, 6, 3, 64, 64, true, 0, 0, true},
                          Case{"H8/8 1500 keys", 1, 1, 1500, 8, 8, 16, 16, true, 0, 1, false},
                          Case{"H4/4 2048 keys", 1, 1, 2048, 4, 4, 16, 8, false, 0, 0, false},
                          Case{"H8/8 no valid key", 1, 1, 300, 8, 8, 16, 16, false, 1, 0, true}}) {
        CAPTURE(c.what);
        Data d = make(c, 23);
        for (const auto &o : runtimes(1)) {
            CAPTURE(std::string(isa_name(*o.isa)));
            const Result one = check_same_bits_1_2_threads(c, d, o);
            for (int threads : {3, 4}) {
                RuntimeOptions more = o;
                more.num_threads = threads;
                Runtime rt(more);
                const Result r = run(rt, c, d);
                CHECK_MESSAGE(test::same_bits(one.out, r.out), threads, " threads");
                CHECK_MESSAGE(test::same_bits(one.w, r.w), threads, " threads");
            }
            std::vector<double> want;
            ref::attention(d.rc, d.q.data(), d.k.data(), d.v.data(), want);
            for (size_t i = 0; i < one.out.size(); ++i) CHECK(std::fabs(one.out[i] - want[i]) <= 5e-5);
        }
    }
}

TEST_CASE("golden files from PyTorch (tests/data/gen_attention_golden.py)") {
    for (const char *name : {"self_mask_b1l", "cross_valid_lens", "causal_kvcache_gqa", "dv_ne_dqk_full_mask"}) {
        CAPTURE(name);
        std::ifstream f(std::string(MHA_TEST_DATA) + "/attention_" + name + ".txt");
        REQUIRE(f.good());
        int64_t B, Lq, Lk, H, Hkv, D, Dv;
        int causal, has_valid, mask_kind;
        f >> B >> Lq >> Lk >> H >> Hkv >> D >> Dv >> causal >> has_valid >> mask_kind;
        auto read = [&](size_t n) {
            std::vector<double> x(n);
            for (auto &e : x) f >> e;
            REQUIRE(f.good());
            return x;
        };
        auto to_float = [](const std::vector<double> &x) { return std::vector<float>(x.begin(), x.end()); };
        const auto q = to_float(read(static_cast<size_t>(B * Lq * H * D)));
        const auto k = to_float(read(static_cast<size_t>(B * Lk * Hkv * D)));
        const auto v = to_float(read(static_cast<size_t>(B * Lk * Hkv * Dv)));
        std::vector<int32_t> valid;
        std::vector<uint8_t> mask;
        if (has_valid)
            for (double x : read(static_cast<size_t>(B))) valid.push_back(static_cast<int32_t>(x));
        if (mask_kind)
            for (double x : read(static_cast<size_t>(B * (mask_kind == 1 ? 1 : Lq) * Lk))) mask.push_back(x != 0);
        const auto want = read(static_cast<size_t>(B * Lq * H * Dv));
        const auto want_w = read(static_cast<size_t>(B * H * Lq * Lk));
        for (Isa isa : supported_isas()) {
            Runtime rt(RuntimeOptions{1, isa, {}, {}});
            AttentionParams p;
            p.batch = B; p.q_len = Lq; p.kv_len = Lk; p.num_heads = H; p.num_kv_heads = Hkv;
            p.head_dim = D; p.value_dim = Dv; p.causal = causal != 0;
            if (has_valid) p.kv_valid_lens = valid.data();
            if (mask_kind) {
                p.mask = mask.data();
                p.mask_row_stride = mask_kind == 1 ? 0 : Lk;
                p.mask_batch_stride = (mask_kind == 1 ? 1 : Lq) * Lk;
            }
            std::vector<float> out(want.size()), w(want_w.size());
            p.weights = w.data();
            attention(rt, p, q.data(), k.data(), v.data(), out.data());
            for (size_t i = 0; i < out.size(); ++i) CHECK(std::fabs(out[i] - want[i]) <= 1e-5);
            for (size_t i = 0; i < w.size(); ++i) CHECK(std::fabs(w[i] - want_w[i]) <= 1e-5);
        }
    }
}

TEST_CASE("Q packed in panels for blocks that walk three key tiles or more: the bits of Q read in place") {
    // Without weights a query block that walks more than two key tiles packs its Q into one panel
    // per register panel (FusedAttention::q_panels); with weights every block reads Q in place (or
    // from its copy). The outputs must agree bit for bit: same chains, other operand layout. Tiny
    // tiles (7 keys) send nearly every case through the panels; the default tiles the longer ones.
    const Case extra[] = {{"one head, long keys", 2, 40, 900, 2, 2, 64, 32, false, 1},
                          {"GQA, long keys, causal", 1, 33, 700, 4, 1, 32, 16, true, 0, 2},
                          {"MHA D128", 1, 20, 600, 2, 2, 128, 128},
                          // H8 D128: Q's rows 4 KiB apart, copied when read by more than one tile
                          {"rows 4 KiB apart, long keys", 1, 20, 600, 8, 8, 128, 24, true},
                          {"rows 4 KiB apart, one tile", 2, 20, 40, 8, 8, 128, 24}};
    std::vector<Case> cases(std::begin(kCases), std::end(kCases));
    cases.insert(cases.end(), std::begin(extra), std::end(extra));
    for (const auto &o : runtimes(2)) {
        Runtime rt(o);
        for (const auto &c : cases) {
            CAPTURE(std::string(isa_name(*o.isa)));
            CAPTURE(o.tiles.has_value());
            CAPTURE(c.what);
            Data d = make(c, 29);
            std::vector<float> packed(static_cast<size_t>(c.B * c.Lq * c.H * c.Dv), test::kSentinel);
            attention(rt, d.p, d.q.data(), d.k.data(), d.v.data(), packed.data());
            const Result in_place = run(rt, c, d);  // with weights
            CHECK(test::same_bits(packed, in_place.out));
        }
    }
}

TEST_CASE("K^T's pack: both register transposes (shuffles, inserts) give the same bits, every ISA") {
    // The transposing pack (gemm/sgemm_pack.hpp) takes the runtime's register transpose
    // (TileConfig::transpose, gemm/transpose_variant.hpp); both must move the same floats.
    // kCases' head dims lie below, at and past a 16- and an 8-deep block (3 to 65), and their keys
    // cut the panels anywhere; two more cases take whole blocks and many rows.
    const Case extra[] = {{"H8 D128, keys past a panel", 1, 20, 70, 8, 8, 128, 128},
                          {"D40, causal, several tiles", 2, 30, 300, 2, 2, 40, 24, true}};
    std::vector<Case> cases(std::begin(kCases), std::end(kCases));
    cases.insert(cases.end(), std::begin(extra), std::end(extra));
    for (const auto &o : runtimes(1)) {
        const test::BothTransposes both{Runtime(o)};
        for (const auto &c : cases) {
            CAPTURE(std::string(isa_name(*o.isa)));
            CAPTURE(o.tiles.has_value());
            CAPTURE(c.what);
            Data d = make(c, 31);
            std::vector<float> out[2];
            for (int v = 0; v < 2; ++v) {
                out[v].assign(static_cast<size_t>(c.B * c.Lq * c.H * c.Dv), test::kSentinel);
                attention(*both.rt[v], d.p, d.q.data(), d.k.data(), d.v.data(), out[v].data());
            }
            CHECK(test::same_bits(out[0], out[1]));
        }
    }
}

TEST_CASE("the unfused path (GEMM, softmax, GEMM) agrees with the fused one") {
    Runtime rt(RuntimeOptions{2, {}, {}, {}});
    for (const auto &c : kCases) {
        CAPTURE(c.what);
        Data d = make(c, 17);
        const size_t n = static_cast<size_t>(c.B * c.Lq * c.H * c.Dv), nw = static_cast<size_t>(c.B * c.H * c.Lq * c.Lk);
        std::vector<float> fused(n), unfused(n), wf(nw), wu(nw);
        d.p.weights = wf.data();
        attention(rt, d.p, d.q.data(), d.k.data(), d.v.data(), fused.data());
        d.p.weights = wu.data();
        attention_unfused(rt, d.p, d.q.data(), d.k.data(), d.v.data(), unfused.data());
        for (size_t i = 0; i < n; ++i) CHECK(std::fabs(fused[i] - unfused[i]) <= 5e-5);
        for (size_t i = 0; i < nw; ++i) CHECK(std::fabs(wf[i] - wu[i]) <= 5e-5);
    }
}

TEST_CASE("empty problems and kv_len == 0") {
    Runtime rt(RuntimeOptions{1, {}, {}, {}});
    AttentionParams p;
    p.batch = 2; p.q_len = 3; p.kv_len = 0; p.num_heads = 2; p.num_kv_heads = 1; p.head_dim = 4; p.value_dim = 4;
    std::vector<float> q(48, 1.0f), out(48, test::kSentinel);
    attention(rt, p, q.data(), nullptr, nullptr, out.data());
    for (float x : out) CHECK(x == 0.0f);
    p.batch = 0;
    attention(rt, p, nullptr, nullptr, nullptr, nullptr);
}

// Subnormal floats count as zero inside the attention (MXCSR's FTZ and DAZ on every thread that
// runs its tasks: on Intel cores an FMA on a subnormal costs a microcode assist, see
// simd/flush_denormals.hpp), and the caller's floating-point mode is what it was afterwards.
TEST_CASE("subnormals count as zero, and the caller's MXCSR is kept") {
    constexpr float kTiny = 1e-40f;  // subnormal: below FLT_MIN = 1.18e-38
    REQUIRE(std::fpclassify(kTiny) == FP_SUBNORMAL);
    for (Isa isa : supported_isas())
        for (int threads : {1, 2})
            for (int64_t Lq : {1, 40}) {  // the direct path and the packed one
                CAPTURE(isa_name(isa));
                CAPTURE(threads);
                CAPTURE(Lq);
                Runtime rt(RuntimeOptions{threads, isa, {}, {}});
                AttentionParams p;
                p.batch = 2; p.q_len = Lq; p.kv_len = 1; p.num_heads = 2; p.num_kv_heads = 2; p.head_dim = 8;
                p.value_dim = 24;
                // One key and Q = 0: every score 0, P = 1, so each output row is its head's V row exactly.
                std::vector<float> q(static_cast<size_t>(2 * Lq * 2 * 8), 0.0f), k(2 * 2 * 8, 0.25f), v(2 * 2 * 24);
                for (size_t i = 0; i < v.size(); ++i) v[i] = i % 5 == 0 ? kTiny : 0.5f + static_cast<float>(i);
                std::vector<float> out(static_cast<size_t>(2 * Lq * 2 * 24), test::kSentinel);
                for (unsigned mode : {0x1F80u, 0x9FC0u}) {  // the default, and with FTZ and DAZ already on
                    _mm_setcsr(mode);
                    attention(rt, p, q.data(), k.data(), v.data(), out.data());
                    CHECK((_mm_getcsr() & ~0x3Fu) == mode);  // the control bits (0-5 are sticky status flags)
                    _mm_setcsr(0x1F80u);
                    for (int64_t b = 0; b < 2; ++b)
                        for (int64_t i = 0; i < Lq; ++i)
                            for (int64_t c = 0; c < 2 * 24; ++c) {
                                const float want = v[static_cast<size_t>(b * 48 + c)];
                                CHECK(out[static_cast<size_t>((b * Lq + i) * 48 + c)] == (want == kTiny ? 0.0f : want));
                            }
                }
            }
}

TEST_CASE("same bits on 1 and 2 threads, and for a sequence alone or inside a batch") {
    // Query blocks on the packed path, and decode on the direct path (all KV heads in one item,
    // its keys split into chunks).
    for (const Case &c : {Case{"det", 3, 70, 90, 4, 2, 32, 32, true, 1, 2, true},
                         Case{"det decode", 3, 1, 2500, 8, 2, 40, 24, true, 1, 2, true}}) {
        CAPTURE(c.what);
        Data d = make(c, 5);
        const size_t n_out = static_cast<size_t>(c.B * c.Lq * c.H * c.Dv), n_w = static_cast<size_t>(c.B * c.H * c.Lq * c.Lk);
        for (Isa isa : supported_isas()) {
            const Result all = check_same_bits_1_2_threads(c, d, RuntimeOptions{1, isa, {}, {}});
            Runtime r2(RuntimeOptions{2, isa, {}, {}});
            // Batch element 2 alone.
            AttentionParams one = d.p;
            one.batch = 1;
            one.kv_valid_lens = d.valid.data() + 2;
            one.mask = d.mask.data() + 2 * d.p.mask_batch_stride;
            std::vector<float> alone(n_out / 3), walone(n_w / 3);
            one.weights = walone.data();
            const size_t qoff = 2 * static_cast<size_t>(c.Lq * c.H * c.D), koff = 2 * static_cast<size_t>(c.Lk * c.Hkv * c.D);
            attention(r2, one, d.q.data() + qoff, d.k.data() + koff, d.v.data() + 2 * static_cast<size_t>(c.Lk * c.Hkv * c.Dv),
                      alone.data());
            CHECK(std::equal(alone.begin(), alone.end(), all.out.begin() + 2 * static_cast<long>(n_out / 3)));
            CHECK(std::equal(walone.begin(), walone.end(), all.w.begin() + 2 * static_cast<long>(n_w / 3)));
        }
    }
}

TEST_CASE("strips with cached K/V tiles (1 thread) give the same bits as single query blocks (2 threads)") {
    // B * Hkv = 2: one thread runs whole (batch, KV head) strips, two threads run query blocks.
    const Case c{"strips", 1, 300, 333, 4, 2, 32, 24, true, 1, 2, true};
    Data d = make(c, 31);
    for (const auto &o : runtimes(1)) check_same_bits_1_2_threads(c, d, o);
}

TEST_CASE("token strides: q, k, v and out read from and written into wider rows, same bits as dense") {
    const Case c{"strided", 2, 13, 21, 4, 2, 16, 12, true, 1, 2, true};
    for (const RuntimeOptions &o : runtimes(2)) {
        Runtime rt(o);
        Data d = make(c, 5);
        const Result dense = run(rt, c, d);
        // Each tensor's token rows padded by a few floats, as in the fused QKV projection output.
        const int64_t Tq = c.B * c.Lq, Tk = c.B * c.Lk, wq = c.H * c.D, wk = c.Hkv * c.D, wv = c.Hkv * c.Dv,
                      wo = c.H * c.Dv, lq = wq + 3, lk = wk + 5, lv = wv + 1, lo = wo + 7;
        auto widen = [](const std::vector<float> &x, int64_t rows, int64_t w, int64_t ld) {
            std::vector<float> y(static_cast<size_t>(rows * ld), test::kSentinel);
            for (int64_t r = 0; r < rows; ++r)
                std::copy(x.begin() + r * w, x.begin() + (r + 1) * w, y.begin() + r * ld);
            return y;
        };
        const auto q = widen(d.q, Tq, wq, lq), k = widen(d.k, Tk, wk, lk), v = widen(d.v, Tk, wv, lv);
        std::vector<float> out(static_cast<size_t>(Tq * lo), test::kSentinel), w(dense.w.size());
        AttentionParams p = d.p;
        p.q_stride = lq;
        p.k_stride = lk;
        p.v_stride = lv;
        p.out_stride = lo;
        p.weights = w.data();
        attention(rt, p, q.data(), k.data(), v.data(), out.data());
        bool same = true, pad_kept = true;
        for (int64_t r = 0; r < Tq; ++r) {
            same &= std::memcmp(out.data() + r * lo, dense.out.data() + r * wo, static_cast<size_t>(wo) * 4) == 0;
            for (int64_t j = wo; j < lo; ++j) pad_kept &= out[static_cast<size_t>(r * lo + j)] == test::kSentinel;
        }
        CHECK(same);
        CHECK(pad_kept);
        CHECK(test::same_bits(w, dense.w));
        std::vector<float> out2(out.size(), test::kSentinel);
        attention_unfused(rt, p, q.data(), k.data(), v.data(), out2.data());
        double worst = 0;
        for (size_t i = 0; i < out.size(); ++i) worst = std::max(worst, std::fabs(static_cast<double>(out[i]) - out2[i]));
        CHECK(worst <= 1e-5);
        for (auto [name, field] : {std::pair{"q_stride", &AttentionParams::q_stride}, {"k_stride", &AttentionParams::k_stride},
                                   {"v_stride", &AttentionParams::v_stride}, {"out_stride", &AttentionParams::out_stride}}) {
            AttentionParams bad = p;
            bad.*field = 1;  // narrower than a token's row
            CHECK_THROWS_WITH_AS(attention(rt, bad, q.data(), k.data(), v.data(), out.data()),
                                 doctest::Contains((std::string(name) + " = 1 is too small").c_str()), Error);
            bad.*field = -4;
            CHECK_THROWS_AS(attention(rt, bad, q.data(), k.data(), v.data(), out.data()), Error);
            bad.*field = INT64_MAX / 2;
            CHECK_THROWS_WITH_AS(attention(rt, bad, q.data(), k.data(), v.data(), out.data()),
                                 doctest::Contains("overflow"), Error);
        }
    }
}

TEST_CASE("scratch at Lk = 16384 stays under 32 MB, on 1 and 2 threads") {
    // The scratch of a query block does not depend on Lq (only whether a (batch, KV head) strip
    // keeps its packed K/V, capped at 8 MiB per thread, and that needs Lq > the query block), so
    // Lq = 160 with Lk = 16384 holds what L = 16384 self-attention would, at 1% of its work.
    // Decode adds the chunk states (m, l, acc per 1024 keys per row).
    for (int threads : {1, 2}) {
        if (test::reduced() && threads == 1) continue;  // tools/tsan: one thread has nothing to race
        Runtime rt(RuntimeOptions{threads, {}, {}, {}});
        for (const Case &c : {Case{"long", 1, 160, 16384, 8, 8, 64, 64, true},
                             Case{"long GQA D128", 2, 160, 16384, 8, 2, 128, 128, true},
                             Case{"long decode", 2, 1, 16384, 8, 2, 128, 128, true}}) {
            CAPTURE(c.what);
            Data d = make(c, 3);
            std::vector<float> out(static_cast<size_t>(c.B * c.Lq * c.H * c.Dv));
            attention(rt, d.p, d.q.data(), d.k.data(), d.v.data(), out.data());
            CHECK(rt.scratch_bytes() > 0);
            CHECK(rt.scratch_bytes() < size_t{32} << 20);
            // Batch 0's last query (it sees every key) against a double reference; all rows would
            // take too long under the sanitizers.
            ref::AttentionCase last = d.rc;
            last.B = 1;
            last.Lq = 1;
            std::vector<double> want;
            ref::attention(last, d.q.data() + (c.Lq - 1) * c.H * c.D, d.k.data(), d.v.data(), want);
            const float *got = out.data() + (c.Lq - 1) * c.H * c.Dv;
            for (size_t i = 0; i < want.size(); ++i) CHECK(std::fabs(got[i] - want[i]) <= 5e-5);
        }
    }
}

TEST_CASE("a windowed strip keeps only the tiles its windows span, with the bits of per-block items") {
    // The bookkeeping: tiles [lo, ready), packed in a row since the last jump.
    using attention_detail::TileRing;
    TileRing r;
    for (int64_t t = 0; t < 3; ++t) r.packed(3, t);
    for (int64_t t = 0; t < 3; ++t) CHECK(r.holds(t));
    r.packed(3, 3);  // a ring of 3: tile 3 takes tile 0's slot
    CHECK(TileRing::slot(3, 3) == 0);
    CHECK(!r.holds(0));
    CHECK((r.holds(1) && r.holds(2) && r.holds(3) && !r.holds(4)));
    r.packed(3, 0);  // back to tile 0 (the weights' pass): only it is held
    CHECK((r.holds(0) && !r.holds(1) && !r.holds(3)));
    r.packed(3, 1);
    CHECK((r.holds(0) && r.holds(1)));
    r.packed(3, 5);  // a jump forward
    CHECK((r.holds(5) && !r.holds(4) && !r.holds(1)));
    TileRing all;    // no ring: one slot per tile, every tile below ready held
    all.packed(0, 2);
    CHECK((all.holds(0) && all.holds(2) && !all.holds(3)));
    CHECK(TileRing::slot(0, 7) == 7);

    // Two (batch, KV head) strips on one thread keep their tiles; with a window of 256 keys a block
    // of 112 rows spans 3 tiles of 256, so the strip holds 3 tiles, not the 17 of 4096 keys
    // (2.2 MiB of packed K and V at D64). Two threads run per-block items instead (no strip
    // cache): the same bits.
    Case c{"window ring", 1, 4096, 4096, 2, 2, 64, 64, true};
    Data d = make(c, 41);
    d.p.variant.window = 256;
    std::vector<float> one(static_cast<size_t>(c.Lq * c.H * c.Dv)), two(one.size());
    {
        Runtime r1(RuntimeOptions{1, {}, {}, {}});
        attention(r1, d.p, d.q.data(), d.k.data(), d.v.data(), one.data());
        CHECK(r1.scratch_bytes() < size_t{1} << 20);
    }
    Runtime r2(RuntimeOptions{2, {}, {}, {}});
    attention(r2, d.p, d.q.data(), d.k.data(), d.v.data(), two.data());
    CHECK(one == two);
    // Rows near the start, in the middle and at the end against double (query i alone, with keys
    // 0..i: its position stays i).
    for (int64_t i : {int64_t{0}, int64_t{700}, c.Lq - 1}) {
        ref::AttentionCase row = d.rc;
        row.Lq = 1;
        row.Lk = i + 1;
        row.window = 256;
        std::vector<double> want;
        ref::attention(row, d.q.data() + i * c.H * c.D, d.k.data(), d.v.data(), want);
        for (int64_t x = 0; x < c.H * c.Dv; ++x)
            CHECK(std::fabs(one[static_cast<size_t>(i * c.H * c.Dv + x)] - want[static_cast<size_t>(x)]) <= 5e-5);
    }
}

TEST_CASE("8 host threads share one runtime") {
    const Case c{"conc", 2, 33, 41, 4, 2, 16, 16, true};
    Data d = make(c, 8);
    Runtime rt(RuntimeOptions{2, {}, {}, {}});
    const size_t n = static_cast<size_t>(c.B * c.Lq * c.H * c.Dv);
    std::vector<float> want(n);
    attention(rt, d.p, d.q.data(), d.k.data(), d.v.data(), want.data());
    std::vector<std::vector<float>> got(8, std::vector<float>(n));
    std::vector<std::thread> threads;
    for (int t = 0; t < 8; ++t)
        threads.emplace_back([&, t] {
            for (int rep = 0; rep < 5; ++rep) attention(rt, d.p, d.q.data(), d.k.data(), d.v.data(), got[t].data());
        });
    for (auto &th : threads) th.join();
    for (int t = 0; t < 8; ++t) CHECK(test::same_bits(got[t], want));
}

TEST_CASE("runtimes of one thread count share one arena; 8 host threads on 4 runtimes get the same bits") {
    const Case c{"shared", 2, 33, 41, 4, 2, 16, 16, true};
    Data d = make(c, 9);
    const size_t n = static_cast<size_t>(c.B * c.Lq * c.H * c.Dv);
    std::vector<float> want(n);
    {
        Runtime one(RuntimeOptions{1, {}, {}, {}});
        attention(one, d.p, d.q.data(), d.k.data(), d.v.data(), want.data());
    }
    std::vector<std::unique_ptr<Runtime>> rts;
    for (int threads : {2, 2, 3, 3}) rts.push_back(std::make_unique<Runtime>(RuntimeOptions{threads, {}, {}, {}}));
    CHECK(rts[0]->state().arena == rts[1]->state().arena);
    CHECK(rts[2]->state().arena == rts[3]->state().arena);
    CHECK(rts[0]->state().arena != rts[2]->state().arena);
    CHECK(rts[0]->state().arena->max_concurrency() == 2);
    CHECK(rts[2]->state().arena->max_concurrency() == 3);
    std::vector<std::vector<float>> got(8, std::vector<float>(n));
    std::vector<std::thread> threads;
    for (int t = 0; t < 8; ++t)
        threads.emplace_back([&, t] {
            for (int rep = 0; rep < 5; ++rep) attention(*rts[t % 4], d.p, d.q.data(), d.k.data(), d.v.data(), got[t].data());
        });
    for (auto &th : threads) th.join();
    for (int t = 0; t < 8; ++t) CHECK(test::same_bits(got[t], want));
    // The arena outlives neither its runtimes nor the last of them: a new runtime gets a new one.
    std::weak_ptr<tbb::task_arena> gone = rts[0]->state().arena;
    rts[0].reset();
    CHECK(!gone.expired());  // rts[1] still holds it
    rts[1].reset();
    CHECK(gone.expired());
    Runtime fresh(RuntimeOptions{2, {}, {}, {}});
    CHECK(fresh.state().arena->max_concurrency() == 2);
}

// ---- Score modifiers: window, softcap, ALiBi, sinks (mha_attention_variant) ----------------------

namespace {

struct VariantSpec {
    const char *what;
    int64_t window = 0;
    float softcap = 0.0f;
    bool alibi = false, sinks = false;
};

const VariantSpec kVariants[] = {
    {"window", 6},
    {"softcap", 0, 0.3f},
    {"softcap 50 (Gemma 2)", 0, 50.0f},
    {"softcap far above every score", 0, 1e6f},
    {"alibi", 0, 0.0f, true},
    {"sinks", 0, 0.0f, false, true},
    {"all together", 9, 0.5f, true, true},
};

// ALiBi's slopes for H heads (Press et al. 2022: 2^(-8 h / H), h = 1..H) and sinks around 0..2.
struct VariantData {
    std::vector<float> slopes, sinks;
};

void set_variant(const VariantSpec &v, int64_t H, VariantData &vd, AttentionVariant &av, ref::AttentionCase &rc) {
    vd.slopes.clear();
    vd.sinks.clear();
    for (int64_t h = 0; h < H; ++h) {
        vd.slopes.push_back(std::exp2(-8.0f * static_cast<float>(h + 1) / static_cast<float>(H)));
        vd.sinks.push_back(0.25f * static_cast<float>(h % 8) - 0.3f);
    }
    av = AttentionVariant{v.window, v.softcap, v.alibi ? vd.slopes.data() : nullptr, v.sinks ? vd.sinks.data() : nullptr};
    rc.window = v.window;
    rc.softcap = v.softcap;
    rc.alibi = av.alibi_slopes;
    rc.sinks = av.sink_logits;
}

// Against double (out and weights), and the same bits on 1 and 2 threads.
void check_variant(const Case &c, const VariantSpec &v, const RuntimeOptions &o, uint32_t seed) {
    Data d = make(c, seed);
    VariantData vd;
    set_variant(v, c.H, vd, d.p.variant, d.rc);
    const Result r = check_same_bits_1_2_threads(c, d, o);
    std::vector<double> want, want_w;
    ref::attention(d.rc, d.q.data(), d.k.data(), d.v.data(), want, &want_w);
    int bad = 0;
    for (size_t i = 0; i < r.out.size(); ++i)
        if (!(std::fabs(r.out[i] - want[i]) <= 5e-5) && bad++ < 3)
            FAIL_CHECK(std::string(c.what) << " / " << std::string(v.what) << " out[" << i << "] = " << r.out[i] << ", want " << want[i]);
    for (size_t i = 0; i < r.w.size(); ++i)
        if (!(std::fabs(r.w[i] - want_w[i]) <= 5e-5) && bad++ < 6)
            FAIL_CHECK(std::string(c.what) << " / " << std::string(v.what) << " weights[" << i << "] = " << r.w[i] << ", want " << want_w[i]);
}

const Case kVariantCases[] = {
    {"self, causal", 2, 37, 37, 4, 4, 16, 16, true},
    {"self, not causal", 1, 29, 29, 2, 2, 16, 16},
    {"cross, Lq < Lk, causal, GQA, masks", 2, 11, 40, 4, 2, 8, 12, true, 1, 2},
    {"Lq < Lk, not causal, several key tiles", 1, 5, 300, 2, 1, 32, 16},
    {"decode (direct path), GQA", 3, 1, 50, 8, 2, 32, 32, true, 1},
    {"speculative rows (direct path), not causal", 2, 3, 45, 4, 2, 16, 8},
};

} // namespace

TEST_CASE("variant: window, softcap, ALiBi, sinks, alone and together, against double; every path and ISA") {
    for (const auto &o : runtimes(1))
        for (const auto &c : kVariantCases)
            for (const auto &v : kVariants) {
                CAPTURE(std::string(isa_name(*o.isa)));
                CAPTURE(o.tiles.has_value());
                CAPTURE(c.what);
                CAPTURE(v.what);
                check_variant(c, v, o, 41);
            }
}

TEST_CASE("in place (out == q): the bits of a separate out on every path; refused where it cannot hold") {
    // Each path writes a row's output after its last read of that row's Q: one key tile, several
    // (Q in panels), many chunks merged (the tiny tiles), strips with cached K/V tiles (Lq past a
    // query block), keys split over threads (one item on 2 threads), the direct path (decode and a
    // few rows), GQA, masks, odd head dims; with and without the score modifiers.
    const Case cases[] = {
        {"self, MHA", 2, 37, 37, 4, 4, 16, 16},
        {"cross, several key tiles", 2, 5, 300, 2, 2, 32, 32},
        {"Q in panels: three key tiles or more", 1, 40, 800, 2, 1, 16, 16},
        {"strips with cached K/V tiles", 1, 300, 300, 4, 4, 8, 8, true},
        {"one item, keys split over 2 threads", 1, 6, 700, 1, 1, 16, 16},
        {"GQA, causal, all masks", 3, 11, 16, 4, 2, 12, 12, true, 1, 2},
        {"odd head dim", 2, 6, 11, 3, 3, 5, 5},
        {"head dim past a register tile", 1, 4, 9, 2, 2, 65, 65},
        {"decode: one query", 3, 1, 50, 8, 2, 32, 32, true, 1},
        {"a few rows (direct path)", 2, 3, 45, 4, 2, 16, 16},
    };
    const VariantSpec all = kVariants[std::size(kVariants) - 1];
    for (int threads : {1, 2})
        for (const RuntimeOptions &o : runtimes(threads))
            for (const Case &c : cases)
                for (bool variant : {false, true}) {
                    CAPTURE(threads);
                    CAPTURE(std::string(isa_name(*o.isa)));
                    CAPTURE(o.tiles.has_value());
                    CAPTURE(c.what);
                    CAPTURE(variant);
                    Runtime rt(o);
                    Data d = make(c, 23);
                    VariantData vd;
                    if (variant) set_variant(all, c.H, vd, d.p.variant, d.rc);
                    const int64_t Tq = c.B * c.Lq, w = c.H * c.D;
                    std::vector<float> want(static_cast<size_t>(Tq * w), test::kSentinel);
                    attention(rt, d.p, d.q.data(), d.k.data(), d.v.data(), want.data());
                    for (int64_t ld : {w, w + 3}) {  // dense rows, and rows wider than the heads
                        std::vector<float> x(static_cast<size_t>(Tq * ld), test::kSentinel);
                        for (int64_t r = 0; r < Tq; ++r) std::copy(d.q.begin() + r * w, d.q.begin() + (r + 1) * w, x.begin() + r * ld);
                        AttentionParams p = d.p;
                        p.q_stride = p.out_stride = ld;
                        attention(rt, p, x.data(), d.k.data(), d.v.data(), x.data());
                        bool same = true, pad_kept = true;
                        for (int64_t r = 0; r < Tq; ++r) {
                            same &= std::memcmp(x.data() + r * ld, want.data() + r * w, static_cast<size_t>(w) * 4) == 0;
                            for (int64_t j = w; j < ld; ++j) pad_kept &= x[static_cast<size_t>(r * ld + j)] == test::kSentinel;
                        }
                        CHECK(same);
                        CHECK(pad_kept);
                    }
                }
    // Refused, with nothing written: the weights (their pass reads Q after the outputs), value_dim
    // != head_dim (a head's output would cover another head's Q), out_stride != q_stride.
    Runtime rt(RuntimeOptions{1, {}, {}, {}});
    const Case c{"refused", 2, 5, 7, 2, 1, 8, 8};
    Data d = make(c, 3);
    std::vector<float> w(static_cast<size_t>(c.B * c.H * c.Lq * c.Lk), test::kSentinel);
    auto refused = [&](AttentionParams p, const char *needle) {
        std::vector<float> x = d.q;
        x.resize(x.size() * 2, test::kSentinel);  // room for the wider rows tried below
        const std::vector<float> before = x;
        CHECK_THROWS_WITH_AS(attention(rt, p, x.data(), d.k.data(), d.v.data(), x.data()), doctest::Contains(needle), Error);
        CHECK(test::same_bits(x, before));
        CHECK(std::all_of(w.begin(), w.end(), [](float f) { return f == test::kSentinel; }));
    };
    AttentionParams p = d.p;
    p.weights = w.data();
    refused(p, "no weights (weights is not NULL)");
    p = d.p;
    p.value_dim = 4;
    refused(p, "value_dim == head_dim (got 4 and 8)");
    p = d.p;
    p.out_stride = c.H * c.D + 1;
    refused(p, "the same row stride for q and out (got 16 and 17)");
    p = d.p;
    p.q_stride = c.H * c.D + 2;
    refused(p, "(got 18 and 16)");
}

TEST_CASE("a panel's last P V written to the output already divided: the bits of the division after it") {
    // Without weights, a register panel's last P V of a query block whose keys are one chunk goes
    // straight to the output divided by the rows' sums (FusedAttention::pv_to_out, head by head,
    // when Dv is whole NR-column panels); with weights it goes to the accumulator
    // and finish() divides it. The outputs must agree bit for bit, sinks and rows that see no key
    // (zeros, even against an infinite value) included.
    const Case cases[] = {{"one key tile, MHA", 2, 40, 100, 4, 4, 32, 64},
                          {"causal, Lq > Lk: early rows see nothing", 1, 30, 10, 2, 2, 16, 32, true},
                          {"valid lengths including 0", 3, 20, 40, 2, 2, 32, 32, false, 1},
                          {"GQA: panels across heads, full mask, causal", 2, 9, 50, 8, 2, 32, 64, true, 0, 2},
                          {"H8 D128: rows 4 KiB apart", 1, 128, 128, 8, 8, 128, 128},
                          {"several key tiles in one chunk, causal", 1, 20, 700, 2, 2, 64, 32, true},
                          {"two chunks", 1, 20, 1500, 2, 1, 64, 32}};
    const VariantSpec variants[] = {{"none"}, {"sinks", 0, 0.0f, false, true}, {"all together", 9, 0.5f, true, true}};
    for (const auto &o : runtimes(1)) {
        Runtime rt(o);
        for (const auto &c : cases)
            for (const auto &v : variants)
                for (const bool inf : {false, true}) {
                    CAPTURE(std::string(isa_name(*o.isa)));
                    CAPTURE(o.tiles.has_value());
                    CAPTURE(c.what);
                    CAPTURE(v.what);
                    CAPTURE(inf);
                    Data d = make(c, 53);
                    VariantData vd;
                    set_variant(v, c.H, vd, d.p.variant, d.rc);
                    if (inf)  // key 3's values: rows that see it get inf or NaN, the others not
                        for (int64_t b = 0; b < c.B; ++b)
                            std::fill_n(d.v.begin() + (b * c.Lk + 3) * c.Hkv * c.Dv, c.Hkv * c.Dv,
                                        std::numeric_limits<float>::infinity());
                    std::vector<float> direct(static_cast<size_t>(c.B * c.Lq * c.H * c.Dv), test::kSentinel);
                    attention(rt, d.p, d.q.data(), d.k.data(), d.v.data(), direct.data());
                    const Result divided = run(rt, c, d);  // with weights
                    CHECK(test::same_bits(direct, divided.out));
                    if (!inf) {
                        std::vector<double> want;
                        ref::attention(d.rc, d.q.data(), d.k.data(), d.v.data(), want);
                        double err = 0;
                        for (size_t i = 0; i < want.size(); ++i) err = std::max(err, std::fabs(direct[i] - want[i]));
                        CHECK(err <= 5e-5);
                    }
                }
    }
}

TEST_CASE("variant: a window skips whole tiles and chunks, with the bits of the same band as a boolean mask") {
    // Long rows, so the window leaves whole tiles and chunks out (default and tiny tiles), on the
    // packed path (query blocks, strips), the direct path (decode) and keys split over threads.
    for (const Case &c : {Case{"prefill", 1, 70, 700, 4, 2, 16, 16, true, 0, 2, true},
                         Case{"not causal", 2, 40, 300, 2, 2, 16, 8, false, 1, 0, true},
                         Case{"decode", 2, 1, 3000, 8, 2, 32, 32, true, 0, 0, true}}) {
        CAPTURE(c.what);
        for (int64_t window : {1, 5, 64, 200}) {
            CAPTURE(window);
            Data d = make(c, 51);
            d.p.variant.window = window;
            d.rc.window = window;
            // The band as a full boolean mask [B, Lq, Lk], combined with the case's own mask.
            std::vector<uint8_t> band(static_cast<size_t>(c.B * c.Lq * c.Lk));
            for (int64_t b = 0; b < c.B; ++b)
                for (int64_t i = 0; i < c.Lq; ++i)
                    for (int64_t j = 0; j < c.Lk; ++j) {
                        const bool own = !d.p.mask || d.p.mask[b * d.p.mask_batch_stride + i * d.p.mask_row_stride + j];
                        band[static_cast<size_t>((b * c.Lq + i) * c.Lk + j)] = own && j > i + c.Lk - c.Lq - window;
                    }
            // Also query blocks of 40 rows, several register panels, against 16-key chunks: a
            // block's later panels then see nothing in its first chunk (their window starts past
            // it), so their accumulator rows are never written there and must still merge as zeros
            // (the tests run with MHA_POISON_SCRATCH=1: unwritten scratch is NaN).
            auto options = runtimes(1);
            for (const auto &o : runtimes(1)) {
                if (o.tiles) continue;
                RuntimeOptions tall = o;
                TileConfig t = default_tile_config(*o.isa, detect_cache_sizes());
                t.attn_block_q = 40;
                t.attn_block_k = 8;
                t.attn_kv_chunk = 16;
                tall.tiles = t;
                options.push_back(tall);
            }
            for (const auto &o : options) {
                CAPTURE(std::string(isa_name(*o.isa)));
                CAPTURE(o.tiles.has_value());
                CAPTURE(o.tiles ? o.tiles->attn_block_q : 0);
                const Result r = check_same_bits_1_2_threads(c, d, o);
                Data banded = d;
                banded.p.variant.window = 0;
                banded.p.mask = band.data();
                banded.p.mask_batch_stride = c.Lq * c.Lk;
                banded.p.mask_row_stride = c.Lk;
                Runtime rt(o);
                const Result m = run(rt, c, banded);
                CHECK(test::same_bits(r.out, m.out));
                CHECK(test::same_bits(r.w, m.w));
                std::vector<double> want;
                ref::attention(d.rc, d.q.data(), d.k.data(), d.v.data(), want);
                int bad = 0;
                for (size_t i = 0; i < r.out.size(); ++i)
                    if (!(std::fabs(r.out[i] - want[i]) <= 5e-5) && bad++ < 3)
                        FAIL_CHECK("out[" << i << "] = " << r.out[i] << ", want " << want[i]);
            }
        }
    }
}

TEST_CASE("variant: a window longer than any distance (up to INT64_MAX) is no window, with queries before every key") {
    // Lq > Lk, causal: the first queries sit before key 0, where position - window + 1 overflowed
    // int64 and pushed their start past every key (fuzz_c_abi found it).
    for (const Case &c : {Case{"Lq > Lk, causal", 2, 7, 1, 1, 1, 3, 3, true, 0, 0, true},
                         Case{"Lq > Lk, causal, several tiles", 1, 40, 30, 2, 1, 16, 8, true, 0, 0, true}})
        for (int64_t window : {int64_t{1} << 40, std::numeric_limits<int64_t>::max() - 1, std::numeric_limits<int64_t>::max()})
            for (const auto &o : runtimes(1)) {
                CAPTURE(c.what);
                CAPTURE(window);
                Data d = make(c, 61);
                const Result plain = check_same_bits_1_2_threads(c, d, o);
                d.p.variant.window = window;
                const Result r = check_same_bits_1_2_threads(c, d, o);
                CHECK(test::same_bits(r.out, plain.out));
                CHECK(test::same_bits(r.w, plain.w));
            }
}

TEST_CASE("variant: sinks as gpt-oss computes them, ALiBi as the paper's bias") {
    // gpt-oss (openai/gpt-oss, torch reference): w = softmax(cat([scores, sink]), -1)[..., :-1];
    // out = w V. ALiBi (Press et al.): scores + m_h (j - i), m_h = 2^(-8h/H), causal. Both here in
    // plain double from the unmodified scores, not through the reference's modifier code.
    const int64_t Lq = 6, Lk = 10, H = 4, D = 8;
    const auto q = test::random_floats(static_cast<size_t>(Lq * H * D), 61), k = test::random_floats(static_cast<size_t>(Lk * H * D), 62),
               v = test::random_floats(static_cast<size_t>(Lk * H * D), 63);
    const float sinks[H] = {-1.0f, 0.0f, 1.5f, 4.0f}, slopes[H] = {0.5f, 0.25f, 0.125f, 0.0625f};
    for (int kind = 0; kind < 2; ++kind) {
        AttentionParams p;
        p.batch = 1; p.q_len = Lq; p.kv_len = Lk; p.num_heads = H; p.num_kv_heads = H; p.head_dim = D; p.value_dim = D;
        p.causal = kind == 1;
        if (kind == 0) p.variant.sink_logits = sinks; else p.variant.alibi_slopes = slopes;
        for (Isa isa : supported_isas()) {
            Runtime rt(RuntimeOptions{1, isa, {}, {}});
            std::vector<float> out(static_cast<size_t>(Lq * H * D));
            attention(rt, p, q.data(), k.data(), v.data(), out.data());
            for (int64_t h = 0; h < H; ++h)
                for (int64_t i = 0; i < Lq; ++i) {
                    std::vector<double> logits;
                    for (int64_t j = 0; j < Lk; ++j) {
                        double sc = 0;
                        for (int64_t x = 0; x < D; ++x) sc += double(q[(i * H + h) * D + x]) * k[(j * H + h) * D + x];
                        sc /= std::sqrt(double(D));
                        if (kind == 1) sc += slopes[h] * double(j - (i + Lk - Lq));
                        if (kind == 1 && j > i + Lk - Lq) sc = -INFINITY;
                        logits.push_back(sc);
                    }
                    if (kind == 0) logits.push_back(sinks[h]);  // cat([scores, sink])
                    double mx = -INFINITY, sum = 0;
                    for (double x : logits) mx = std::max(mx, x);
                    for (double &x : logits) sum += x = std::exp(x - mx);
                    for (int64_t x = 0; x < D; ++x) {
                        double o = 0;
                        for (int64_t j = 0; j < Lk; ++j) o += logits[static_cast<size_t>(j)] / sum * v[(j * H + h) * D + x];
                        CHECK(std::fabs(out[static_cast<size_t>((i * H + h) * D + x)] - o) <= 2e-6);
                    }
                }
        }
    }
}

TEST_CASE("mha_attention: bad input gets a status and a message, and out is left untouched") {
    mha_runtime *rt = nullptr;
    REQUIRE(mha_runtime_create(1, &rt) == MHA_OK);
    std::vector<float> q(64, 1.0f), k(64, 1.0f), v(64, 1.0f), out(64, 7.0f);
    int32_t valid[2] = {3, 9};
    uint8_t mask[64] = {1};
    auto good = [] {
        mha_attention_params p{};
        p.batch = 2; p.q_len = 2; p.kv_len = 4; p.num_heads = 2; p.num_kv_heads = 1; p.head_dim = 2; p.value_dim = 2;
        return p;
    };
    auto expect = [&](mha_attention_params p, const float *qq, const float *kk, const float *vv, float *oo, const char *needle) {
        CHECK(mha_attention(rt, &p, qq, kk, vv, oo) == MHA_INVALID_ARGUMENT);
        CHECK_MESSAGE(std::string(mha_last_error()).find(needle) != std::string::npos, mha_last_error());
        for (float x : out) CHECK(x == 7.0f);
    };
    {
        auto p = good();
        CHECK(mha_attention(nullptr, &p, q.data(), k.data(), v.data(), out.data()) == MHA_INVALID_ARGUMENT);
        CHECK(mha_attention(rt, nullptr, q.data(), k.data(), v.data(), out.data()) == MHA_INVALID_ARGUMENT);
    }
    auto p = good(); p.batch = -1; expect(p, q.data(), k.data(), v.data(), out.data(), "batch");
    p = good(); p.kv_len = -4; expect(p, q.data(), k.data(), v.data(), out.data(), "kv_len");
    p = good(); p.num_heads = 0; expect(p, q.data(), k.data(), v.data(), out.data(), "num_heads");
    p = good(); p.head_dim = 0; expect(p, q.data(), k.data(), v.data(), out.data(), "head_dim");
    p = good(); p.value_dim = -2; expect(p, q.data(), k.data(), v.data(), out.data(), "value_dim");
    p = good(); p.num_heads = 3; p.num_kv_heads = 2; expect(p, q.data(), k.data(), v.data(), out.data(), "multiple");
    p = good(); p.kv_valid_lens = valid; expect(p, q.data(), k.data(), v.data(), out.data(), "kv_valid_lens[1]");
    p = good(); p.mask = mask; p.mask_row_stride = 3; expect(p, q.data(), k.data(), v.data(), out.data(), "mask_row_stride");
    p = good(); p.mask = mask; p.mask_batch_stride = -1; expect(p, q.data(), k.data(), v.data(), out.data(), "mask_batch_stride");
    p = good(); p.scale = NAN; expect(p, q.data(), k.data(), v.data(), out.data(), "scale");
    p = good(); expect(p, nullptr, k.data(), v.data(), out.data(), "q is NULL");
    p = good(); expect(p, q.data(), nullptr, v.data(), out.data(), "k is NULL");
    p = good(); expect(p, q.data(), k.data(), nullptr, out.data(), "v is NULL");
    p = good(); expect(p, q.data(), k.data(), v.data(), nullptr, "out is NULL");
    p = good(); p.value_dim = 3; expect(p, out.data(), k.data(), v.data(), out.data(), "in-place attention (out == q) needs value_dim");
    p = good(); p.q_len = INT64_C(1) << 40; p.head_dim = INT64_C(1) << 30; expect(p, q.data(), k.data(), v.data(), out.data(), "overflow");
    p = good(); p.variant.window = -1; expect(p, q.data(), k.data(), v.data(), out.data(), "variant.window");
    for (float cap : {-1.0f, NAN, INFINITY}) {
        p = good(); p.variant.softcap = cap; expect(p, q.data(), k.data(), v.data(), out.data(), "variant.softcap");
    }
    const float bad_slopes[2] = {0.5f, NAN}, bad_sinks[2] = {INFINITY, 0.0f};
    p = good(); p.variant.alibi_slopes = bad_slopes; expect(p, q.data(), k.data(), v.data(), out.data(), "variant.alibi_slopes[1]");
    p = good(); p.variant.sink_logits = bad_sinks; expect(p, q.data(), k.data(), v.data(), out.data(), "variant.sink_logits[0]");
    mha_runtime_destroy(rt);
}
