// The C ABI fuzzer's shared parts: the decoder of a fuzz input into arguments (sizes that are mostly
// small but sometimes 0, negative or huge, leading dimensions below, at or above their minimum, NULL
// or valid pointers), exactly sized buffers (ASan catches any read past what the call should need),
// outputs between canaries, and the checks every call must pass:
//   - it fails with a status other than MHA_INTERNAL, a non-empty mha_last_error(), and the whole
//     output region and its canaries untouched; or
//   - it succeeds, the canaries are intact, and the outputs match a double-precision reference.
// Any violation prints "mha-fuzz: ..." (tools/fuzz counts "canary" lines) and traps.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <vector>

#include "mha/mha.h"

namespace fuzz {

[[noreturn]] inline void fail(const char *entry, const char *what) {
    std::fprintf(stderr, "mha-fuzz: %s: %s (last error: \"%s\")\n", entry, what, mha_last_error());
    __builtin_trap();
}

// Tensor data comes from a generator seeded by the input (values in [-2, 2] on a 1/64 grid), so
// the input's bytes go to the argument space.
struct Rng {
    uint64_t s;
    uint64_t next() {
        uint64_t z = (s += 0x9e3779b97f4a7c15ull);
        z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
        z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
        return z ^ (z >> 31);
    }
    float value() { return static_cast<float>(static_cast<int>(next() % 257) - 128) / 64.0f; }
};

// Reads the input front to back; past its end every read gives 0 (so a short input is a small,
// mostly valid call).
class Input {
public:
    Input(const uint8_t *data, size_t size) : p_(data), n_(size) {}
    uint8_t byte() { return i_ < n_ ? p_[i_++] : 0; }
    bool flag(int one_in = 2) { return byte() % one_in == 0; }
    uint64_t u64() {
        uint64_t v = 0;
        for (int i = 0; i < 8; ++i) v = v << 8 | byte();
        return v;
    }
    // A size: 0..9 mostly, sometimes a tile-crossing one (16..70), a negative one, or one whose
    // products overflow (>= 2^31; alone a size >= 2^61 makes any tensor it sizes overflow the
    // library's limits).
    int64_t dim() {
        const uint8_t b = byte();
        if (b < 216) return b % 10;
        if (b < 232) return kMedium[b - 216];
        return kHostile[b - 232];
    }
    int64_t small(int64_t hi) { return byte() % (hi + 1); }  // 0..hi
    // A leading dimension or stride whose minimum is min: below, at, above it, 0, or hostile.
    int64_t ld(int64_t min) {
        const uint8_t b = byte();
        switch (b % 8) {
        case 0: return min == std::numeric_limits<int64_t>::min() ? min : min - 1;
        case 1: case 2: case 3: return min;
        case 4: case 5: return min > std::numeric_limits<int64_t>::max() - 8 ? min : min + 1 + b / 64;
        case 6: return 0;
        default: return kHostile[(b / 8) % kHostileCount];
        }
    }
    float scalar() {  // alpha, beta, scale: mostly ordinary
        static constexpr float v[] = {0.0f, 1.0f, -1.0f, 0.5f, 2.0f, 0.25f, -0.75f, 1.5f,
                                      0.0f, 1.0f, 0.125f, -2.0f, INFINITY, NAN, -INFINITY, 1e30f};
        const uint8_t b = byte();
        return b < 240 ? v[b % 12] : v[12 + b % 4];
    }
    uint64_t seed() { return u64(); }
    size_t left() const { return n_ - i_; }

    static constexpr int64_t kMedium[16] = {10, 11, 12, 13, 15, 16, 17, 23, 24, 31, 32, 33, 47, 48, 64, 70};
    static constexpr int kHostileCount = 24;
    static constexpr int64_t kHostile[kHostileCount] = {
        -1, -2, -9, std::numeric_limits<int64_t>::min(), std::numeric_limits<int64_t>::min() + 1,
        std::numeric_limits<int64_t>::max(), std::numeric_limits<int64_t>::max() / 2,
        std::numeric_limits<int64_t>::max() / 4 + 1, std::numeric_limits<int64_t>::max() / 8 + 1,
        int64_t{1} << 61, int64_t{1} << 62, (int64_t{1} << 62) + 7, int64_t{1} << 31, (int64_t{1} << 31) + 1,
        int64_t{1} << 32, (int64_t{1} << 32) + 3, int64_t{3} << 40, std::numeric_limits<int64_t>::max() - 1,
        -(int64_t{1} << 62), int64_t{1} << 33, (int64_t{1} << 31) - 1, int64_t{1} << 36, -3,
        std::numeric_limits<int64_t>::max() / 3};

private:
    const uint8_t *p_;
    size_t n_, i_ = 0;
};

// Element counts, with overflow: a count is "impossible" when it overflows int64 or exceeds
// INT64_MAX / 4 (no library limit is looser); such a tensor must make the call fail if it holds any
// element. A possible count above kMaxFloats is valid but too big to allocate here: the harness
// skips that call.
constexpr int64_t kImpossible = -1;
constexpr int64_t kMaxFloats = int64_t{1} << 20;

inline int64_t mul(int64_t a, int64_t b) {
    if (a == 0 || b == 0) return 0;
    if (a == kImpossible || b == kImpossible || a < 0 || b < 0) return kImpossible;
    int64_t r;
    if (__builtin_mul_overflow(a, b, &r) || r > INT64_MAX / 4) return kImpossible;
    return r;
}
inline int64_t add(int64_t a, int64_t b) {
    int64_t r;
    if (a < 0 || b < 0 || __builtin_add_overflow(a, b, &r)) return kImpossible;
    return r;
}
inline int64_t count(std::initializer_list<int64_t> dims) {
    for (int64_t d : dims)
        if (d == 0) return 0;
    int64_t r = 1;
    for (int64_t d : dims) r = mul(r, d);
    return r;
}
// A stored rows x cols matrix with leading dimension ld: (rows - 1) * ld + cols.
inline int64_t extent(int64_t rows, int64_t cols, int64_t ld) {
    if (rows == 0 || cols == 0) return 0;
    if (rows < 0 || cols < 0 || ld < 0) return kImpossible;
    int64_t r;
    if (__builtin_mul_overflow(rows - 1, ld, &r) || __builtin_add_overflow(r, cols, &r) || r > INT64_MAX / 4)
        return kImpossible;
    return r;
}

// Thrown (caught in LLVMFuzzerTestOneInput) to skip an input whose valid call would need buffers
// too big for this harness.
struct Skip {};
inline void skip_if_too_big(int64_t n) {
    if (n > kMaxFloats) throw Skip{};
}

// An input tensor of exactly n floats (heap, so ASan bounds it), or a small one when n is impossible
// (the call must then fail, or not read it). NULL when asked.
struct In {
    std::vector<float> v;
    bool null = false;
    int64_t need = 0;
    In() = default;
    In(int64_t n, Rng &rng, bool make_null) : null(make_null), need(n < 0 ? kImpossible : n) {
        n = need;
        skip_if_too_big(n);
        v.resize(static_cast<size_t>(n == kImpossible ? 4 : n));
        for (auto &x : v) x = rng.value();
    }
    const float *ptr() const { return null ? nullptr : (v.empty() ? reinterpret_cast<const float *>(&kEmpty) : v.data()); }
    float *mut() { return const_cast<float *>(ptr()); }
    static constexpr float kEmpty = 0.0f;  // a valid, non-NULL address for an empty tensor
};

// An output region of n floats between canaries, pre-filled (with the sentinel, or by the caller
// when the call reads it too), and a copy of it all to check "nothing written" after a failure.
struct Out {
    static constexpr int kCanary = 16;
    static constexpr uint32_t kSentinelBits = 0x7fc0deadu;  // a quiet NaN nobody computes
    static constexpr uint32_t kCanaryBits = 0x7fbadbadu;
    std::vector<float> buf, saved;
    bool null = false;
    int64_t need = 0;
    Out() = default;
    Out(int64_t n, bool make_null) : null(make_null), need(n < 0 ? kImpossible : n) {
        n = need;
        skip_if_too_big(n);
        const int64_t len = n == kImpossible ? 4 : n;
        buf.resize(static_cast<size_t>(len + 2 * kCanary));
        for (auto &x : buf) std::memcpy(&x, &kCanaryBits, 4);
        for (int64_t i = 0; i < len; ++i) std::memcpy(&buf[static_cast<size_t>(kCanary + i)], &kSentinelBits, 4);
    }
    int64_t len() const { return static_cast<int64_t>(buf.size()) - 2 * kCanary; }
    float *data() { return buf.data() + kCanary; }
    const float *data() const { return buf.data() + kCanary; }
    float *ptr() { return null ? nullptr : data(); }
    void fill(Rng &rng) {
        for (int64_t i = 0; i < len(); ++i) data()[i] = rng.value();
    }
    void save() { saved = buf; }
    bool canaries_intact() const {
        for (int i = 0; i < kCanary; ++i) {
            uint32_t a, b;
            std::memcpy(&a, &buf[static_cast<size_t>(i)], 4);
            std::memcpy(&b, &buf[buf.size() - 1 - static_cast<size_t>(i)], 4);
            if (a != kCanaryBits || b != kCanaryBits) return false;
        }
        return true;
    }
    bool untouched() const { return saved.size() == buf.size() && std::memcmp(saved.data(), buf.data(), buf.size() * 4) == 0; }
    bool written(int64_t i) const {
        uint32_t a;
        std::memcpy(&a, &data()[i], 4);
        return a != kSentinelBits;
    }
};

// After a call: the status rules. Returns true when the call succeeded (then the caller compares
// the outputs). may_oom: MHA_OUT_OF_MEMORY is a possible answer.
inline bool check_status(const char *entry, mha_status st, std::initializer_list<Out *> outs, bool may_oom = false) {
    for (Out *o : outs)
        if (!o->canaries_intact()) fail(entry, "canary overwritten");
    if (st == MHA_OK) return true;
    if (st != MHA_INVALID_ARGUMENT && st != MHA_UNSUPPORTED && !(may_oom && st == MHA_OUT_OF_MEMORY))
        fail(entry, "an unexpected status");
    if (!mha_last_error()[0]) fail(entry, "failed with an empty mha_last_error()");
    for (Out *o : outs)
        if (!o->untouched()) fail(entry, "canary: a failed call wrote its output");
    return false;
}

// |got - want| <= atol + rtol * mag (mag: the magnitude bounding the rounding error).
inline void expect_close(const char *entry, const char *what, double got, double want, double atol, double mag = 0) {
    const double tol = atol + 1e-5 * std::fabs(want) + 2e-6 * mag;
    if (!(std::fabs(got - want) <= tol)) {
        std::fprintf(stderr, "mha-fuzz: %s: %s = %.9g, the reference gives %.9g\n", entry, what, got, want);
        fail(entry, "mismatch with the reference");
    }
}

// With |scale| beyond this, scores of a few units become ~1e2 apart or more, and the softmax of fp32
// scores against double ones is ill-conditioned: two keys a rounding apart may split their weight
// one way in fp32 and the other in double (the 10^6 run met scale 1e30 with a near tie). Such calls
// are checked only for what holds under any rounding (expect_convex), not against the reference.
inline bool well_conditioned(double scale) { return std::fabs(scale) <= 64; }

// The score modifiers of an attention call (mha_attention_variant), read after everything else
// so that inputs written before they existed decode as before (past the end every byte is 0: no
// modifier). Each is on in some inputs, with a bad value now and then; the arrays hold exactly
// num_heads values (none for a bad or huge head count). Returns whether any modifies the scores.
inline bool decode_variant(Input &in, Rng &rng, int64_t num_heads, mha_attention_variant &v, std::vector<float> &slopes,
                           std::vector<float> &sinks) {
    const uint8_t sel = in.byte();
    if (sel & 1) v.window = sel & 2 ? in.dim() : 1 + in.small(12);
    if (sel & 4) v.softcap = sel & 8 ? in.scalar() : 0.5f + static_cast<float>(in.small(100));
    const bool heads_ok = num_heads > 0 && num_heads <= 4096;
    if (sel & 16 && heads_ok) {
        for (int64_t h = 0; h < num_heads; ++h)
            slopes.push_back(in.flag(16) ? in.scalar() : std::exp2(-static_cast<float>(rng.next() % 9)));
        v.alibi_slopes = slopes.data();
    }
    if (sel & 32 && heads_ok) {
        for (int64_t h = 0; h < num_heads; ++h)
            sinks.push_back(in.flag(16) ? in.scalar() : 0.5f * static_cast<float>(rng.next() % 9) - 2.0f);
        v.sink_logits = sinks.data();
    }
    return v.softcap != 0.0f || v.alibi_slopes;
}

// What the library must refuse: a negative window, a softcap that is negative or not finite, a
// slope that is not finite, a sink that is NaN or +inf.
inline bool variant_valid(const mha_attention_variant &v, int64_t num_heads) {
    if (v.window < 0 || !std::isfinite(v.softcap) || v.softcap < 0) return false;
    for (int64_t h = 0; (v.alibi_slopes || v.sink_logits) && h < num_heads; ++h) {  // (no arrays: no loop over a huge count)
        if (v.alibi_slopes && !std::isfinite(v.alibi_slopes[h])) return false;
        if (v.sink_logits && (std::isnan(v.sink_logits[h]) || v.sink_logits[h] == INFINITY)) return false;
    }
    return true;
}

// Whether the reference comparison is meaningful: slopes within 1 and sinks within 64 (else a
// bias or a sink of 1e30 decides near ties differently in fp32 and double).
inline bool variant_conditioned(const mha_attention_variant &v, int64_t num_heads) {
    for (int64_t h = 0; (v.alibi_slopes || v.sink_logits) && h < num_heads; ++h) {
        if (v.alibi_slopes && std::fabs(v.alibi_slopes[h]) > 1) return false;
        if (v.sink_logits && std::fabs(v.sink_logits[h]) > 64 && v.sink_logits[h] != -INFINITY) return false;
    }
    return true;
}

// Every output of an attention is a convex combination of V values (or 0 for a row with no visible
// key): within [min V, max V] of all the V the call was given, widened by a rounding.
inline void expect_convex(const char *entry, const float *out, size_t n, const std::vector<float> &v) {
    double lo = 0, hi = 0;
    for (float x : v) lo = std::min(lo, static_cast<double>(x)), hi = std::max(hi, static_cast<double>(x));
    const double slack = 1e-5 * (1 + std::max(-lo, hi));
    for (size_t i = 0; i < n; ++i)
        if (!(out[i] >= lo - slack && out[i] <= hi + slack)) {
            std::fprintf(stderr, "mha-fuzz: %s: out = %.9g outside the V range [%g, %g]\n", entry, out[i], lo, hi);
            fail(entry, "an output that no softmax of V gives");
        }
}

// The runtimes: created once per process, one with 1 thread and one with 2.
mha_runtime *runtime(int which);
inline mha_runtime *pick_runtime(Input &in) {
    const uint8_t b = in.byte();
    if (b % 32 == 31) return nullptr;
    return runtime(b & 1);
}

// Entry points, one decoder each (c_abi_entries.cpp, c_abi_layer.cpp).
void fuzz_sgemm(Input &in);
void fuzz_softmax(Input &in);
void fuzz_attention(Input &in);
void fuzz_varlen(Input &in);
void fuzz_kv_cache(Input &in);
void fuzz_layer(Input &in);
void fuzz_layer_cached(Input &in);
void fuzz_encoder(Input &in);
void fuzz_misc(Input &in);

} // namespace fuzz
