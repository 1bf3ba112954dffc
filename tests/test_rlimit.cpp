// Real allocation failures: the address space is capped with setrlimit(RLIMIT_AS) just above what
// the process holds, then calls that need more than the cap must answer MHA_OUT_OF_MEMORY with a
// message, write nothing, and leave the runtime, layer and cache serving small calls with the bits
// they gave before the cap. A program of its own (not doctest) because the cap is for the whole
// process; not built under the sanitizers, whose shadow memory needs terabytes of address space.
#include <sys/resource.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "mha/mha.h"
#include "test_util.hpp"

namespace {

int g_failures = 0;

void check(bool ok, const char *what) {
    std::printf("%s: %s\n", ok ? "ok  " : "FAIL", what);
    if (!ok) ++g_failures;
}

size_t address_space_bytes() {
    std::ifstream status("/proc/self/status");
    std::string key;
    while (status >> key) {
        if (key == "VmSize:") {
            size_t kib = 0;
            status >> kib;
            return kib * 1024;
        }
        status.ignore(1 << 20, '\n');
    }
    return 0;
}

bool untouched(const std::vector<float> &v) {
    for (float x : v)
        if (std::memcmp(&x, &mha::test::kSentinel, sizeof x) != 0) return false;
    return true;
}

} // namespace

int main() {
    using mha::test::random_floats;
    using mha::test::same_bits;
    mha_runtime *rt = nullptr;
    if (mha_runtime_create(2, &rt) != MHA_OK) return 2;

    // A small layer and cache, with their results before the cap.
    const int64_t E = 64, H = 4, T = 96;
    const auto wq = random_floats(E * E, 1), wk = random_floats(E * E, 2), wv = random_floats(E * E, 3),
               wo = random_floats(E * E, 4), x = random_floats(T * E, 5);
    mha_layer_config lc{};
    lc.embed_dim = E;
    lc.num_heads = H;
    mha_layer_weights lw{};
    lw.q_weight = wq.data();
    lw.k_weight = wk.data();
    lw.v_weight = wv.data();
    lw.out_weight = wo.data();
    mha_layer *layer = nullptr;
    if (mha_layer_create(rt, &lc, &lw, &layer) != MHA_OK) return 2;
    mha_layer_forward_params fp{};
    fp.batch = 1;
    fp.q_len = T;
    fp.causal = 1;
    std::vector<float> before(T * E), after(T * E);
    if (mha_layer_forward(rt, layer, &fp, x.data(), nullptr, nullptr, before.data()) != MHA_OK) return 2;
    mha_kv_cache_config cc{};
    cc.num_kv_heads = H;
    cc.head_dim = cc.value_dim = E / H;
    cc.max_tokens = 4096;
    mha_kv_cache *cache = nullptr;
    if (mha_kv_cache_create(rt, &cc, &cache) != MHA_OK) return 2;
    const int64_t seq = 3, offsets[2] = {0, T};
    mha_layer_cached_params cp{};
    cp.num_seqs = 1;
    cp.seq_ids = &seq;
    cp.q_offsets = offsets;
    cp.causal = 1;

    // What the oversized calls take from the caller, allocated before the cap: a layer's weights
    // of 4 x 64 MiB (packing them needs as much again), and 2^20 tokens of E 64 for the forward,
    // whose projections need 3 x 256 MiB of scratch.
    const int64_t big_e = 4096, big_tokens = int64_t{1} << 20;
    std::vector<float> big_w(static_cast<size_t>(big_e * big_e), 0.5f);
    std::vector<float> big_x(static_cast<size_t>(big_tokens * E), 0.25f);
    std::vector<float> big_out(static_cast<size_t>(big_tokens * E), mha::test::kSentinel);

    const size_t headroom = size_t{192} << 20;
    const rlim_t cap = address_space_bytes() + headroom;
    rlimit lim{cap, cap};
    if (setrlimit(RLIMIT_AS, &lim) != 0) {
        std::perror("setrlimit");
        return 2;
    }
    std::printf("address space capped at %.0f MiB (%.0f MiB above what the process holds)\n", cap / 1048576.0,
                headroom / 1048576.0);

    mha_layer_config big{};
    big.embed_dim = big_e;
    big.num_heads = 32;
    mha_layer_weights bw{big_w.data(), big_w.data(), big_w.data(), big_w.data()};
    mha_layer *big_layer = nullptr;
    mha_status st = mha_layer_create(rt, &big, &bw, &big_layer);
    std::printf("  layer E %lld: %s\n", static_cast<long long>(big_e), mha_last_error());
    check(st == MHA_OUT_OF_MEMORY && big_layer == nullptr && *mha_last_error(), "a layer whose packed weights do not fit");

    mha_kv_cache_config bc = cc;
    bc.max_tokens = int64_t{1} << 22;  // 2 GiB of K and V
    mha_kv_cache *big_cache = nullptr;
    st = mha_kv_cache_create(rt, &bc, &big_cache);
    std::printf("  cache of 2^22 tokens: %s\n", mha_last_error());
    check(st == MHA_OUT_OF_MEMORY && big_cache == nullptr && *mha_last_error(), "a KV cache that does not fit");

    mha_layer_forward_params bp{};
    bp.batch = 1;
    bp.q_len = big_tokens;
    bp.kv_len = 1;  // cross-attention to one key: the projections' scratch is what does not fit
    st = mha_layer_forward(rt, layer, &bp, big_x.data(), x.data(), x.data(), big_out.data());
    std::printf("  forward of 2^20 tokens: %s\n", mha_last_error());
    check(st == MHA_OUT_OF_MEMORY && *mha_last_error(), "a forward whose scratch does not fit");
    check(untouched(big_out), "... and wrote nothing");

    const int64_t big_offsets[2] = {0, big_tokens};
    mha_layer_cached_params bcp = cp;
    bcp.q_offsets = big_offsets;
    int64_t free_before = 0, free_after = -1;
    mha_kv_cache_free_tokens(cache, &free_before);
    st = mha_layer_forward_cached(rt, layer, cache, &bcp, big_x.data(), big_out.data());
    mha_kv_cache_free_tokens(cache, &free_after);
    check(st == MHA_OUT_OF_MEMORY && untouched(big_out) && free_after == free_before,
          "a cached forward that does not fit: nothing appended or written");

    // Everything still serves, with the same bits.
    st = mha_layer_forward(rt, layer, &fp, x.data(), nullptr, nullptr, after.data());
    check(st == MHA_OK && same_bits(before, after), "the layer's next forward: the bits of before the cap");
    std::vector<float> cached(T * E);
    st = mha_layer_forward_cached(rt, layer, cache, &cp, x.data(), cached.data());
    check(st == MHA_OK && same_bits(before, cached), "the cache's next prefill: the bits of the dense forward");

    mha_kv_cache_destroy(cache);
    mha_layer_destroy(layer);
    mha_runtime_destroy(rt);
    std::printf("%d failed\n", g_failures);
    return g_failures == 0 ? 0 : 1;
}
