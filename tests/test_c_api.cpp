// The C ABI: statuses, per-thread messages, and bad input that must leave C untouched.
#include <doctest/doctest.h>

#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "mha/runtime.hpp"
#include "mha/tile_config.hpp"
#include "runtime/runtime_state.hpp"
#include "mha/mha.h"

namespace {

struct RuntimeGuard {
    mha_runtime *rt = nullptr;
    explicit RuntimeGuard(int threads) { REQUIRE(mha_runtime_create(threads, &rt) == MHA_OK); }
    ~RuntimeGuard() { mha_runtime_destroy(rt); }
};

bool contains(const char *haystack, const char *needle) { return std::string(haystack).find(needle) != std::string::npos; }

} // namespace

TEST_CASE("runtime create/destroy") {
    mha_runtime *rt = nullptr;
    CHECK(mha_runtime_create(0, &rt) == MHA_OK);
    CHECK(rt != nullptr);
    mha_runtime_destroy(rt);
    mha_runtime_destroy(nullptr);
    CHECK(mha_runtime_create(-1, &rt) == MHA_INVALID_ARGUMENT);
    CHECK(rt == nullptr);
    CHECK(contains(mha_last_error(), "num_threads"));
    CHECK(mha_runtime_create(1, nullptr) == MHA_INVALID_ARGUMENT);
    CHECK(contains(mha_last_error(), "out"));
}

TEST_CASE("mha_runtime_scratch_bytes: none before a call, the call's scratch after it") {
    mha_runtime *rt = nullptr;
    REQUIRE(mha_runtime_create(2, &rt) == MHA_OK);
    uint64_t bytes = 7;
    REQUIRE(mha_runtime_scratch_bytes(rt, &bytes) == MHA_OK);
    CHECK(bytes == 0);
    mha_attention_params p{};
    p.batch = 1; p.q_len = 64; p.kv_len = 300; p.num_heads = 4; p.num_kv_heads = 2; p.head_dim = 32; p.value_dim = 16;
    std::vector<float> q(64 * 4 * 32, 0.5f), k(300 * 2 * 32, 0.25f), v(300 * 2 * 16, 1.0f), out(64 * 4 * 16);
    REQUIRE(mha_attention(rt, &p, q.data(), k.data(), v.data(), out.data()) == MHA_OK);
    REQUIRE(mha_runtime_scratch_bytes(rt, &bytes) == MHA_OK);
    CHECK(bytes > 0);
    CHECK(bytes < (uint64_t{1} << 20));
    CHECK(mha_runtime_scratch_bytes(nullptr, &bytes) == MHA_INVALID_ARGUMENT);
    CHECK(contains(mha_last_error(), "rt"));
    CHECK(mha_runtime_scratch_bytes(rt, nullptr) == MHA_INVALID_ARGUMENT);
    CHECK(contains(mha_last_error(), "bytes"));
    mha_runtime_destroy(rt);
}

TEST_CASE("mha_runtime_scratch_bytes counts the buffers other threads' calls have on loan") {
    // Found by the soak: the count once summed only the buffers free at that instant, so a query
    // while other host threads' calls held every buffer read 0 (half the queries in this test).
    mha_runtime *rt = nullptr;
    REQUIRE(mha_runtime_create(2, &rt) == MHA_OK);
    mha_attention_params p{};
    p.batch = 1; p.q_len = 16; p.kv_len = 64; p.num_heads = 2; p.num_kv_heads = 2; p.head_dim = 32; p.value_dim = 32;
    std::vector<float> q(16 * 2 * 32, 0.5f), k(64 * 2 * 32, 0.25f), v(64 * 2 * 32, 1.0f), out(16 * 2 * 32);
    REQUIRE(mha_attention(rt, &p, q.data(), k.data(), v.data(), out.data()) == MHA_OK);
    uint64_t first = 0;
    REQUIRE(mha_runtime_scratch_bytes(rt, &first) == MHA_OK);
    REQUIRE(first > 0);
    std::atomic<bool> stop{false};
    std::atomic<int> failures{0};
    std::vector<std::thread> callers;
    for (int t = 0; t < 4; ++t)
        callers.emplace_back([&] {
            std::vector<float> o(out.size());
            while (!stop.load())
                if (mha_attention(rt, &p, q.data(), k.data(), v.data(), o.data()) != MHA_OK) ++failures;
        });
    int below = 0;
    for (int i = 0; i < 20000; ++i) {
        uint64_t bytes = 0;
        REQUIRE(mha_runtime_scratch_bytes(rt, &bytes) == MHA_OK);
        below += bytes < first;  // buffers only grow and are kept
    }
    stop = true;
    for (auto &t : callers) t.join();
    CHECK(failures.load() == 0);
    CHECK(below == 0);
    mha_runtime_destroy(rt);
}

TEST_CASE("MHA_ISA selects or refuses an ISA") {
    mha_runtime *rt = nullptr;
    setenv("MHA_ISA", "sse9", 1);
    CHECK(mha_runtime_create(1, &rt) == MHA_INVALID_ARGUMENT);
    CHECK(contains(mha_last_error(), "MHA_ISA"));
    setenv("MHA_ISA", "avx2", 1);
    CHECK(mha_runtime_create(1, &rt) == MHA_OK);
    mha_runtime_destroy(rt);
    unsetenv("MHA_ISA");
}

TEST_CASE("MHA_TRANSPOSE overrides every runtime's transpose or is refused; without it the tiles' key holds") {
    struct Restore {  // the variable as it was, however the case ends
        const char *env = std::getenv("MHA_TRANSPOSE");
        std::string value = env ? env : "";
        ~Restore() {
            if (env) setenv("MHA_TRANSPOSE", value.c_str(), 1);
            else unsetenv("MHA_TRANSPOSE");
        }
    } restore;
    unsetenv("MHA_TRANSPOSE");
    mha::TileConfig tiles = mha::Runtime(mha::RuntimeOptions{1, {}, {}, {}}).tiles();
    mha_runtime *rt = nullptr;
    setenv("MHA_TRANSPOSE", "rotate", 1);
    CHECK(mha_runtime_create(1, &rt) == MHA_INVALID_ARGUMENT);
    CHECK(rt == nullptr);
    CHECK(contains(mha_last_error(), "MHA_TRANSPOSE"));
    CHECK_THROWS_AS(mha::Runtime(mha::RuntimeOptions{1, {}, tiles, {}}), mha::Error);
    for (const char *name : {"shuffles", "inserts"}) {
        setenv("MHA_TRANSPOSE", name, 1);
        REQUIRE(mha_runtime_create(1, &rt) == MHA_OK);
        mha_runtime_destroy(rt);
        rt = nullptr;
        tiles.transpose = std::string(name) == "inserts" ? "shuffles" : "inserts";  // the other one
        const mha::Runtime forced(mha::RuntimeOptions{1, {}, tiles, {}});
        CHECK(forced.tiles().transpose == name);
        CHECK(forced.state().inserts == (std::string(name) == "inserts"));  // what the kernels are given
        tiles.transpose = "sideways";  // the tiles' own key is still checked
        CHECK_THROWS_AS(mha::Runtime(mha::RuntimeOptions{1, {}, tiles, {}}), mha::Error);
    }
    unsetenv("MHA_TRANSPOSE");
    for (const char *name : {"shuffles", "inserts"}) {
        tiles.transpose = name;
        const mha::Runtime rt_tiles(mha::RuntimeOptions{1, {}, tiles, {}});
        CHECK(rt_tiles.tiles().transpose == name);
        CHECK(rt_tiles.state().inserts == (std::string(name) == "inserts"));
    }
}

TEST_CASE("mha_sgemm computes, and every bad input gets a status and a message and leaves C untouched") {
    RuntimeGuard g(2);
    const float a[6] = {1, 2, 3, 4, 5, 6};    // 2 x 3
    const float b[6] = {1, 0, 0, 1, 1, 1};    // 3 x 2
    float c[4] = {9, 9, 9, 9};
    REQUIRE(mha_sgemm(g.rt, 'N', 'N', 2, 2, 3, 1.0f, a, 3, b, 2, 0.0f, c, 2) == MHA_OK);
    CHECK(c[0] == 4);
    CHECK(c[1] == 5);
    CHECK(c[2] == 10);
    CHECK(c[3] == 11);

    struct Bad {
        const char *what;
        mha_status status;
        const char *message;
    };
    auto expect = [&](mha_status got, const char *needle) {
        CHECK(got == MHA_INVALID_ARGUMENT);
        CHECK_MESSAGE(contains(mha_last_error(), needle), mha_last_error());
        for (float x : c) CHECK(x == 7.0f);
    };
    for (float &x : c) x = 7.0f;
    expect(mha_sgemm(nullptr, 'N', 'N', 2, 2, 3, 1, a, 3, b, 2, 0, c, 2), "rt");
    expect(mha_sgemm(g.rt, 'X', 'N', 2, 2, 3, 1, a, 3, b, 2, 0, c, 2), "transa");
    expect(mha_sgemm(g.rt, 'N', 'n', 2, 2, 3, 1, a, 3, b, 2, 0, c, 2), "transb");
    expect(mha_sgemm(g.rt, 'N', 'N', -1, 2, 3, 1, a, 3, b, 2, 0, c, 2), "m");
    expect(mha_sgemm(g.rt, 'N', 'N', 2, -2, 3, 1, a, 3, b, 2, 0, c, 2), "n");
    expect(mha_sgemm(g.rt, 'N', 'N', 2, 2, -3, 1, a, 3, b, 2, 0, c, 2), "k");
    expect(mha_sgemm(g.rt, 'N', 'N', 2, 2, 3, 1, a, 2, b, 2, 0, c, 2), "lda");
    expect(mha_sgemm(g.rt, 'T', 'N', 2, 2, 3, 1, a, 1, b, 2, 0, c, 2), "lda");
    expect(mha_sgemm(g.rt, 'N', 'N', 2, 2, 3, 1, a, 3, b, 1, 0, c, 2), "ldb");
    expect(mha_sgemm(g.rt, 'N', 'T', 2, 2, 3, 1, a, 3, b, 2, 0, c, 2), "ldb");
    expect(mha_sgemm(g.rt, 'N', 'N', 2, 2, 3, 1, a, 3, b, 2, 0, c, 1), "ldc");
    expect(mha_sgemm(g.rt, 'N', 'N', 2, 2, 3, 1, nullptr, 3, b, 2, 0, c, 2), "a is NULL");
    expect(mha_sgemm(g.rt, 'N', 'N', 2, 2, 3, 1, a, 3, nullptr, 2, 0, c, 2), "b is NULL");
    expect(mha_sgemm(g.rt, 'N', 'N', 2, 2, 3, 1, a, 3, b, 2, 0, nullptr, 2), "c is NULL");
    // Sizes whose extent overflows int64: checked before anything is read.
    expect(mha_sgemm(g.rt, 'N', 'N', INT64_C(1) << 40, 2, INT64_C(1) << 40, 1, a, INT64_C(1) << 40, b, 2, 0, c, 2), "overflow");
    expect(mha_sgemm(g.rt, 'N', 'N', 2, 2, 3, 1, a, INT64_MAX, b, 2, 0, c, 2), "overflow");
    expect(mha_sgemm(g.rt, 'N', 'N', 2, INT64_C(1) << 62, 3, 1, a, 3, b, INT64_C(1) << 62, 0, c, INT64_C(1) << 62), "overflow");
}

TEST_CASE("mha_last_error is per thread") {
    RuntimeGuard g(1);
    float c[1] = {0};
    CHECK(mha_sgemm(g.rt, 'Q', 'N', 1, 1, 1, 1, c, 1, c, 1, 0, c, 1) == MHA_INVALID_ARGUMENT);
    std::string other;
    std::thread t([&] {
        mha_sgemm(g.rt, 'N', 'N', -5, 1, 1, 1, c, 1, c, 1, 0, c, 1);
        other = mha_last_error();
    });
    t.join();
    CHECK(contains(mha_last_error(), "transa"));
    CHECK(contains(other.c_str(), "m = -5"));
}

namespace {

// A host thread that calls mha_sgemm over and over, checking each result, until it is cancelled.
struct CancelledCaller {
    mha_runtime *rt = nullptr;
    int64_t n = 0;
    const float *a = nullptr, *expected = nullptr;
    std::vector<float> c;
    std::atomic<int> completed{0}, wrong{0};
    std::atomic<bool> in_call{false}, cancelled_in_call{false};

    static void *body(void *arg) {
        auto &self = *static_cast<CancelledCaller *>(arg);
        struct OnUnwind {  // runs as the cancellation unwinds the thread
            CancelledCaller &s;
            ~OnUnwind() { s.cancelled_in_call = s.in_call.load(); }
        } on_unwind{self};
        for (;;) {
            std::fill(self.c.begin(), self.c.end(), -1.0f);
            self.in_call = true;
            const mha_status st = mha_sgemm(self.rt, 'N', 'N', self.n, self.n, self.n, 1.0f, self.a, self.n, self.a,
                                             self.n, 0.0f, self.c.data(), self.n);
            self.in_call = false;
            if (st != MHA_OK || std::memcmp(self.c.data(), self.expected, self.c.size() * sizeof(float)) != 0) ++self.wrong;
            ++self.completed;
            pthread_testcancel();
        }
        return nullptr;
    }
};

} // namespace

TEST_CASE("a host thread cancelled during a call: the call runs to its end, the cancel acts after it") {
    RuntimeGuard g(2);
    const int64_t n = 256;
    std::vector<float> a(n * n), expected(n * n);
    for (size_t i = 0; i < a.size(); ++i) a[i] = static_cast<float>(i % 17) * 0.125f - 1.0f;
    REQUIRE(mha_sgemm(g.rt, 'N', 'N', n, n, n, 1.0f, a.data(), n, a.data(), n, 0.0f, expected.data(), n) == MHA_OK);
    CancelledCaller caller;
    caller.rt = g.rt;
    caller.n = n;
    caller.a = a.data();
    caller.expected = expected.data();
    caller.c.resize(static_cast<size_t>(n * n));
    pthread_t thread;
    REQUIRE(pthread_create(&thread, nullptr, &CancelledCaller::body, &caller) == 0);
    while (caller.completed < 3) std::this_thread::yield();
    while (!caller.in_call) std::this_thread::yield();  // cancel it in the middle of a call
    REQUIRE(pthread_cancel(thread) == 0);
    void *result = nullptr;
    REQUIRE(pthread_join(thread, &result) == 0);
    CHECK(result == PTHREAD_CANCELED);
    CHECK_FALSE(caller.cancelled_in_call.load());
    CHECK(caller.wrong == 0);
    // The runtime serves the next call as before.
    std::vector<float> c(n * n);
    REQUIRE(mha_sgemm(g.rt, 'N', 'N', n, n, n, 1.0f, a.data(), n, a.data(), n, 0.0f, c.data(), n) == MHA_OK);
    CHECK(std::memcmp(c.data(), expected.data(), c.size() * sizeof(float)) == 0);
}

// Found by fuzz/fuzz_c_abi: a num_seqs too large for any [num_seqs + 1] array made the offsets
// check read past the caller's array (until it met a decrease); a mask whose strides address more
// bytes than any array holds (no int64 overflow, but past the tensors' INT64_MAX / 8 limit) was
// accepted and read far out of bounds. Both are refused now, before anything is read or written.
TEST_CASE("ragged batches refuse a num_seqs no offsets array can hold; masks refuse strides past any array") {
    RuntimeGuard g(1);
    const int64_t offsets[2] = {0, 1};  // what the caller really has
    const int64_t ids[1] = {0};
    float q[8] = {}, out[8] = {};
    for (int64_t n : {INT64_MAX, INT64_MAX / 2, INT64_MAX / 8, int64_t{1} << 62}) {
        mha_varlen_params vp{n, offsets, offsets, 1, 1, 2, 2, 0.0f, 0};
        CHECK(mha_attention_varlen(g.rt, &vp, q, q, q, out) == MHA_INVALID_ARGUMENT);
        CHECK(contains(mha_last_error(), "num_seqs"));
        mha_kv_cache_config kc{1, 2, 2, 0, 64, MHA_F32};
        mha_kv_cache *cache = nullptr;
        REQUIRE(mha_kv_cache_create(g.rt, &kc, &cache) == MHA_OK);
        REQUIRE(mha_kv_cache_append(g.rt, cache, 0, 1, q, q) == MHA_OK);
        mha_cached_params cp{n, ids, offsets, 1, 0.0f, 0};
        CHECK(mha_attention_cached(g.rt, cache, &cp, q, out) == MHA_INVALID_ARGUMENT);
        CHECK(contains(mha_last_error(), "num_seqs"));
        mha_kv_cache_destroy(cache);
    }
    for (float x : out) CHECK(x == 0.0f);

    // batch 2, q_len 1, kv_len 1: the mask holds mask[b * 2^62 + j], 2^62 + 1 bytes.
    uint8_t mask[2] = {1, 1};
    mha_attention_params p{};
    p.batch = 2;
    p.q_len = p.kv_len = 1;
    p.num_heads = p.num_kv_heads = 1;
    p.head_dim = p.value_dim = 2;
    p.mask = mask;
    p.mask_batch_stride = int64_t{1} << 62;
    CHECK(mha_attention(g.rt, &p, q, q, q, out) == MHA_INVALID_ARGUMENT);
    CHECK(contains(mha_last_error(), "mask"));
    p.mask_batch_stride = 1;  // the same call with a mask that exists
    CHECK(mha_attention(g.rt, &p, q, q, q, out) == MHA_OK);
}

// Found by fuzz/fuzz_c_abi: max_tokens near INT64_MAX overflowed (signed) while rounding up to
// whole blocks, before the size check could refuse it (UBSan stops there).
TEST_CASE("a kv cache of INT64_MAX tokens is refused, not overflowed") {
    RuntimeGuard g(1);
    for (int64_t t : {INT64_MAX, INT64_MAX - 1, INT64_MAX / 2}) {
        mha_kv_cache_config kc{1, 2, 2, 0, t, MHA_F32};
        mha_kv_cache *cache = reinterpret_cast<mha_kv_cache *>(1);
        CHECK(mha_kv_cache_create(g.rt, &kc, &cache) == MHA_INVALID_ARGUMENT);
        CHECK(cache == nullptr);
        CHECK(contains(mha_last_error(), "max_tokens"));
    }
}

// Found by fuzz/fuzz_c_abi: a one-row operand's leading dimension is valid up to INT64_MAX / 4 (it
// reaches no second row), but the microkernels stepped their pointers by it past the last row,
// overflowing the address space (UBSan: pointer index expression overflowed).
TEST_CASE("mha_sgemm with one-row operands and huge leading dimensions") {
    RuntimeGuard g(1);
    const int64_t huge = INT64_MAX / 4 - 8;
    std::vector<float> a = {1, 2, 3}, b = {1, 2, 3, 4, 5, 6}, bt = {1, 2, 3};
    float c[2] = {-1, -1};
    // C[1x2] = A[1x3] B[3x2]: A is one row (lda huge), C too (ldc huge).
    REQUIRE(mha_sgemm(g.rt, 'N', 'N', 1, 2, 3, 1.0f, a.data(), huge, b.data(), 2, 0.0f, c, huge) == MHA_OK);
    CHECK(c[0] == 22.0f);
    CHECK(c[1] == 28.0f);
    // C[3x1]... as C[1x1] with k = 3: B^T stored as one row [1 x 3] (ldb huge), A^T stored [3 x 1].
    float d = -1;
    REQUIRE(mha_sgemm(g.rt, 'T', 'T', 1, 1, 3, 1.0f, a.data(), 1, bt.data(), huge, 0.0f, &d, huge) == MHA_OK);
    CHECK(d == 14.0f);
    // k = 1: B [1 x 2] is one row.
    REQUIRE(mha_sgemm(g.rt, 'N', 'N', 1, 2, 1, 1.0f, a.data(), huge, b.data(), huge, 0.0f, c, huge) == MHA_OK);
    CHECK(c[0] == 1.0f);
    CHECK(c[1] == 2.0f);
}
