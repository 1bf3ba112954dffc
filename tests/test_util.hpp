// Helpers shared by the doctest suites.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <stdexcept>
#include <vector>

#include "mha/layer.hpp"
#include "mha/runtime.hpp"

namespace mha::test {

// count floats uniform in [lo, hi): the values std::uniform_real_distribution<float>(lo, hi) draws
// from std::mt19937(seed) in libstdc++ (one draw u a value: u / 2^32 rounded to float, below 1,
// times hi - lo, plus lo), computed without its generate_canonical, which takes a long-double
// logarithm every value: a third of the sanitized test_gemm's time went there.
inline std::vector<float> random_floats(size_t count, uint32_t seed, float lo = -1.0f, float hi = 1.0f) {
    std::mt19937 gen(seed);
    constexpr float below_one = 0x1.fffffep-1f;  // std::nextafter(1.0f, 0.0f)
    std::vector<float> v(count);
    for (auto &x : v) {
        const float u = static_cast<float>(gen()) * 0x1p-32f;
        x = (u < 1.0f ? u : below_one) * (hi - lo) + lo;
    }
    return v;
}

inline bool same_bits(const std::vector<float> &a, const std::vector<float> &b) {
    // (memcmp of two empty vectors' NULL data is undefined: clang's UBSan stops there)
    return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
}

// MHA_TEST_REDUCED=1 (tools/tsan sets it): the few heaviest cases run a smaller share of their
// inputs, so every suite fits in a few minutes under ThreadSanitizer. Unset, nothing changes.
inline bool reduced() {
    static const bool on = [] {
        const char *e = std::getenv("MHA_TEST_REDUCED");
        return e != nullptr && *e != '\0' && std::strcmp(e, "0") != 0;
    }();
    return on;
}

// A layer's sizes; 0 takes the layer's default (Hkv = H, head_dim = value_dim = E / H, kdim = vdim
// = E, LayerNorm's eps 1e-5).
inline LayerConfig layer_config(int64_t E, int64_t H, int64_t Hkv = 0, int64_t hd = 0, int64_t vd = 0,
                                int64_t kdim = 0, int64_t vdim = 0, float eps = 0.0f) {
    LayerConfig c;
    c.embed_dim = E;
    c.num_heads = H;
    c.num_kv_heads = Hkv;
    c.head_dim = hd;
    c.value_dim = vd;
    c.kdim = kdim;
    c.vdim = vdim;
    c.norm_eps = eps;
    return c;
}

// A value no kernel produces from the test inputs, written into padding to catch stray writes.
constexpr float kSentinel = -12345.75f;

// The runtimes that run `like`'s calls (its threads, ISA and tiles) under each register transpose
// (TileConfig::transpose, gemm/transpose_variant.hpp): [0] shuffles, [1] inserts. MHA_TRANSPOSE in
// the environment would override both: the constructor then throws rather than let a test compare
// one transpose with itself.
struct BothTransposes {
    std::unique_ptr<Runtime> rt[2];
    explicit BothTransposes(const Runtime &like) {
        for (int v = 0; v < 2; ++v) {
            TileConfig t = like.tiles();
            t.transpose = v ? "inserts" : "shuffles";
            rt[v] = std::make_unique<Runtime>(RuntimeOptions{like.num_threads(), like.isa(), t, {}});
            if (rt[v]->tiles().transpose != t.transpose)
                throw std::runtime_error("MHA_TRANSPOSE is set: it overrides the tiles' transpose, so both would be one");
        }
    }
};

} // namespace mha::test
