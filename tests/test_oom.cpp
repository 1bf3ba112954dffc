// Out of memory. Every allocation along a call fails in turn (operator new is replaced below, and
// mha allocates all its memory through it): each failure must return MHA_OUT_OF_MEMORY with a
// message, write nothing and change no object, and the same call made again on the same objects
// must then succeed with the bits of a call that never failed. Under RLIMIT_AS (a child process)
// the same holds for real failures of the system allocator.
#include <doctest/doctest.h>

#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <new>
#include <string>
#include <tuple>
#include <vector>

#include "mha/mha.h"
#include "test_util.hpp"

// ---- The allocation hook ------------------------------------------------------------------------
namespace {

std::atomic<long> g_countdown{0};  // > 0: armed; the allocation that takes it to 0 fails

bool injected_failure() {
    if (g_countdown.load(std::memory_order_relaxed) <= 0) return false;
    return g_countdown.fetch_sub(1, std::memory_order_relaxed) == 1;
}

void *allocate(size_t n, size_t align, bool may_fail = true) {
    if (may_fail && injected_failure()) return nullptr;
    if (n == 0) n = 1;
    if (align <= alignof(std::max_align_t)) return std::malloc(n);
    return std::aligned_alloc(align, (n + align - 1) / align * align);
}

void *allocate_or_throw(size_t n, size_t align) {
    void *p = allocate(n, align);
    if (!p) throw std::bad_alloc();
    return p;
}

} // namespace

// Every form, so that no allocation bypasses the hook and every free matches its allocator (the
// sanitizers' own operator new would otherwise pair with this file's delete).
void *operator new(size_t n) { return allocate_or_throw(n, 0); }
void *operator new[](size_t n) { return allocate_or_throw(n, 0); }
void *operator new(size_t n, std::align_val_t a) { return allocate_or_throw(n, static_cast<size_t>(a)); }
void *operator new[](size_t n, std::align_val_t a) { return allocate_or_throw(n, static_cast<size_t>(a)); }
// A nothrow allocation's caller copes with NULL by design (std::stable_sort falls back to sorting
// in place), so those are counted out of the injection: they never fail here.
void *operator new(size_t n, const std::nothrow_t &) noexcept { return allocate(n, 0, false); }
void *operator new[](size_t n, const std::nothrow_t &) noexcept { return allocate(n, 0, false); }
void *operator new(size_t n, std::align_val_t a, const std::nothrow_t &) noexcept { return allocate(n, static_cast<size_t>(a), false); }
void *operator new[](size_t n, std::align_val_t a, const std::nothrow_t &) noexcept { return allocate(n, static_cast<size_t>(a), false); }
void operator delete(void *p) noexcept { std::free(p); }
void operator delete[](void *p) noexcept { std::free(p); }
void operator delete(void *p, size_t) noexcept { std::free(p); }
void operator delete[](void *p, size_t) noexcept { std::free(p); }
void operator delete(void *p, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void *p, std::align_val_t) noexcept { std::free(p); }
void operator delete(void *p, size_t, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void *p, size_t, std::align_val_t) noexcept { std::free(p); }
void operator delete(void *p, const std::nothrow_t &) noexcept { std::free(p); }
void operator delete[](void *p, const std::nothrow_t &) noexcept { std::free(p); }
void operator delete(void *p, std::align_val_t, const std::nothrow_t &) noexcept { std::free(p); }
void operator delete[](void *p, std::align_val_t, const std::nothrow_t &) noexcept { std::free(p); }

namespace {

// oneTBB initialises its global scheduler once per process, and an allocation failing inside that
// leaves its once-flag set and the next caller spinning: that is TBB's, not mha's, and happens at a
// server's start, not under load. So a runtime that has run on two threads stays alive through the
// whole file, and the failures injected below hit mha and the arenas of new runtimes only.
struct SchedulerStarted {
    mha_runtime *rt = nullptr;
    SchedulerStarted() {
        if (mha_runtime_create(2, &rt) != MHA_OK) std::abort();
        std::vector<float> a(256 * 256, 1.0f), c(256 * 256);
        if (mha_sgemm(rt, 'N', 'N', 256, 256, 256, 1.0f, a.data(), 256, a.data(), 256, 0.0f, c.data(), 256) != MHA_OK)
            std::abort();
    }
    ~SchedulerStarted() { mha_runtime_destroy(rt); }
} g_scheduler_started;

using mha::test::random_floats;
using mha::test::same_bits;

// Fails the 1st, 2nd, ... allocation of call() until a run needs fewer allocations than the one
// that was failed, and so completes. state() is everything the call may change (its outputs, the
// objects' observable state): a failed call must leave it as it was. Returns how many failures
// were injected.
long fail_each_allocation(const std::function<mha_status()> &call, const std::function<std::vector<float>()> &state) {
    const std::vector<float> before = state();
    for (long n = 1;; ++n) {
        g_countdown.store(n);
        const mha_status st = call();
        const long left = g_countdown.exchange(0);
        if (left > 0) {  // the call made fewer than n allocations: nothing failed
            REQUIRE_MESSAGE(st == MHA_OK, "the call without an injected failure: " << mha_last_error());
            return n - 1;
        }
        INFO("allocation " << n << " failed");
        REQUIRE(st == MHA_OUT_OF_MEMORY);
        CHECK(std::strlen(mha_last_error()) > 0);
        REQUIRE(same_bits(state(), before));
    }
}

// fail_each_allocation for a create call: every failed one must leave *out NULL.
template <class T, class Create>
long fail_each_create(T *&out, const Create &create) {
    return fail_each_allocation(
        [&] {
            const mha_status st = create(&out);
            if (st != MHA_OK) CHECK(out == nullptr);
            return st;
        },
        [] { return std::vector<float>{}; });
}

std::vector<float> filled(size_t n) { return std::vector<float>(n, mha::test::kSentinel); }

mha_runtime *make_runtime(int threads) {
    mha_runtime *rt = nullptr;
    REQUIRE(mha_runtime_create(threads, &rt) == MHA_OK);
    return rt;
}

// The layer used throughout: E 32, H 4 over 2 KV heads, head_dim 8, post-norm, biases.
struct LayerData {
    static constexpr int64_t E = 32, H = 4, KVH = 2, D = 8, F = 48;
    std::vector<float> wq = random_floats(H * D * E, 1), wk = random_floats(KVH * D * E, 2),
                       wv = random_floats(KVH * D * E, 3), wo = random_floats(E * H * D, 4),
                       bq = random_floats(H * D, 5), bo = random_floats(E, 6), w1 = random_floats(F * E, 7),
                       b1 = random_floats(F, 8), w2 = random_floats(E * F, 9), b2 = random_floats(E, 10);
    mha_layer_config config() const {
        mha_layer_config c{};
        c.embed_dim = E;
        c.num_heads = H;
        c.num_kv_heads = KVH;
        c.head_dim = c.value_dim = D;
        c.norm = MHA_NORM_POST;
        return c;
    }
    mha_layer_weights weights() const {
        mha_layer_weights w{};
        w.q_weight = wq.data();
        w.k_weight = wk.data();
        w.v_weight = wv.data();
        w.out_weight = wo.data();
        w.q_bias = bq.data();
        w.out_bias = bo.data();
        return w;
    }
    mha_encoder_config encoder_config() const {
        mha_encoder_config c{};
        c.attention = config();
        c.ffn_dim = F;
        c.activation = MHA_ACT_GELU;
        return c;
    }
    mha_encoder_weights encoder_weights() const {
        mha_encoder_weights w{};
        w.attention = weights();
        w.linear1_weight = w1.data();
        w.linear1_bias = b1.data();
        w.linear2_weight = w2.data();
        w.linear2_bias = b2.data();
        return w;
    }
};

// Runs call() once on a fresh runtime without failures (the expected bits), then on another fresh
// runtime through fail_each_allocation, and checks the final, successful run's output.
void check_call(int threads, const std::function<mha_status(mha_runtime *, std::vector<float> &)> &call, size_t out_size,
                const char *name, bool allocates = true) {
    INFO(std::string(name) << ", " << threads << " thread(s)");
    std::vector<float> expected = filled(out_size), out = filled(out_size);
    mha_runtime *clean = make_runtime(threads);
    REQUIRE(call(clean, expected) == MHA_OK);
    mha_runtime_destroy(clean);
    mha_runtime *rt = make_runtime(threads);
    const long failures = fail_each_allocation([&] { return call(rt, out); }, [&] { return out; });
    MESSAGE(std::string(name) << ": " << failures << " allocation failures injected, each answered MHA_OUT_OF_MEMORY");
    if (allocates) CHECK(failures > 0);  // the hook saw the call's allocations
    CHECK(same_bits(out, expected));
    // And again with the scratch in place.
    std::vector<float> again = filled(out_size);
    REQUIRE(call(rt, again) == MHA_OK);
    CHECK(same_bits(again, expected));
    mha_runtime_destroy(rt);
}

} // namespace

TEST_CASE("out of memory: creating a runtime") {
    for (int threads : {1, 2}) {
        mha_runtime *rt = nullptr;
        fail_each_create(rt, [&](mha_runtime **out) { return mha_runtime_create(threads, out); });
        REQUIRE(rt != nullptr);
        mha_runtime_destroy(rt);
    }
}

TEST_CASE("out of memory: sgemm (B packed once too), softmax and attention") {
    const int64_t m = 70, n = 90, k = 130;
    const auto a = random_floats(m * k, 11), b = random_floats(k * n, 12);
    const auto x = random_floats(37 * 300, 13);
    const int64_t B = 2, Lq = 150, Lk = 170, H = 4, KVH = 2, D = 24;
    const auto q = random_floats(B * Lq * H * D, 14), kk = random_floats(B * Lk * KVH * D, 15),
               v = random_floats(B * Lk * KVH * D, 16);
    std::vector<uint8_t> mask(Lq * Lk);
    for (size_t i = 0; i < mask.size(); ++i) mask[i] = (i * 7919) % 5 != 0;
    const int32_t valid[2] = {170, 99};
    for (int threads : {1, 2}) {
        check_call(
            threads,
            [&](mha_runtime *rt, std::vector<float> &c) {
                return mha_sgemm(rt, 'N', 'N', m, n, k, 1.0f, a.data(), k, b.data(), n, 0.0f, c.data(), n);
            },
            m * n, "sgemm");
        // B packed once (as a weight), then the product against it: a failure in either leaves
        // *out NULL and C as it was.
        check_call(
            threads,
            [&](mha_runtime *rt, std::vector<float> &c) {
                mha_packed_b *pb = nullptr;
                mha_status st = mha_sgemm_pack_b(rt, 'N', k, n, b.data(), n, &pb);
                if (st != MHA_OK) return pb == nullptr ? st : MHA_INTERNAL;
                st = mha_sgemm_packed_b(rt, 'N', m, 1.0f, a.data(), k, pb, 0.0f, c.data(), n);
                mha_packed_b_destroy(pb);
                return st;
            },
            m * n, "sgemm with B packed once");
        check_call(
            threads, [&](mha_runtime *rt, std::vector<float> &y) { return mha_softmax(rt, 37, 300, x.data(), 300, y.data(), 300); },
            37 * 300, "softmax", false);
        for (int64_t q_len : {Lq, int64_t{1}}) {  // the fused path and the direct (decode) path
            const size_t out_n = B * q_len * H * D, w_n = B * H * q_len * Lk;
            check_call(
                threads,
                [&](mha_runtime *rt, std::vector<float> &out) {
                    mha_attention_params p{};
                    p.batch = B;
                    p.q_len = q_len;
                    p.kv_len = Lk;
                    p.num_heads = H;
                    p.num_kv_heads = KVH;
                    p.head_dim = p.value_dim = D;
                    p.causal = 1;
                    p.kv_valid_lens = valid;
                    p.mask = mask.data();
                    p.mask_row_stride = q_len == 1 ? 0 : Lk;
                    p.weights = out.data() + out_n;
                    return mha_attention(rt, &p, q.data(), kk.data(), v.data(), out.data());
                },
                out_n + w_n, q_len == 1 ? "attention (decode, weights)" : "attention (causal, mask, weights)");
        }
        const int64_t offsets[4] = {0, 5, 5, 140}, kv_offsets[4] = {0, 40, 41, 200};
        check_call(
            threads,
            [&](mha_runtime *rt, std::vector<float> &out) {
                mha_varlen_params p{};
                p.num_seqs = 3;
                p.q_offsets = offsets;
                p.kv_offsets = kv_offsets;
                p.num_heads = H;
                p.num_kv_heads = KVH;
                p.head_dim = p.value_dim = D;
                p.causal = 1;
                return mha_attention_varlen(rt, &p, q.data(), kk.data(), v.data(), out.data());
            },
            140 * H * D, "attention_varlen");
    }
}

TEST_CASE("out of memory: layers and encoder layers, built and called") {
    const LayerData d;
    const int64_t B = 2, L = 70, E = LayerData::E;
    const auto x = random_floats(B * L * E, 20);
    const int64_t offsets[3] = {0, 33, 70};
    for (int threads : {1, 2}) {
        // Building: every failure leaves *out NULL; the build that completes works.
        mha_runtime *rt = make_runtime(threads);
        const mha_layer_config lc = d.config();
        const mha_layer_weights lw = d.weights();
        mha_layer *layer = nullptr;
        CHECK(fail_each_create(layer, [&](mha_layer **out) { return mha_layer_create(rt, &lc, &lw, out); }) > 0);
        REQUIRE(layer != nullptr);
        const mha_encoder_config ec = d.encoder_config();
        const mha_encoder_weights ew = d.encoder_weights();
        mha_encoder_layer *enc = nullptr;
        CHECK(fail_each_create(enc, [&](mha_encoder_layer **out) { return mha_encoder_layer_create(rt, &ec, &ew, out); }) > 0);
        REQUIRE(enc != nullptr);

        // Calling (on fresh runtimes, so the scratch is allocated inside the call).
        check_call(
            threads,
            [&](mha_runtime *r, std::vector<float> &out) {
                mha_layer_forward_params p{};
                p.batch = B;
                p.q_len = L;
                p.causal = 1;
                p.weights = out.data() + B * L * E;
                return mha_layer_forward(r, layer, &p, x.data(), nullptr, nullptr, out.data());
            },
            B * L * E + B * LayerData::H * L * L, "layer_forward (weights)");
        check_call(
            threads,
            [&](mha_runtime *r, std::vector<float> &out) {
                return mha_layer_forward_varlen(r, layer, 2, offsets, 1, x.data(), out.data());
            },
            L * E, "layer_forward_varlen");
        check_call(
            threads,
            [&](mha_runtime *r, std::vector<float> &out) {
                mha_layer_forward_params p{};
                p.batch = B;
                p.q_len = L;
                return mha_encoder_layer_forward(r, enc, &p, x.data(), out.data());
            },
            B * L * E, "encoder_layer_forward");
        check_call(
            threads,
            [&](mha_runtime *r, std::vector<float> &out) {
                return mha_encoder_layer_forward_varlen(r, enc, 2, offsets, 0, x.data(), out.data());
            },
            L * E, "encoder_layer_forward_varlen");
        mha_encoder_layer_destroy(enc);
        mha_layer_destroy(layer);
        mha_runtime_destroy(rt);
    }
}

namespace {

// What a KV cache's observable state is: per sequence its length and cached K and V, and the free tokens.
std::vector<float> cache_state(const mha_kv_cache *cache, std::initializer_list<int64_t> seqs, int64_t row) {
    std::vector<float> s;
    int64_t free_tokens = -1;
    REQUIRE(mha_kv_cache_free_tokens(cache, &free_tokens) == MHA_OK);
    s.push_back(static_cast<float>(free_tokens));
    for (int64_t id : seqs) {
        int64_t len = -1;
        if (mha_kv_cache_seq_len(cache, id, &len) != MHA_OK) {
            s.push_back(-1.0f);
            continue;
        }
        s.push_back(static_cast<float>(len));
        std::vector<float> k(len * row), v(len * row);
        REQUIRE(mha_kv_cache_read(cache, id, 0, len, k.data(), v.data()) == MHA_OK);
        s.insert(s.end(), k.begin(), k.end());
        s.insert(s.end(), v.begin(), v.end());
    }
    return s;
}

} // namespace

TEST_CASE("out of memory: the KV cache, cached attention and the cached layer") {
    const LayerData d;
    const int64_t KVH = LayerData::KVH, D = LayerData::D, H = LayerData::H, E = LayerData::E, row = KVH * D;
    const auto k = random_floats(300 * row, 30), v = random_floats(300 * row, 31), q = random_floats(300 * H * D, 32);
    const auto x = random_floats(300 * E, 33);
    for (int threads : {1, 2}) {
        INFO(threads << " thread(s)");
        mha_runtime *rt = make_runtime(threads);
        mha_kv_cache_config cc{};
        cc.num_kv_heads = KVH;
        cc.head_dim = cc.value_dim = D;
        cc.max_tokens = 1024;
        mha_kv_cache *cache = nullptr;
        CHECK(fail_each_create(cache, [&](mha_kv_cache **out) { return mha_kv_cache_create(rt, &cc, out); }) > 0);
        REQUIRE(cache != nullptr);
        mha_kv_cache *clean = nullptr;
        REQUIRE(mha_kv_cache_create(rt, &cc, &clean) == MHA_OK);

        // Appends: a new sequence, a longer one, a fork and an append into the shared block (copy on write).
        auto state = [&] { return cache_state(cache, {7, 8, 9}, row); };
        for (auto [id, n, off] : {std::tuple<int64_t, int64_t, int64_t>{7, 100, 0}, {8, 3, 100}, {7, 150, 103}}) {
            CHECK(fail_each_allocation([&, id = id, n = n, off = off] {
                return mha_kv_cache_append(rt, cache, id, n, k.data() + off * row, v.data() + off * row);
            }, state) > 0);
            REQUIRE(mha_kv_cache_append(rt, clean, id, n, k.data() + off * row, v.data() + off * row) == MHA_OK);
        }
        CHECK(fail_each_allocation([&] { return mha_kv_cache_fork(cache, 7, 9); }, state) > 0);
        CHECK(fail_each_allocation([&] { return mha_kv_cache_append(rt, cache, 9, 5, k.data() + 253 * row, v.data() + 253 * row); },
                                   state) > 0);
        REQUIRE(mha_kv_cache_fork(clean, 7, 9) == MHA_OK);
        REQUIRE(mha_kv_cache_append(rt, clean, 9, 5, k.data() + 253 * row, v.data() + 253 * row) == MHA_OK);
        CHECK(same_bits(cache_state(cache, {7, 8, 9}, row), cache_state(clean, {7, 8, 9}, row)));

        // Attention over the cache: a prefill chunk and two decodes in one call.
        const int64_t ids[3] = {7, 8, 9}, qoff[4] = {0, 40, 41, 42};
        mha_cached_params cp{};
        cp.num_seqs = 3;
        cp.seq_ids = ids;
        cp.q_offsets = qoff;
        cp.num_heads = H;
        cp.causal = 1;
        std::vector<float> expected = filled(42 * H * D), out = filled(42 * H * D);
        REQUIRE(mha_attention_cached(rt, clean, &cp, q.data(), expected.data()) == MHA_OK);
        mha_runtime *fresh = make_runtime(threads);
        CHECK(fail_each_allocation([&] { return mha_attention_cached(fresh, cache, &cp, q.data(), out.data()); },
                                   [&] { return out; }) > 0);
        CHECK(same_bits(out, expected));
        mha_runtime_destroy(fresh);

        // The cached layer: appends and writes all or nothing.
        mha_layer *layer = nullptr;
        const mha_layer_config lc = d.config();
        const mha_layer_weights lw = d.weights();
        REQUIRE(mha_layer_create(rt, &lc, &lw, &layer) == MHA_OK);
        const int64_t lids[2] = {8, 20}, loff[3] = {0, 1, 61};
        mha_layer_cached_params lp{};
        lp.num_seqs = 2;
        lp.seq_ids = lids;
        lp.q_offsets = loff;
        lp.causal = 1;
        std::vector<float> lexpected = filled(61 * E), lout = filled(61 * E);
        REQUIRE(mha_layer_forward_cached(rt, layer, clean, &lp, x.data(), lexpected.data()) == MHA_OK);
        fresh = make_runtime(threads);
        CHECK(fail_each_allocation([&] { return mha_layer_forward_cached(fresh, layer, cache, &lp, x.data(), lout.data()); },
                             [&] {
                                 auto s = cache_state(cache, {7, 8, 9, 20}, row);
                                 s.insert(s.end(), lout.begin(), lout.end());
                                 return s;
                             }) > 0);
        CHECK(same_bits(lout, lexpected));
        CHECK(same_bits(cache_state(cache, {7, 8, 9, 20}, row), cache_state(clean, {7, 8, 9, 20}, row)));
        mha_runtime_destroy(fresh);
        mha_layer_destroy(layer);
        mha_kv_cache_destroy(clean);
        mha_kv_cache_destroy(cache);
        mha_runtime_destroy(rt);
    }
}
