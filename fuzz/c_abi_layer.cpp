// The C ABI fuzzer: the attention layer (create, forward, forward_varlen, forward_cached over a KV
// cache) and the encoder layer (create, forward, forward_varlen), against a double reference built
// from tests/reference.hpp (linear, attention, layer_norm), with the config's score modifiers and
// RoPE. Those are decoded after every other field of the entry (older inputs decode as before), so
// each entry decodes all its arguments first and creates its layer just before the first call.
#include <map>
#include <set>

#include "c_abi_fuzz.hpp"
#include "reference.hpp"

namespace fuzz {
namespace {

// A layer config as decoded, and as the library should resolve its zeros.
struct LayerShape {
    mha_layer_config c{};
    int64_t E = 0, H = 0, Hkv = 0, hd = 0, vd = 0, kd = 0, vdim = 0;
    double eps = 1e-5;
    bool plausible = false;  // every resolved size positive (else create must fail)
    // The score modifiers and RoPE (decode_modifiers; none until it runs).
    std::vector<float> slopes, sinks;   // c.variant's arrays point here
    bool mods_valid = true;             // else create must fail
    bool mods_conditioned = true;       // else the outputs are not compared with the reference
    bool mods_any = false;              // some modifier changes the scores (softcap, ALiBi, RoPE)
};

LayerShape decode_layer(Input &in, bool self_only) {
    LayerShape s;
    mha_layer_config &c = s.c;
    c.num_heads = in.dim();
    const uint8_t b = in.byte();
    // embed_dim: mostly a multiple of num_heads, so that the 0 defaults resolve.
    c.embed_dim = b < 200 ? mul(c.num_heads, 1 + b % 4) : in.dim();
    if (c.embed_dim == kImpossible) c.embed_dim = in.dim();
    const uint8_t o = in.byte();
    c.num_kv_heads = o & 1 ? 0 : (o & 2 ? (c.num_heads % 2 == 0 && c.num_heads > 0 ? c.num_heads / 2 : 1) : in.dim());
    c.head_dim = o & 4 ? 0 : in.dim();
    c.value_dim = o & 8 ? 0 : (o & 16 ? c.head_dim : in.dim());
    c.kdim = self_only || o & 32 ? 0 : in.dim();
    c.vdim = self_only || o & 64 ? 0 : in.dim();
    const uint8_t d = in.byte();
    const int dtype = d < 245 ? 0 : (d % 2 ? 1 : -5);
    std::memcpy(&c.weight_dtype, &dtype, sizeof dtype);
    const uint8_t nb = in.byte();
    c.norm = nb < 240 ? nb % 3 : (nb % 2 ? 3 : -1);
    static constexpr float eps[] = {0.0f, 0.0f, 1e-6f, 1e-5f, 0.1f, 1.0f, -1e-5f, NAN};
    c.norm_eps = eps[in.byte() % 8];
    s.E = c.embed_dim;
    s.H = c.num_heads;
    s.Hkv = c.num_kv_heads ? c.num_kv_heads : c.num_heads;
    const int64_t per_head = c.num_heads > 0 && c.embed_dim >= 0 ? c.embed_dim / c.num_heads : 0;
    s.hd = c.head_dim ? c.head_dim : per_head;
    s.vd = c.value_dim ? c.value_dim : per_head;
    s.kd = c.kdim ? c.kdim : c.embed_dim;
    s.vdim = c.vdim ? c.vdim : c.embed_dim;
    s.eps = c.norm_eps != 0.0f ? c.norm_eps : 1e-5;
    s.plausible = s.E > 0 && s.H > 0 && s.Hkv > 0 && s.H % s.Hkv == 0 && s.hd > 0 && s.vd > 0 && s.kd > 0 && s.vdim > 0 &&
                  dtype == 0 && c.norm >= 0 && c.norm <= 2 && c.norm_eps >= 0.0f;
    return s;
}

// The config's variant (c_abi_fuzz.hpp's decode_variant) and RoPE, read after every other field of
// the entry. RoPE: dims mostly even in [2, head_dim], sometimes head_dim itself, odd, negative or
// past head_dim; theta and position_scale mostly ordinary, sometimes negative, NaN or infinite.
void decode_modifiers(Input &in, Rng &rng, LayerShape &s) {
    mha_layer_config &c = s.c;
    s.slopes.clear();
    s.sinks.clear();
    c.variant = mha_attention_variant{};
    c.rope = mha_rope{};
    const bool scores = decode_variant(in, rng, s.H, c.variant, s.slopes, s.sinks);
    const uint8_t sel = in.byte();
    if (sel & 1) {
        const uint8_t d = in.byte(), t = in.byte(), ps = in.byte();
        const int64_t hd = s.hd, half = hd > 1 && hd <= 4096 ? hd / 2 : 1;
        const int64_t odd_dims[8] = {hd, -2, 1, 3, hd < (int64_t{1} << 40) ? hd + 2 : -4, hd < (int64_t{1} << 40) ? hd + 1 : 5,
                                     INT64_MIN, 0};
        c.rope.dims = d < 224 ? 2 * (1 + d % half) : odd_dims[d % 8];
        static constexpr float thetas[16] = {0.0f, 10000.0f, 100.0f, 10.0f, 2.0f, 1e6f, 0.5f, 500000.0f,
                                             0.0f, 10000.0f, 1.0f, 3.0f, -1.0f, NAN, INFINITY, -INFINITY};
        c.rope.theta = t < 240 ? thetas[t % 12] : thetas[12 + t % 4];
        static constexpr float scales[16] = {0.0f, 1.0f, 0.5f, 0.25f, 2.0f, 4.0f, 0.125f, 0.0f,
                                             1.0f, 1.0f, 3.0f, 0.75f, -1.0f, NAN, INFINITY, -0.5f};
        c.rope.position_scale = ps < 240 ? scales[ps % 12] : scales[12 + ps % 4];
        c.rope.interleaved = sel >> 1 & 1;
    }
    const mha_rope &r = c.rope;
    // mha.h: dims even in [0, head_dim], theta not negative, NaN or infinite; the library also
    // refuses a negative or non-finite position_scale (src/layer/layer.cpp, LayerConfig::resolved).
    s.mods_valid = variant_valid(c.variant, s.H) && r.dims >= 0 && r.dims % 2 == 0 && r.dims <= s.hd &&
                   std::isfinite(r.theta) && r.theta >= 0.0f && std::isfinite(r.position_scale) && r.position_scale >= 0.0f;
    s.mods_conditioned = variant_conditioned(c.variant, s.H);
    s.mods_any = scores || r.dims != 0;
}

// RoPE on rows of a projection in double: x [tokens, heads * hd], token t at position pos0 + t. The
// first dims of every head turn pairwise by the angle pos * position_scale * theta^(-2d/dims); the
// angle itself is taken as mha.h has it, in fp32 (as PyTorch's reference code), since at hundreds of
// radians its fp32 rounding (~1e-5) is more than the comparison could absorb; the rotation is in
// double.
void rope_ref(const LayerShape &s, std::vector<double> &x, int64_t tokens, int64_t heads, int64_t pos0) {
    const mha_rope &r = s.c.rope;
    if (r.dims == 0) return;
    const int64_t half = r.dims / 2;
    const float theta = r.theta != 0.0f ? r.theta : 10000.0f, scale = r.position_scale != 0.0f ? r.position_scale : 1.0f;
    for (int64_t t = 0; t < tokens; ++t)
        for (int64_t d = 0; d < half; ++d) {
            const float inv_freq = 1.0f / std::pow(theta, static_cast<float>(2 * d) / static_cast<float>(r.dims));
            const float pos = static_cast<float>(pos0 + t) * scale;
            const float angle = pos * inv_freq;
            const double c = std::cos(static_cast<double>(angle)), sn = std::sin(static_cast<double>(angle));
            // pairs (x[d], x[d + dims/2]) (rotate_half), or (x[2d], x[2d + 1]) when interleaved
            const int64_t i1 = r.interleaved ? 2 * d : d, i2 = r.interleaved ? 2 * d + 1 : d + half;
            for (int64_t h = 0; h < heads; ++h) {
                double *y = x.data() + (t * heads + h) * s.hd;
                const double x1 = y[i1], x2 = y[i2];
                y[i1] = x1 * c - x2 * sn;
                y[i2] = x2 * c + x1 * sn;
            }
        }
}

struct LayerWeights {
    In wq, wk, wv, wo, bq, bk, bv, bo, nw, nb;
    mha_layer_weights w{};
};

void make_weights(const LayerShape &s, Input &in, Rng &rng, LayerWeights &lw) {
    const uint8_t nulls = in.byte(), biases = in.byte();
    lw.wq = In(count({s.H, s.hd, s.E}), rng, nulls % 32 == 1);
    lw.wk = In(count({s.Hkv, s.hd, s.kd}), rng, nulls % 32 == 2);
    lw.wv = In(count({s.Hkv, s.vd, s.vdim}), rng, nulls % 32 == 3);
    lw.wo = In(count({s.E, s.H, s.vd}), rng, nulls % 32 == 4);
    lw.bq = In(count({s.H, s.hd}), rng, biases & 1);
    lw.bk = In(count({s.Hkv, s.hd}), rng, biases & 2);
    lw.bv = In(count({s.Hkv, s.vd}), rng, biases & 4);
    lw.bo = In(s.E, rng, biases & 8);
    lw.nw = In(s.E, rng, biases & 16);
    lw.nb = In(s.E, rng, biases & 32);
    // Weights of about 1/sqrt(fan-in), so outputs stay O(1).
    for (In *t : {&lw.wq, &lw.wk, &lw.wv, &lw.wo})
        for (auto &x : t->v) x *= 0.25f;
    lw.w = mha_layer_weights{lw.wq.ptr(), lw.wk.ptr(), lw.wv.ptr(), lw.wo.ptr(), lw.bq.ptr(), lw.bk.ptr(),
                             lw.bv.ptr(), lw.bo.ptr(), lw.nw.ptr(), lw.nb.ptr()};
}

bool weights_complete(const LayerWeights &lw) {
    for (const In *t : {&lw.wq, &lw.wk, &lw.wv, &lw.wo})
        if (t->null || t->need == kImpossible) return false;
    return true;
}

const float *opt(const In &t) { return t.null ? nullptr : t.v.data(); }

// LayerNorm rows of n, with the per-row tolerance its amplification calls for.
std::vector<double> norm_rows(const std::vector<double> &x, int64_t rows, int64_t n, const In &w, const In &b, double eps,
                              std::vector<double> *tol) {
    if (tol) {
        tol->assign(static_cast<size_t>(rows), 0.0);
        for (int64_t r = 0; r < rows; ++r) {
            double mean = 0, var = 0, big = 0;
            for (int64_t i = 0; i < n; ++i) mean += x[static_cast<size_t>(r * n + i)];
            mean /= static_cast<double>(n);
            for (int64_t i = 0; i < n; ++i) {
                const double d = x[static_cast<size_t>(r * n + i)] - mean;
                var += d * d;
                big = std::max(big, std::fabs(x[static_cast<size_t>(r * n + i)]));
            }
            var /= static_cast<double>(n);
            (*tol)[static_cast<size_t>(r)] = 1e-4 * (1 + 2 * big / std::sqrt(var + eps));
        }
    }
    return mha::ref::layer_norm(x, rows, n, opt(w), opt(b), eps);
}

// The attention sub-block for one sequence of the layer: q_rows [lq, E] (already normalized for
// pre-norm), k_rows [lk, kd], v_rows [lk, vdim] -> [lq, E] (out projection and bias included).
std::vector<double> attend(const LayerShape &s, const LayerWeights &lw, const std::vector<double> &q_rows, int64_t lq,
                           const std::vector<double> &k_rows, const std::vector<double> &v_rows, int64_t lk, bool causal,
                           const int32_t *valid, const uint8_t *mask, int64_t mrs, std::vector<double> *weights,
                           std::vector<double> *mag = nullptr) {
    auto Q = mha::ref::linear(q_rows.data(), lq, s.E, lw.wq.v.data(), opt(lw.bq), s.H * s.hd);
    auto K = mha::ref::linear(k_rows.data(), lk, s.kd, lw.wk.v.data(), opt(lw.bk), s.Hkv * s.hd);
    const auto V = mha::ref::linear(v_rows.data(), lk, s.vdim, lw.wv.v.data(), opt(lw.bv), s.Hkv * s.vd);
    // Positions (mha.h): query i at i + lk - lq, key j at j; for the cached layer, where the lq new
    // tokens are the last of lk, that is each token's index in its sequence.
    rope_ref(s, Q, lq, s.H, lk - lq);
    rope_ref(s, K, lk, s.Hkv, 0);
    mha::ref::AttentionCase c{1, lq, lk, s.H, s.Hkv, s.hd, s.vd, 1.0 / std::sqrt(static_cast<double>(s.hd)), causal,
                              valid, mask, 0, mrs};
    c.window = s.c.variant.window;
    c.softcap = s.c.variant.softcap;
    c.alibi = s.c.variant.alibi_slopes;
    c.sinks = s.c.variant.sink_logits;
    std::vector<double> O;
    mha::ref::attention(c, Q.data(), K.data(), V.data(), O, weights);
    if (mag) {  // what the output projection sums, in magnitude: its rounding error scales with it
        std::vector<double> abs_o(O.size());
        std::vector<float> abs_wo(lw.wo.v.size()), abs_bo;
        for (size_t i = 0; i < O.size(); ++i) abs_o[i] = std::fabs(O[i]);
        for (size_t i = 0; i < abs_wo.size(); ++i) abs_wo[i] = std::fabs(lw.wo.v[i]);
        if (opt(lw.bo)) for (float b : lw.bo.v) abs_bo.push_back(std::fabs(b));
        *mag = mha::ref::linear(abs_o.data(), lq, s.H * s.vd, abs_wo.data(), abs_bo.empty() ? nullptr : abs_bo.data(), s.E);
    }
    return mha::ref::linear(O.data(), lq, s.H * s.vd, lw.wo.v.data(), opt(lw.bo), s.E);
}

std::vector<double> to_double(const float *x, int64_t n) { return std::vector<double>(x, x + n); }

// out rows of the whole layer for one sequence: x [lq, E] queries; key/value rows (self: x).
// tol gets a tolerance per row.
std::vector<double> layer_ref(const LayerShape &s, const LayerWeights &lw, const float *x, int64_t lq, const float *key,
                              const float *value, int64_t lk, bool self, bool causal, const int32_t *valid,
                              const uint8_t *mask, int64_t mrs, std::vector<double> *weights, std::vector<double> &tol) {
    const auto X = to_double(x, lq * s.E);
    const int norm = s.c.norm;
    std::vector<double> qin = X;
    if (norm == MHA_NORM_PRE) qin = norm_rows(X, lq, s.E, lw.nw, lw.nb, s.eps, nullptr);
    const std::vector<double> kin = self ? qin : to_double(key, lk * s.kd), vin = self ? qin : to_double(value, lk * s.vdim);
    std::vector<double> mag;
    auto f = attend(s, lw, qin, lq, kin, vin, lk, causal, valid, mask, mrs, weights, &mag);
    // Each row's tolerance grows with the largest sum its output projection and residual make (a
    // wide layer's fp32 sums round at that scale, however small the result).
    tol.assign(static_cast<size_t>(lq), 2e-4);
    for (int64_t r = 0; r < lq; ++r) {
        double big = 0;
        for (int64_t i = 0; i < s.E; ++i)
            big = std::max(big, mag[static_cast<size_t>(r * s.E + i)] + (norm == MHA_NORM_NONE ? 0.0 : std::fabs(X[static_cast<size_t>(r * s.E + i)])));
        tol[static_cast<size_t>(r)] += 4e-6 * big;
    }
    if (norm == MHA_NORM_NONE) return f;
    for (size_t i = 0; i < f.size(); ++i) f[i] += X[i];
    if (norm == MHA_NORM_PRE) return f;
    return norm_rows(f, lq, s.E, lw.nw, lw.nb, s.eps, &tol);
}

// The layer's rows against the reference; with a variant too ill-conditioned for that (slopes past 1,
// sinks past 64, as for mha_attention) only what holds under any rounding: finite inputs give finite
// outputs.
void compare_rows(const char *E, const char *what, const float *got, const std::vector<double> &want, int64_t width,
                  const std::vector<double> &tol, const LayerShape &s) {
    if (!s.mods_conditioned) {
        for (size_t i = 0; i < want.size(); ++i)
            if (!std::isfinite(got[i])) {
                std::fprintf(stderr, "mha-fuzz: %s: %s[%zu] = %g from finite inputs\n", E, what, i, got[i]);
                fail(E, "a non-finite output");
            }
        return;
    }
    for (size_t i = 0; i < want.size(); ++i) expect_close(E, what, got[i], want[i], tol[i / static_cast<size_t>(width)]);
}

// The arguments of create (the weights, the NULL choices), decoded; create_layer makes the call.
uint8_t decode_create(Input &in, const LayerShape &s, LayerWeights &lw, Rng &rng) {
    make_weights(s, in, rng, lw);
    return in.byte();
}

mha_layer *create_layer(mha_runtime *rt, LayerShape &s, LayerWeights &lw, uint8_t nulls, const char *E) {
    mha_layer *layer = reinterpret_cast<mha_layer *>(8);
    const mha_status st = mha_layer_create(nulls % 32 == 1 ? nullptr : rt, nulls % 32 == 2 ? nullptr : &s.c,
                                           nulls % 32 == 3 ? nullptr : &lw.w, &layer);
    if (st != MHA_OK) {
        if (st == MHA_INTERNAL || !mha_last_error()[0]) fail(E, "create failed without a proper status and message");
        if (layer) fail(E, "a failed create left *out set");
        return nullptr;
    }
    if (!rt || (nulls % 32 != 0 && nulls % 32 <= 3)) fail(E, "create accepted NULL arguments");
    if (!s.plausible || !weights_complete(lw)) fail(E, "create accepted a bad config or missing weights");
    if (!s.mods_valid) fail(E, "create accepted a bad variant or rope");
    return layer;
}

struct LayerGuard {
    mha_layer *l;
    ~LayerGuard() { mha_layer_destroy(l); }
};

// Forward params shared by the layer and the encoder: batch, lengths, causal, valid_lens, mask.
struct Forward {
    mha_layer_forward_params p{};
    std::vector<int32_t> valid;
    std::vector<uint8_t> mask;
    int64_t lk = 0;            // the key length the call should use
    bool mask_ok = true;       // the mask array covers what the strides address
};

Forward decode_forward(Input &in, Rng &rng, bool self) {
    Forward f;
    mha_layer_forward_params &p = f.p;
    p.batch = in.small(3);
    if (in.flag(32)) p.batch = in.dim();
    p.q_len = in.dim();
    const uint8_t kl = in.byte();
    p.kv_len = self ? (kl % 4 == 0 ? p.q_len : (kl % 4 == 3 ? in.dim() : 0)) : in.dim();
    f.lk = self && p.kv_len == 0 ? p.q_len : p.kv_len;
    const uint8_t o = in.byte();
    p.causal = o & 1;
    if (o & 2 && p.batch >= 0 && p.batch <= 16) {
        f.valid.resize(static_cast<size_t>(p.batch > 0 ? p.batch : 1));
        for (auto &v : f.valid)
            v = static_cast<int32_t>(f.lk >= 0 && f.lk < 1000 ? rng.next() % static_cast<uint64_t>(f.lk + 1) : 0);
        if (o & 16) f.valid[0] = o & 32 ? -1 : static_cast<int32_t>(f.lk < 1000 ? f.lk + 1 : 0);
        p.kv_valid_lens = f.valid.data();
    }
    if (o & 4) {
        // Per batch and row, or broadcast; or strides below the minimum.
        p.mask_row_stride = o & 64 ? 0 : in.ld(f.lk);
        p.mask_batch_stride = o & 128 ? 0 : in.ld(0);
        const int64_t a = p.batch > 0 ? mul(p.batch - 1, p.mask_batch_stride) : 0;
        const int64_t b = p.q_len > 0 ? mul(p.q_len - 1, p.mask_row_stride) : 0;
        int64_t need = 0;
        if (p.batch > 0 && p.q_len > 0 && f.lk > 0) {
            need = a == kImpossible || b == kImpossible || p.mask_row_stride < 0 || p.mask_batch_stride < 0 || f.lk < 0
                       ? kImpossible
                       : add(add(a, b), f.lk);
            if (need != kImpossible && need > (int64_t{1} << 20)) throw Skip{};
        }
        f.mask_ok = need != kImpossible;
        f.mask.resize(static_cast<size_t>(need > 0 ? need : 1));
        for (auto &m : f.mask) m = rng.next() % 3 != 0;
        p.mask = f.mask.data();
    }
    return f;
}

} // namespace

void fuzz_layer(Input &in) {
    const char *E = "mha_layer";
    mha_runtime *rt = pick_runtime(in);
    LayerShape s = decode_layer(in, false);
    Rng rng{in.seed()};
    const bool self = in.flag(3) || (s.kd == s.E && s.vdim == s.E && in.flag());
    Forward f = decode_forward(in, rng, self);
    auto &p = f.p;
    if (count({p.batch, p.q_len, f.lk, s.H, add(s.hd, s.vd)}) > (int64_t{1} << 16) ||
        count({p.batch, add(p.q_len, f.lk), add(add(s.E, s.kd), s.vdim), s.H, add(s.hd, s.vd)}) > (int64_t{1} << 18))
        throw Skip{};
    LayerWeights lw;
    const uint8_t create_nulls = decode_create(in, s, lw, rng);
    const uint8_t mode = in.byte();
    LayerGuard guard{nullptr};
    if (mode % 4 == 3) {  // forward_varlen: self-attention over a ragged batch
        const int64_t n = in.small(4);
        std::vector<int64_t> off(static_cast<size_t>(n + 1), 0);
        for (int64_t i = 0; i < n; ++i) off[static_cast<size_t>(i + 1)] = off[static_cast<size_t>(i)] + in.small(6);
        if (in.flag(8)) off[in.byte() % off.size()] = in.dim();
        bool ok = off[0] == 0;
        for (int64_t i = 0; i < n; ++i) ok = ok && off[static_cast<size_t>(i + 1)] >= off[static_cast<size_t>(i)];
        const int64_t total = ok ? off.back() : 0;
        In x(count({total, s.E}), rng, in.flag(32));
        Out out(count({total, s.E}), in.flag(32));
        out.save();
        const bool causal = in.flag();
        decode_modifiers(in, rng, s);
        mha_layer *layer = guard.l = create_layer(rt, s, lw, create_nulls, E);
        if (!layer) return;
        const mha_status st = mha_layer_forward_varlen(rt, layer, n, off.data(), causal, x.ptr(), out.ptr());
        if (!check_status(E, st, {&out})) return;
        if (!ok || s.kd != s.E || s.vdim != s.E) fail(E, "forward_varlen accepted broken offsets or a cross-attention layer");
        if (total == 0) return;
        if (x.null || out.null) fail(E, "forward_varlen accepted NULL x or out");
        for (int64_t q = 0; q < n; ++q) {
            const int64_t r0 = off[static_cast<size_t>(q)], len = off[static_cast<size_t>(q + 1)] - r0;
            if (!len) continue;
            std::vector<double> tol;
            const float *xs = x.v.data() + r0 * s.E;
            const auto want = layer_ref(s, lw, xs, len, xs, xs, len, true, causal, nullptr, nullptr, 0, nullptr, tol);
            compare_rows(E, "varlen out", out.data() + r0 * s.E, want, s.E, tol, s);
        }
        return;
    }
    const int64_t B = p.batch, Lq = p.q_len, Lk = f.lk;
    const uint8_t nulls = in.byte();
    In query(count({B, Lq, s.E}), rng, nulls % 32 == 1);
    In key(self ? 0 : count({B, Lk, s.kd}), rng, false), value(self ? 0 : count({B, Lk, s.vdim}), rng, false);
    Out out(count({B, Lq, s.E}), nulls % 32 == 2);
    Out w(mode & 4 ? count({B, s.H, Lq, Lk}) : 0, false);
    if (mode & 4) p.weights = w.ptr();
    const bool self_as_query = self && mode & 8;  // key = value = query instead of NULL
    const float *kp = self ? (self_as_query ? query.ptr() : nullptr) : (nulls % 32 == 3 ? nullptr : key.ptr());
    const float *vp = self ? (self_as_query ? query.ptr() : nullptr) : (nulls % 32 == 4 ? nullptr : value.ptr());
    out.save();
    w.save();
    decode_modifiers(in, rng, s);
    mha_layer *layer = guard.l = create_layer(rt, s, lw, create_nulls, E);
    if (!layer) return;
    const mha_status st = mha_layer_forward(nulls % 32 == 5 ? nullptr : rt, layer, nulls % 32 == 6 ? nullptr : &p, query.ptr(), kp, vp,
                                            out.ptr());
    if (!check_status(E, st, {&out, &w})) return;
    if (nulls % 32 == 5 || nulls % 32 == 6) fail(E, "forward accepted NULL rt or params");
    if (B == 0 || Lq == 0) {
        if (!out.untouched() || !w.untouched()) fail(E, "canary: forward wrote outputs for an empty call");
        return;
    }
    if (B < 0 || Lq < 0 || Lk < 0 || query.need == kImpossible || out.need == kImpossible || w.need == kImpossible || !f.mask_ok ||
        query.null || out.null)
        fail(E, "forward accepted a bad size, NULL query or out, or a mask too small for its strides");
    if (self && p.kv_len != 0 && p.kv_len != p.q_len) fail(E, "forward accepted a self-attention kv_len other than q_len");
    if (!self && (!kp || !vp) && Lk > 0) fail(E, "forward accepted NULL key or value");
    if (self && (s.kd != s.E || s.vdim != s.E)) fail(E, "self-attention through a layer with kdim/vdim != E");
    for (int64_t b = 0; b < B; ++b) {
        if (p.kv_valid_lens && (p.kv_valid_lens[b] < 0 || p.kv_valid_lens[b] > Lk)) fail(E, "forward accepted a bad valid length");
        std::vector<double> tol, wts;
        const float *xq = query.v.data() + b * Lq * s.E;
        const auto want = layer_ref(s, lw, xq, Lq, self ? xq : key.v.data() + b * Lk * s.kd,
                                    self ? xq : value.v.data() + b * Lk * s.vdim, Lk, self, p.causal != 0,
                                    p.kv_valid_lens ? p.kv_valid_lens + b : nullptr,
                                    p.mask ? p.mask + b * p.mask_batch_stride : nullptr, p.mask_row_stride,
                                    p.weights ? &wts : nullptr, tol);
        compare_rows(E, "out", out.data() + b * Lq * s.E, want, s.E, tol, s);
        // (a cap, a bias or a rotation adds its own fp32 rounding to each score)
        if (p.weights && s.mods_conditioned)
            for (size_t i = 0; i < wts.size(); ++i)
                expect_close(E, "weights", w.data()[b * s.H * Lq * Lk + static_cast<int64_t>(i)], wts[i], s.mods_any ? 2e-5 : 1e-5);
    }
}

void fuzz_layer_cached(Input &in) {
    const char *E = "mha_layer_forward_cached";
    mha_runtime *rt = pick_runtime(in);
    if (!rt) return;
    LayerShape s = decode_layer(in, true);
    Rng rng{in.seed()};
    if (count({s.E, s.H, add(s.hd, s.vd)}) > (int64_t{1} << 12)) throw Skip{};
    LayerWeights lw;
    const uint8_t create_nulls = decode_create(in, s, lw, rng);
    mha_kv_cache_config cfg{s.Hkv, s.hd, s.vd, 0, 64 + in.small(100), MHA_F32, 0};
    const uint8_t mismatch = in.byte();
    // (computed before create now, so also for a hostile head count that create refuses)
    if (mismatch % 16 == 1 && cfg.head_dim < INT64_MAX) cfg.head_dim += 1;
    if (mismatch % 16 == 2 && cfg.num_kv_heads < INT64_MAX) cfg.num_kv_heads += 1;
    // Up to 5 calls, each decoded in full before any runs (so that the modifiers, read after them,
    // can go into the layer's config).
    struct Step {
        std::vector<int64_t> ids, off;
        bool ok = false;
        int64_t total = 0;
        int causal = 0;
        uint8_t nulls = 0;
        In x;
        Out out;
    };
    std::vector<Step> steps;
    for (int step = 0; step < 5 && in.left() > 0; ++step) {
        Step &d = steps.emplace_back();
        const int64_t num_seqs = in.small(3);
        d.ids.resize(static_cast<size_t>(num_seqs));
        for (auto &id : d.ids) id = in.small(3);
        d.off.assign(d.ids.size() + 1, 0);
        for (size_t i = 0; i < d.ids.size(); ++i) d.off[i + 1] = d.off[i] + in.small(5);
        if (in.flag(16)) d.off[in.byte() % d.off.size()] = in.dim();
        d.ok = d.off[0] == 0;
        for (size_t i = 0; i < d.ids.size(); ++i) d.ok = d.ok && d.off[i + 1] >= d.off[i];
        d.total = d.ok ? d.off.back() : 0;
        d.causal = in.byte() & 1;
        d.nulls = in.byte();
        d.x = In(count({d.total, s.E}), rng, d.nulls % 32 == 1);
        d.out = Out(count({d.total, s.E}), d.nulls % 32 == 2);
    }
    decode_modifiers(in, rng, s);
    mha_layer *layer = create_layer(rt, s, lw, create_nulls, E);
    if (!layer) return;
    LayerGuard guard{layer};
    mha_kv_cache *cache = nullptr;
    if (mha_kv_cache_create(rt, &cfg, &cache) != MHA_OK) return;
    struct Guard {
        mha_kv_cache *c;
        ~Guard() { mha_kv_cache_destroy(c); }
    } cg{cache};
    std::map<int64_t, std::vector<float>> history;  // each sequence's x rows so far
    for (Step &d : steps) {
        mha_layer_cached_params p{};
        p.num_seqs = static_cast<int64_t>(d.ids.size());
        const std::vector<int64_t> &ids = d.ids, &off = d.off;
        const bool ok = d.ok;
        const int64_t total = d.total;
        p.seq_ids = ids.data();
        p.q_offsets = off.data();
        p.causal = d.causal;
        const uint8_t nulls = d.nulls;
        In &x = d.x;
        Out &out = d.out;
        out.save();
        int64_t free_before = 0;
        mha_kv_cache_free_tokens(cache, &free_before);
        const mha_status st = mha_layer_forward_cached(rt, layer, nulls % 32 == 3 ? nullptr : cache, &p, x.ptr(), out.ptr());
        if (!check_status(E, st, {&out}, true)) {
            int64_t free_after = 0;
            mha_kv_cache_free_tokens(cache, &free_after);
            if (free_after != free_before) fail(E, "a failed forward_cached changed the cache");
            continue;
        }
        std::set<int64_t> distinct(ids.begin(), ids.end());
        if (!ok || distinct.size() != ids.size() || nulls % 32 == 3 || mismatch % 16 == 1 || mismatch % 16 == 2)
            fail(E, "forward_cached accepted broken offsets, repeated ids, a NULL or mismatched cache");
        if (total > 0 && (x.null || out.null)) fail(E, "forward_cached accepted NULL x or out");
        for (size_t i = 0; i < ids.size(); ++i) {
            const int64_t n = off[i + 1] - off[i];
            auto &h = history[ids[i]];
            h.insert(h.end(), x.v.begin() + off[i] * s.E, x.v.begin() + off[i + 1] * s.E);
            if (!n) continue;
            const int64_t len = static_cast<int64_t>(h.size()) / s.E;
            // Reference: the new rows attend over every cached row (K/V of the normalized rows for
            // pre-norm), as a self-attention with the new rows as queries.
            const auto all = to_double(h.data(), len * s.E);
            const auto X = to_double(x.v.data() + off[i] * s.E, n * s.E);
            const int norm = s.c.norm;
            const auto kin = norm == MHA_NORM_PRE ? norm_rows(all, len, s.E, lw.nw, lw.nb, s.eps, nullptr) : all;
            const auto qin = norm == MHA_NORM_PRE ? norm_rows(X, n, s.E, lw.nw, lw.nb, s.eps, nullptr) : X;
            auto fx = attend(s, lw, qin, n, kin, kin, len, p.causal != 0, nullptr, nullptr, 0, nullptr);
            std::vector<double> tol(static_cast<size_t>(n), 2e-4);
            if (norm != MHA_NORM_NONE)
                for (size_t j = 0; j < fx.size(); ++j) fx[j] += X[j];
            if (norm == MHA_NORM_POST) fx = norm_rows(fx, n, s.E, lw.nw, lw.nb, s.eps, &tol);
            compare_rows(E, "cached out", out.data() + off[i] * s.E, fx, s.E, tol, s);
        }
    }
}

void fuzz_encoder(Input &in) {
    const char *E = "mha_encoder_layer";
    mha_runtime *rt = pick_runtime(in);
    LayerShape s = decode_layer(in, true);
    mha_encoder_config cfg{};
    cfg.attention = s.c;
    cfg.ffn_dim = in.dim();
    const uint8_t a = in.byte();
    cfg.activation = a < 240 ? a % 2 : (a % 2 ? 2 : -1);
    Rng rng{in.seed()};
    Forward f = decode_forward(in, rng, true);
    auto &p = f.p;
    if (count({p.batch, p.q_len, f.lk, s.H, add(s.hd, s.vd)}) > (int64_t{1} << 16) ||
        count({p.batch, p.q_len, s.E, add(cfg.ffn_dim, mul(s.H, add(s.hd, s.vd)))}) > (int64_t{1} << 17))
        throw Skip{};
    LayerWeights lw;
    make_weights(s, in, rng, lw);
    const uint8_t nulls = in.byte();
    In w1(count({cfg.ffn_dim, s.E}), rng, nulls % 32 == 1), b1(cfg.ffn_dim, rng, nulls & 32), w2(count({s.E, cfg.ffn_dim}), rng, nulls % 32 == 2),
        b2(s.E, rng, nulls & 64), n2w(s.E, rng, nulls & 128), n2b(s.E, rng, nulls % 3 == 0);
    for (In *t : {&w1, &w2})
        for (auto &x : t->v) x *= 0.25f;
    mha_encoder_weights ew{lw.w, w1.ptr(), b1.ptr(), w2.ptr(), b2.ptr(), n2w.ptr(), n2b.ptr()};
    struct Guard {
        mha_encoder_layer *l = nullptr;
        ~Guard() { mha_encoder_layer_destroy(l); }
    } guard;
    // Called once every argument is decoded: the modifiers, then create (NULL if it failed as it should).
    auto create = [&]() -> mha_encoder_layer * {
        decode_modifiers(in, rng, s);
        cfg.attention = s.c;
        mha_encoder_layer *layer = reinterpret_cast<mha_encoder_layer *>(8);
        const mha_status cst = mha_encoder_layer_create(rt, &cfg, nulls % 32 == 3 ? nullptr : &ew, &layer);
        if (cst != MHA_OK) {
            if (cst == MHA_INTERNAL || !mha_last_error()[0]) fail(E, "create failed without a proper status and message");
            if (layer) fail(E, "a failed create left *out set");
            return nullptr;
        }
        guard.l = layer;
        if (!rt || nulls % 32 == 3 || !s.plausible || !weights_complete(lw) || s.c.norm == MHA_NORM_NONE || cfg.ffn_dim <= 0 ||
            cfg.activation < 0 || cfg.activation > 1 || w1.null || w2.null || w1.need == kImpossible || w2.need == kImpossible)
            fail(E, "create accepted a bad config or missing weights");
        if (!s.mods_valid) fail(E, "create accepted a bad variant or rope");
        return layer;
    };
    const int64_t F = cfg.ffn_dim;
    auto reference = [&](const float *x, int64_t lq, const int32_t *valid, const uint8_t *mask, int64_t mrs, bool causal,
                         std::vector<double> &tol) {
        const auto X = to_double(x, lq * s.E);
        auto ffn = [&](const std::vector<double> &y) {
            auto h = mha::ref::linear(y.data(), lq, s.E, w1.v.data(), opt(b1), F);
            for (auto &v : h) v = cfg.activation == MHA_ACT_GELU ? mha::ref::gelu(v) : mha::ref::relu(v);
            return mha::ref::linear(h.data(), lq, F, w2.v.data(), opt(b2), s.E);
        };
        std::vector<double> t1;
        tol.assign(static_cast<size_t>(lq), 3e-4);
        if (s.c.norm == MHA_NORM_POST) {
            auto y = attend(s, lw, X, lq, X, X, lq, causal, valid, mask, mrs, nullptr);
            for (size_t i = 0; i < y.size(); ++i) y[i] += X[i];
            y = norm_rows(y, lq, s.E, lw.nw, lw.nb, s.eps, &t1);
            auto z = ffn(y);
            for (size_t i = 0; i < z.size(); ++i) z[i] += y[i];
            std::vector<double> t2;
            z = norm_rows(z, lq, s.E, n2w, n2b, s.eps, &t2);
            for (size_t r = 0; r < tol.size(); ++r) tol[r] = 3 * t2[r] * (t1[r] / 1e-4);  // amplified twice
            return z;
        }
        const auto xn = norm_rows(X, lq, s.E, lw.nw, lw.nb, s.eps, &t1);
        auto y = attend(s, lw, xn, lq, xn, xn, lq, causal, valid, mask, mrs, nullptr);
        for (size_t i = 0; i < y.size(); ++i) y[i] += X[i];
        std::vector<double> t2;
        const auto yn = norm_rows(y, lq, s.E, n2w, n2b, s.eps, &t2);
        auto z = ffn(yn);
        for (size_t i = 0; i < z.size(); ++i) z[i] += y[i];
        for (size_t r = 0; r < tol.size(); ++r) tol[r] = 3 * (t1[r] + t2[r]);
        return z;
    };
    const uint8_t mode = in.byte();
    if (mode % 4 == 3) {  // forward_varlen
        const int64_t n = in.small(4);
        std::vector<int64_t> off(static_cast<size_t>(n + 1), 0);
        for (int64_t i = 0; i < n; ++i) off[static_cast<size_t>(i + 1)] = off[static_cast<size_t>(i)] + in.small(6);
        if (in.flag(8)) off[in.byte() % off.size()] = in.dim();
        bool ok = off[0] == 0;
        for (int64_t i = 0; i < n; ++i) ok = ok && off[static_cast<size_t>(i + 1)] >= off[static_cast<size_t>(i)];
        const int64_t total = ok ? off.back() : 0;
        const bool in_place = mode & 4, causal = mode & 8;
        In x(count({total, s.E}), rng, false);
        Out out(count({total, s.E}), false);
        if (in_place) out.fill(rng);
        const std::vector<float> x0 = in_place ? std::vector<float>(out.data(), out.data() + out.len()) : x.v;
        out.save();
        mha_encoder_layer *layer = create();
        if (!layer) return;
        const mha_status st = mha_encoder_layer_forward_varlen(rt, layer, n, off.data(), causal, in_place ? out.ptr() : x.ptr(), out.ptr());
        if (!check_status(E, st, {&out})) return;
        if (!ok) fail(E, "forward_varlen accepted broken offsets");
        for (int64_t q = 0; q < n; ++q) {
            const int64_t r0 = off[static_cast<size_t>(q)], len = off[static_cast<size_t>(q + 1)] - r0;
            if (!len) continue;
            std::vector<double> tol;
            const auto want = reference(x0.data() + r0 * s.E, len, nullptr, nullptr, 0, causal, tol);
            compare_rows(E, "varlen out", out.data() + r0 * s.E, want, s.E, tol, s);
        }
        return;
    }
    const int64_t B = p.batch, Lq = p.q_len;
    const bool in_place = mode & 4;
    In x(in_place ? 0 : count({B, Lq, s.E}), rng, mode % 64 == 16);
    Out out(count({B, Lq, s.E}), mode % 64 == 32);
    if (in_place) out.fill(rng);
    const std::vector<float> x0 = in_place ? std::vector<float>(out.data(), out.data() + out.len()) : x.v;
    std::vector<float> wbuf(4);
    if (mode & 128) p.weights = wbuf.data();  // must be refused
    out.save();
    mha_encoder_layer *layer = create();
    if (!layer) return;
    const mha_status st = mha_encoder_layer_forward(rt, layer, &p, in_place ? out.ptr() : x.ptr(), out.ptr());
    if (!check_status(E, st, {&out})) return;
    if (p.weights) fail(E, "forward accepted weights");
    if (B == 0 || Lq == 0) {
        if (!out.untouched()) fail(E, "canary: forward wrote out for an empty call");
        return;
    }
    if (B < 0 || Lq < 0 || out.need == kImpossible || out.null || (!in_place && (x.null || x.need == kImpossible)) || !f.mask_ok)
        fail(E, "forward accepted a bad size, a NULL x or out, or a mask too small for its strides");
    if (p.kv_len != 0 && p.kv_len != p.q_len) fail(E, "forward accepted kv_len != q_len");
    for (int64_t b = 0; b < B; ++b) {
        if (p.kv_valid_lens && (p.kv_valid_lens[b] < 0 || p.kv_valid_lens[b] > Lq)) fail(E, "forward accepted a bad valid length");
        std::vector<double> tol;
        const auto want = reference(x0.data() + b * Lq * s.E, Lq, p.kv_valid_lens ? p.kv_valid_lens + b : nullptr,
                                    p.mask ? p.mask + b * p.mask_batch_stride : nullptr, p.mask_row_stride, p.causal != 0, tol);
        compare_rows(E, "out", out.data() + b * Lq * s.E, want, s.E, tol, s);
    }
}

} // namespace fuzz
