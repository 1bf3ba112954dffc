// The C ABI fuzzer: mha_sgemm, mha_softmax, mha_attention, mha_attention_varlen, the KV cache and
// the small entry points, each decoded from the input and checked against a double reference.
#include <map>
#include <set>

#include "c_abi_fuzz.hpp"
#include "reference.hpp"

namespace fuzz {
namespace {

char trans_char(Input &in) {
    static constexpr char t[] = {'N', 'T', 'N', 'T', 'N', 'T', 'n', 'X'};
    return t[in.byte() % 8];
}

} // namespace

void fuzz_sgemm(Input &in) {
    const char *E = "mha_sgemm";
    mha_runtime *rt = pick_runtime(in);
    const char ta = trans_char(in), tb = trans_char(in);
    const int64_t m = in.dim(), n = in.dim(), k = in.dim();
    const float alpha = in.scalar(), beta = in.scalar();
    // Stored shapes of A (m x k, or k x m for 'T') and B.
    const int64_t ar = ta == 'T' ? k : m, ac = ta == 'T' ? m : k;
    const int64_t br = tb == 'T' ? n : k, bc = tb == 'T' ? k : n;
    const int64_t lda = in.ld(ac > 1 ? ac : 1), ldb = in.ld(bc > 1 ? bc : 1), ldc = in.ld(n > 1 ? n : 1);
    const uint8_t nulls = in.byte();
    Rng rng{in.seed()};
    In a(extent(ar, ac, lda), rng, nulls % 16 == 1), b(extent(br, bc, ldb), rng, nulls % 16 == 2);
    Out c(extent(m, n, ldc), nulls % 16 == 3);
    if (beta != 0.0f) c.fill(rng);  // read by the call; with beta == 0, C holds NaNs it must not read
    c.save();
    const bool ok_args = (ta == 'N' || ta == 'T') && (tb == 'N' || tb == 'T') && std::isfinite(alpha) && std::isfinite(beta);
    const mha_status st = mha_sgemm(rt, ta, tb, m, n, k, alpha, a.ptr(), lda, b.ptr(), ldb, beta, c.ptr(), ldc);
    if (!check_status(E, st, {&c})) return;
    if (!rt || (ta != 'N' && ta != 'T') || (tb != 'N' && tb != 'T')) fail(E, "accepted a NULL runtime or a bad trans");
    if (m == 0 || n == 0) {
        if (!c.untouched()) fail(E, "canary: wrote C for an empty product");
        return;
    }
    if (c.need == kImpossible || c.null) fail(E, "succeeded with an impossible or NULL C");
    if (!ok_args) return;  // non-finite alpha/beta: no reference, canaries checked above
    const bool reads = alpha != 0.0f && k > 0;
    if (reads && (a.need == kImpossible || b.need == kImpossible || a.null || b.null))
        fail(E, "succeeded with an impossible or NULL A or B");
    for (int64_t i = 0; i < m; ++i) {
        for (int64_t j = 0; j < n; ++j) {
            double s = 0, mag = 0;
            if (reads)
                for (int64_t p = 0; p < k; ++p) {
                    const double x = ta == 'N' ? a.v[static_cast<size_t>(i * lda + p)] : a.v[static_cast<size_t>(p * lda + i)];
                    const double y = tb == 'N' ? b.v[static_cast<size_t>(p * ldb + j)] : b.v[static_cast<size_t>(j * ldb + p)];
                    s += x * y;
                    mag += std::fabs(x * y);
                }
            double want = reads ? alpha * s : 0.0;
            mag *= std::fabs(alpha);
            if (beta != 0.0f) {
                const double c0 = c.saved[static_cast<size_t>(Out::kCanary + i * ldc + j)];
                want += beta * c0;
                mag += std::fabs(beta * c0);
            }
            expect_close(E, "C", c.data()[i * ldc + j], want, 1e-6, mag);
        }
        // Between rows: the elements past n are never written.
        if (i + 1 < m)
            for (int64_t j = n; j < ldc; ++j)
                if (std::memcmp(&c.data()[i * ldc + j], &c.saved[static_cast<size_t>(Out::kCanary + i * ldc + j)], 4))
                    fail(E, "canary: wrote C outside the m x n window");
    }
}

void fuzz_softmax(Input &in) {
    const char *E = "mha_softmax";
    mha_runtime *rt = pick_runtime(in);
    const int64_t rows = in.dim(), cols = in.dim();
    const int64_t ldx = in.ld(cols > 1 ? cols : 1);
    const uint8_t mode = in.byte();
    const bool in_place = mode % 4 == 0;
    const int64_t ldy = in_place ? ldx : in.ld(cols > 1 ? cols : 1);
    const uint8_t infs = in.byte();
    Rng rng{in.seed()};
    In x(in_place ? 0 : extent(rows, cols, ldx), rng, mode % 16 == 1);
    Out y(extent(rows, cols, ldy), mode % 16 == 2);
    std::vector<float> x0;  // the input as given
    if (in_place) {
        y.fill(rng);
        x0.assign(y.data(), y.data() + y.len());
    } else {
        x0 = x.v;
    }
    // Some -inf logits (a whole row of them now and then).
    if (infs % 4 == 0) {
        float *xs = in_place ? y.data() : x.v.data();
        const int64_t len = in_place ? y.len() : static_cast<int64_t>(x.v.size());
        for (int64_t i = 0; i < len; ++i)
            if (rng.next() % 3 == 0 || (infs % 16 == 0 && i < cols)) xs[i] = -INFINITY;
        x0.assign(xs, xs + len);
    }
    y.save();
    const float *xp = in_place ? (y.null ? nullptr : y.data()) : x.ptr();
    const mha_status st = mha_softmax(rt, rows, cols, xp, ldx, y.ptr(), ldy);
    if (!check_status(E, st, {&y})) return;
    if (!rt) fail(E, "accepted a NULL runtime");
    if (rows == 0 || cols == 0) {
        if (!y.untouched()) fail(E, "canary: wrote y for an empty call");
        return;
    }
    if (y.need == kImpossible || y.null || (!in_place && (x.need == kImpossible || x.null)))
        fail(E, "succeeded with an impossible or NULL x or y");
    for (int64_t r = 0; r < rows; ++r) {
        const auto want = mha::ref::softmax_row(x0.data() + r * ldx, cols);
        for (int64_t j = 0; j < cols; ++j) expect_close(E, "y", y.data()[r * ldy + j], want[static_cast<size_t>(j)], 1e-6);
        if (r + 1 < rows)
            for (int64_t j = cols; j < ldy; ++j)
                if (std::memcmp(&y.data()[r * ldy + j], &y.saved[static_cast<size_t>(Out::kCanary + r * ldy + j)], 4))
                    fail(E, "canary: wrote y past cols");
    }
}

namespace {

// Heads: num_kv_heads, and num_heads mostly a multiple of it (MHA, GQA, MQA), sometimes not.
void heads(Input &in, int64_t &h, int64_t &hkv) {
    hkv = in.dim();
    const uint8_t b = in.byte();
    h = b < 200 ? mul(hkv, 1 + b % 4) : in.dim();
    if (h == kImpossible) h = hkv;
}

// valid_lens for batch b of kv_len: mostly within [0, kv_len], sometimes out of it.
std::vector<int32_t> valid_lens(Input &in, Rng &rng, int64_t batch, int64_t kv_len) {
    if (batch > 4096) throw Skip{};  // (an array of [batch] is what the call reads, even for q_len 0)
    std::vector<int32_t> v(static_cast<size_t>(batch > 0 ? batch : 1));
    const uint8_t bad = in.byte();
    for (auto &x : v) x = static_cast<int32_t>(kv_len >= 0 && kv_len < 1000 ? rng.next() % static_cast<uint64_t>(kv_len + 1) : 0);
    if (bad % 8 == 0) v[rng.next() % v.size()] = bad % 16 == 0 ? -1 : static_cast<int32_t>(kv_len < INT32_MAX ? kv_len + 1 : INT32_MIN);
    return v;
}

} // namespace

void fuzz_attention(Input &in) {
    const char *E = "mha_attention";
    mha_runtime *rt = pick_runtime(in);
    mha_attention_params p{};
    p.batch = in.dim();
    p.q_len = in.dim();
    p.kv_len = in.dim();
    heads(in, p.num_heads, p.num_kv_heads);
    p.head_dim = in.dim();
    p.value_dim = in.byte() % 2 ? p.head_dim : in.dim();
    p.scale = in.byte() % 4 ? 0.0f : in.scalar();
    const uint8_t opts = in.byte();
    p.causal = opts & 1;
    const bool use_valid = opts & 2, use_mask = opts & 4, need_weights = opts & 8;
    const int64_t mrs_min = p.kv_len;
    const uint8_t ms = in.byte();
    p.mask_row_stride = ms % 4 == 0 ? 0 : in.ld(mrs_min);
    p.mask_batch_stride = ms % 3 == 0 ? 0 : (ms % 3 == 1 ? mul(p.q_len, p.mask_row_stride) : in.ld(mrs_min));
    if (p.mask_batch_stride == kImpossible) p.mask_batch_stride = in.ld(0);
    const uint8_t nulls = in.byte();
    Rng rng{in.seed()};
    std::vector<float> slopes, sinks;
    const bool modified = decode_variant(in, rng, p.num_heads, p.variant, slopes, sinks);
    // The cost of the reference: skip what would take too long.
    if (count({p.batch, p.num_heads, p.q_len, p.kv_len, add(p.head_dim, p.value_dim)}) > (int64_t{1} << 16)) throw Skip{};
    In q(count({p.batch, p.q_len, p.num_heads, p.head_dim}), rng, nulls % 16 == 1);
    In k(count({p.batch, p.kv_len, p.num_kv_heads, p.head_dim}), rng, nulls % 16 == 2);
    In v(count({p.batch, p.kv_len, p.num_kv_heads, p.value_dim}), rng, nulls % 16 == 3);
    Out out(count({p.batch, p.q_len, p.num_heads, p.value_dim}), nulls % 16 == 4);
    Out w(need_weights ? count({p.batch, p.num_heads, p.q_len, p.kv_len}) : 0, false);
    std::vector<int32_t> vl;
    if (use_valid) {
        vl = valid_lens(in, rng, p.batch, p.kv_len);
        p.kv_valid_lens = vl.data();
    }
    // The mask: exactly as many bytes as the strides address, (batch-1)*bs + (q_len-1)*rs + kv_len.
    std::vector<uint8_t> mask;
    int64_t mask_need = 0;
    if (use_mask) {
        if (p.batch > 0 && p.q_len > 0 && p.kv_len > 0) {
            const int64_t a = mul(p.batch - 1, p.mask_batch_stride), b = mul(p.q_len - 1, p.mask_row_stride);
            mask_need = a == kImpossible || b == kImpossible || p.mask_batch_stride < 0 || p.mask_row_stride < 0
                            ? kImpossible
                            : (a > INT64_MAX / 8 || b > INT64_MAX / 8 || p.kv_len > INT64_MAX / 8 ? kImpossible : a + b + p.kv_len);
        }
        skip_if_too_big(mask_need);
        mask.resize(static_cast<size_t>(mask_need == kImpossible ? 4 : mask_need));
        const uint64_t density = rng.next() % 4;
        for (auto &x : mask) x = static_cast<uint8_t>(rng.next() % 4 >= density ? 1 + rng.next() % 255 : 0);
        static uint8_t empty_mask = 1;
        p.mask = mask.empty() ? &empty_mask : mask.data();
    }
    if (need_weights) p.weights = w.ptr();
    out.save();
    w.save();
    const mha_status st = mha_attention(rt, nulls % 32 == 5 ? nullptr : &p, q.ptr(), k.ptr(), v.ptr(), out.ptr());
    if (!check_status(E, st, {&out, &w})) return;
    if (!rt || nulls % 32 == 5) fail(E, "accepted a NULL runtime or params");
    if (p.batch == 0 || p.q_len == 0) {
        if (!out.untouched() || !w.untouched()) fail(E, "canary: wrote an output for an empty call");
        return;
    }
    for (const In *t : {&q, &k, &v})
        if (t->need == kImpossible) fail(E, "succeeded with an impossible q, k or v");
    if (out.need == kImpossible || w.need == kImpossible || mask_need == kImpossible || out.null)
        fail(E, "succeeded with an impossible out, weights or mask, or a NULL out");
    if (p.num_heads <= 0 || p.num_kv_heads <= 0 || p.num_heads % p.num_kv_heads || p.head_dim <= 0 || p.value_dim <= 0 ||
        !std::isfinite(p.scale))
        fail(E, "accepted bad heads, dims or scale");
    if (!variant_valid(p.variant, p.num_heads)) fail(E, "accepted a bad variant (window, softcap, slopes or sinks)");
    if (use_valid)
        for (int64_t b = 0; b < p.batch; ++b)
            if (vl[static_cast<size_t>(b)] < 0 || vl[static_cast<size_t>(b)] > p.kv_len) fail(E, "accepted a bad valid length");
    mha::ref::AttentionCase c{p.batch, p.q_len, p.kv_len, p.num_heads, p.num_kv_heads, p.head_dim, p.value_dim,
                              p.scale != 0.0f ? p.scale : 1.0 / std::sqrt(static_cast<double>(p.head_dim)),
                              p.causal != 0, p.kv_valid_lens, p.mask, p.mask_batch_stride, p.mask_row_stride};
    c.window = p.variant.window;
    c.softcap = p.variant.softcap;
    c.alibi = p.variant.alibi_slopes;
    c.sinks = p.variant.sink_logits;
    std::vector<double> want, want_w;
    mha::ref::attention(c, q.v.data(), k.v.data(), v.v.data(), want, need_weights ? &want_w : nullptr);
    if (!well_conditioned(c.scale) || !variant_conditioned(p.variant, p.num_heads))
        return expect_convex(E, out.data(), want.size(), v.v);
    for (size_t i = 0; i < want.size(); ++i) expect_close(E, "out", out.data()[i], want[i], 1e-4);
    // A cap or a bias adds its own fp32 rounding to each score (a few ulp of scores up to ~100).
    if (need_weights)
        for (size_t i = 0; i < want_w.size(); ++i) expect_close(E, "weights", w.data()[i], want_w[i], modified ? 2e-5 : 1e-6);
}

namespace {

// Row offsets for n sequences: lengths 0..9 mostly; sometimes broken (not starting at 0,
// decreasing, hostile). n is clamped to what the array can hold here.
std::vector<int64_t> offsets(Input &in, int64_t n) {
    std::vector<int64_t> o(static_cast<size_t>(n >= 0 && n <= 16 ? n + 1 : 2), 0);
    for (size_t s = 1; s < o.size(); ++s) o[s] = o[s - 1] + in.small(9);
    const uint8_t b = in.byte();
    if (b % 8 == 0) o[in.byte() % o.size()] = in.dim();  // anything, hostile included
    return o;
}

bool offsets_valid(const std::vector<int64_t> &o, int64_t n) {
    if (n < 0 || static_cast<size_t>(n) + 1 > o.size() || o[0] != 0) return false;
    for (int64_t s = 0; s < n; ++s)
        if (o[static_cast<size_t>(s) + 1] < o[static_cast<size_t>(s)]) return false;
    return true;
}

// The number of sequences: 0..4 mostly, or negative, or so large that its arrays ([num_seqs + 1]
// int64 each) would overflow the address space: the call must refuse it before reading them.
int64_t num_seqs(Input &in) {
    static constexpr int64_t bad[] = {-1, INT64_MIN, INT64_MAX, INT64_MAX / 2, int64_t{1} << 62, INT64_MAX / 8 + 1, -7, INT64_MAX - 1};
    const uint8_t b = in.byte();
    return b < 240 ? b % 5 : bad[b % 8];
}

int64_t add_sat(int64_t a, int64_t b) {
    int64_t r;
    return __builtin_add_overflow(a, b, &r) ? INT64_MAX : r;
}

} // namespace

void fuzz_varlen(Input &in) {
    const char *E = "mha_attention_varlen";
    mha_runtime *rt = pick_runtime(in);
    mha_varlen_params p{};
    p.num_seqs = num_seqs(in);
    std::vector<int64_t> qo = offsets(in, p.num_seqs), ko = offsets(in, p.num_seqs);
    if (in.flag(4)) ko = qo;  // self-attention shapes
    heads(in, p.num_heads, p.num_kv_heads);
    p.head_dim = in.dim();
    p.value_dim = in.byte() % 2 ? p.head_dim : in.dim();
    p.scale = in.byte() % 4 ? 0.0f : in.scalar();
    p.causal = in.byte() & 1;
    const uint8_t nulls = in.byte();
    Rng rng{in.seed()};
    // The score modifiers, after every other field (older inputs decode as before); outputs are
    // compared at 1e-4 with or without them.
    std::vector<float> slopes, sinks;
    decode_variant(in, rng, p.num_heads, p.variant, slopes, sinks);
    const bool valid = offsets_valid(qo, p.num_seqs) && offsets_valid(ko, p.num_seqs);
    const int64_t tq = valid ? qo[static_cast<size_t>(p.num_seqs)] : 0, tk = valid ? ko[static_cast<size_t>(p.num_seqs)] : 0;
    p.q_offsets = nulls % 16 == 6 ? nullptr : qo.data();
    p.kv_offsets = nulls % 16 == 7 ? nullptr : ko.data();
    if (count({tq, p.num_heads, tk, add(p.head_dim, p.value_dim)}) > (int64_t{1} << 16)) throw Skip{};
    In q(count({tq, p.num_heads, p.head_dim}), rng, nulls % 16 == 1);
    In k(count({tk, p.num_kv_heads, p.head_dim}), rng, nulls % 16 == 2);
    In v(count({tk, p.num_kv_heads, p.value_dim}), rng, nulls % 16 == 3);
    Out out(count({tq, p.num_heads, p.value_dim}), nulls % 16 == 4);
    out.save();
    const mha_status st = mha_attention_varlen(rt, nulls % 32 == 5 ? nullptr : &p, q.ptr(), k.ptr(), v.ptr(), out.ptr());
    if (!check_status(E, st, {&out})) return;
    if (!rt || nulls % 32 == 5) fail(E, "accepted a NULL runtime or params");
    // (a call past the NULL checks validates the variant, with or without queries or sequences)
    if (p.num_heads > 0 && !variant_valid(p.variant, p.num_heads)) fail(E, "accepted a bad variant (window, softcap, slopes or sinks)");
    if (!valid) {
        if (p.num_seqs == 0) return;  // the offsets are not read
        fail(E, "accepted broken offsets");
    }
    if (p.num_seqs > 0 && (!p.q_offsets || !p.kv_offsets)) fail(E, "accepted NULL offsets");
    if (tq == 0) {
        if (!out.untouched()) fail(E, "canary: wrote out with no queries");
        return;
    }
    if (q.need == kImpossible || k.need == kImpossible || v.need == kImpossible || out.need == kImpossible || out.null)
        fail(E, "succeeded with an impossible tensor or a NULL out");
    if (p.num_heads <= 0 || p.num_kv_heads <= 0 || p.num_heads % p.num_kv_heads || p.head_dim <= 0 || p.value_dim <= 0)
        fail(E, "accepted bad heads or dims");
    const double scale = p.scale != 0.0f ? p.scale : 1.0 / std::sqrt(static_cast<double>(p.head_dim));
    for (int64_t s = 0; s < p.num_seqs; ++s) {
        const int64_t q0 = qo[static_cast<size_t>(s)], nq = qo[static_cast<size_t>(s) + 1] - q0;
        const int64_t k0 = ko[static_cast<size_t>(s)], nk = ko[static_cast<size_t>(s) + 1] - k0;
        if (nq == 0) continue;
        mha::ref::AttentionCase c{1, nq, nk, p.num_heads, p.num_kv_heads, p.head_dim, p.value_dim, scale, p.causal != 0};
        // Positions per sequence (mha.h): key j at j, query i at i + nk - nq, as the reference has them.
        c.window = p.variant.window;
        c.softcap = p.variant.softcap;
        c.alibi = p.variant.alibi_slopes;
        c.sinks = p.variant.sink_logits;
        std::vector<double> want;
        mha::ref::attention(c, q.v.data() + q0 * p.num_heads * p.head_dim,
                            k.v.data() + (nk ? k0 * p.num_kv_heads * p.head_dim : 0),
                            v.v.data() + (nk ? k0 * p.num_kv_heads * p.value_dim : 0), want);
        const float *o = out.data() + q0 * p.num_heads * p.value_dim;
        if (!well_conditioned(scale) || !variant_conditioned(p.variant, p.num_heads)) {
            expect_convex(E, o, want.size(), v.v);
            continue;
        }
        for (size_t i = 0; i < want.size(); ++i) expect_close(E, "out", o[i], want[i], 1e-4);
    }
}

// ---- The KV cache: a fresh cache per input, then a run of operations on a few sequence ids,
// mirrored by a model of what each sequence holds. ----

namespace {

struct Seq {
    std::vector<float> k, v;  // [len, Hkv, D], [len, Hkv, Dv]
};

int64_t seq_id(Input &in) {
    static constexpr int64_t ids[] = {0, 1, 2, 3, 0, 1, 2, 3, 7, INT64_MAX, -1, INT64_MIN};
    return ids[in.byte() % 12];
}

} // namespace

// An int8 cache's rows (width w, one per token and KV head) against what was appended: finite,
// and each value within half a step (max |row| / 254) of it.
static void expect_rows_quantized(const char *entry, const std::vector<float> &x, const std::vector<float> &got, int64_t w) {
    for (size_t r = 0; r + static_cast<size_t>(w) <= x.size(); r += static_cast<size_t>(w)) {
        double most = 0;
        for (int64_t i = 0; i < w; ++i) {
            if (!std::isfinite(x[r + static_cast<size_t>(i)])) fail(entry, "an int8 append accepted a non-finite value");
            most = std::max(most, std::fabs(static_cast<double>(x[r + static_cast<size_t>(i)])));
        }
        for (int64_t i = 0; i < w; ++i)
            if (!(std::fabs(static_cast<double>(got[r + static_cast<size_t>(i)]) - x[r + static_cast<size_t>(i)]) <=
                  most / 254 * (1 + 1e-5) + 1e-30))
                fail(entry, "an int8 row came back further than half a step");
    }
}

void fuzz_kv_cache(Input &in) {
    const char *E = "mha_kv_cache";
    mha_runtime *rt = pick_runtime(in);
    mha_kv_cache_config cfg{};
    cfg.num_kv_heads = in.dim();
    cfg.head_dim = in.dim();
    cfg.value_dim = in.byte() % 2 ? cfg.head_dim : in.dim();
    static constexpr int64_t blocks[] = {0, 0, 0, 8, 16, 32, 64, 128, 256, 3, 24, -16, INT64_MAX, 1, 48, 512};
    cfg.block_tokens = blocks[in.byte() % 16];
    const uint8_t mt = in.byte();
    // Capacity: small, or hostile only where it overflows (a valid huge one would allocate it all).
    static constexpr int64_t bad_tokens[] = {-1, INT64_MIN, INT64_MAX, INT64_MAX / 2, INT64_MAX / 4 + 1, int64_t{1} << 62};
    cfg.max_tokens = mt < 240 ? mt % 200 : bad_tokens[mt % 6];
    const uint8_t dt = in.byte();
    const int dtype = dt < 180 ? 0 : dt < 240 ? 2 : (dt % 2 ? 1 : 77);  // f32, i8, bf16 (unsupported), bad
    std::memcpy(&cfg.dtype, &dtype, sizeof dtype);
    if (mul(mul(cfg.num_kv_heads, add(cfg.head_dim, cfg.value_dim)), cfg.max_tokens > 0 && cfg.max_tokens < 1000 ? cfg.max_tokens : 1) >
        (int64_t{1} << 20))
        throw Skip{};
    mha_kv_cache *cache = nullptr;
    const uint8_t cnull = in.byte();
    const mha_status cst = mha_kv_cache_create(cnull % 32 == 1 ? nullptr : rt, cnull % 32 == 2 ? nullptr : &cfg,
                                               cnull % 32 == 3 ? nullptr : &cache);
    if (cst != MHA_OK) {
        if (cst == MHA_INTERNAL || !mha_last_error()[0]) fail(E, "create failed without a proper status and message");
        if (cache) fail(E, "a failed create left *out set");
        return;
    }
    if (!rt || cnull % 32 == 2 || cnull % 32 == 3) fail(E, "create accepted NULL arguments");
    struct Guard {
        mha_kv_cache *c;
        ~Guard() { mha_kv_cache_destroy(c); }
    } guard{cache};
    const int64_t Hkv = cfg.num_kv_heads, D = cfg.head_dim, Dv = cfg.value_dim;
    if (Hkv <= 0 || D <= 0 || Dv <= 0 || cfg.max_tokens < 0 || (dtype != 0 && dtype != 2))
        fail(E, "create accepted a bad config");
    const bool i8 = dtype == 2;
    mha_kv_cache_config got{};
    if (mha_kv_cache_get_config(cache, &got) != MHA_OK || got.num_kv_heads != Hkv || got.head_dim != D || got.value_dim != Dv ||
        got.block_tokens <= 0 || got.max_tokens < cfg.max_tokens)
        fail(E, "get_config disagrees with the config");
    std::map<int64_t, Seq> model;
    Rng rng{in.seed()};
    for (int op = 0; op < 12 && in.left() > 0; ++op) {
        const uint8_t kind = in.byte() % 8;
        if (kind <= 2) {  // append
            const int64_t id = seq_id(in), n = in.dim();
            const uint8_t nulls = in.byte();
            In k(count({n, Hkv, D}), rng, nulls % 16 == 1), v(count({n, Hkv, Dv}), rng, nulls % 16 == 2);
            int64_t before = -1, free_before = 0;
            const bool known = model.count(id) != 0;
            mha_kv_cache_free_tokens(cache, &free_before);
            const mha_status st = mha_kv_cache_append(nulls % 32 == 3 ? nullptr : rt, cache, id, n, k.ptr(), v.ptr());
            if (st != MHA_OK) {
                if (st == MHA_INTERNAL || !mha_last_error()[0]) fail(E, "append failed without a proper status and message");
                int64_t len = -1;
                const mha_status ls = mha_kv_cache_seq_len(cache, id, &len);
                if (known ? (ls != MHA_OK || len != static_cast<int64_t>(model[id].k.size()) / (Hkv * D)) : ls == MHA_OK)
                    fail(E, "a failed append changed the sequence");
                int64_t free_after = 0;
                mha_kv_cache_free_tokens(cache, &free_after);
                if (free_after != free_before) fail(E, "a failed append changed the free tokens");
                (void)before;
                continue;
            }
            if (id < 0 || n < 0 || nulls % 32 == 3 || (n > 0 && (k.null || v.null))) fail(E, "append accepted bad arguments");
            if (k.need == kImpossible || v.need == kImpossible) fail(E, "append accepted an impossible size");
            Seq &s = model[id];
            if (i8 && n > 0) {  // the model holds what the cache holds: each row within half a step
                const int64_t len = static_cast<int64_t>(s.k.size()) / (Hkv * D);
                std::vector<float> kw(k.v.size()), vw(v.v.size());
                if (mha_kv_cache_read(cache, id, len, n, kw.data(), vw.data()) != MHA_OK) fail(E, "read after an int8 append failed");
                expect_rows_quantized(E, k.v, kw, D);
                expect_rows_quantized(E, v.v, vw, Dv);
                s.k.insert(s.k.end(), kw.begin(), kw.end());
                s.v.insert(s.v.end(), vw.begin(), vw.end());
                continue;
            }
            s.k.insert(s.k.end(), k.v.begin(), k.v.end());
            s.v.insert(s.v.end(), v.v.begin(), v.v.end());
        } else if (kind == 3) {  // fork
            const int64_t src = seq_id(in), dst = seq_id(in);
            const mha_status st = mha_kv_cache_fork(in.flag(32) ? nullptr : cache, src, dst);
            if (st != MHA_OK) {
                if (st == MHA_INTERNAL || !mha_last_error()[0]) fail(E, "fork failed without a proper status and message");
                continue;
            }
            if (!model.count(src) || model.count(dst) || dst < 0) fail(E, "fork accepted a bad source or destination");
            model[dst] = model[src];
        } else if (kind == 4) {  // release
            const int64_t id = seq_id(in);
            const mha_status st = mha_kv_cache_release(cache, id);
            if (st != MHA_OK) {
                if (st == MHA_INTERNAL || !mha_last_error()[0]) fail(E, "release failed without a proper status and message");
                if (model.count(id)) fail(E, "release refused a held sequence");
                continue;
            }
            if (!model.count(id)) fail(E, "release accepted an unknown sequence");
            model.erase(id);
        } else if (kind == 5) {  // read
            const int64_t id = seq_id(in);
            int64_t start = in.dim(), n = in.dim();
            const uint8_t nulls = in.byte();
            Out k(count({n, Hkv, D}), nulls % 4 == 1), v(count({n, Hkv, Dv}), nulls % 4 == 2);
            k.save();
            v.save();
            const mha_status st = mha_kv_cache_read(cache, id, start, n, k.ptr(), v.ptr());
            if (!check_status(E, st, {&k, &v})) continue;
            const auto it = model.find(id);
            if (it == model.end()) fail(E, "read accepted an unknown sequence");
            const int64_t len = static_cast<int64_t>(it->second.k.size()) / (Hkv * D);
            if (start < 0 || n < 0 || start > len || n > len - start) fail(E, "read accepted a range outside the sequence");
            if (k.need == kImpossible || v.need == kImpossible) fail(E, "read accepted an impossible size");
            if (!k.null && n > 0 && std::memcmp(k.data(), it->second.k.data() + start * Hkv * D, static_cast<size_t>(n * Hkv * D) * 4))
                fail(E, "read gave other K than appended");
            if (!v.null && n > 0 &&
                std::memcmp(v.data(), it->second.v.data() + start * Hkv * Dv, static_cast<size_t>(n * Hkv * Dv) * 4))
                fail(E, "read gave other V than appended");
            if ((k.null && !k.untouched()) || (v.null && !v.untouched())) fail(E, "canary: read wrote a skipped output");
        } else if (kind == 6) {  // attention over some sequences
            mha_cached_params p{};
            p.num_seqs = num_seqs(in);
            std::vector<int64_t> ids(static_cast<size_t>(p.num_seqs >= 0 && p.num_seqs <= 16 ? p.num_seqs : 1));
            for (auto &id : ids) id = seq_id(in);
            std::vector<int64_t> qo(ids.size() + 1, 0);
            for (size_t s = 0; s < ids.size(); ++s) {
                const auto it = model.find(ids[s]);
                const int64_t len = it == model.end() ? 0 : static_cast<int64_t>(it->second.k.size()) / (Hkv * D);
                const uint8_t b = in.byte();
                const int64_t n = b < 200 ? (len ? static_cast<int64_t>(b) % (len + 1) : 0) : (b < 250 ? len + 1 : in.dim());
                qo[s + 1] = add_sat(qo[s], n);
            }
            if (in.flag(16)) qo[in.byte() % qo.size()] = in.dim();
            const uint8_t hb = in.byte();
            p.num_heads = hb < 220 ? Hkv * (1 + hb % 3) : in.dim();
            p.scale = in.byte() % 4 ? 0.0f : in.scalar();
            p.causal = in.byte() & 1;
            const uint8_t nulls = in.byte();
            std::vector<float> slopes, sinks;
            decode_variant(in, rng, p.num_heads, p.variant, slopes, sinks);  // outputs are compared at 1e-4 either way
            p.seq_ids = nulls % 16 == 1 ? nullptr : ids.data();
            p.q_offsets = nulls % 16 == 2 ? nullptr : qo.data();
            const bool ok_offsets = offsets_valid(qo, p.num_seqs);
            const int64_t tq = ok_offsets ? qo[static_cast<size_t>(p.num_seqs)] : 0;
            In q(count({tq, p.num_heads, D}), rng, nulls % 16 == 3);
            Out out(count({tq, p.num_heads, Dv}), nulls % 16 == 4);
            out.save();
            const mha_status st =
                mha_attention_cached(nulls % 32 == 5 ? nullptr : rt, nulls % 32 == 6 ? nullptr : cache, &p, q.ptr(), out.ptr());
            if (!check_status(E, st, {&out})) continue;
            if (p.num_seqs == 0) continue;
            if (!ok_offsets || !p.seq_ids || !p.q_offsets || nulls % 32 == 5 || nulls % 32 == 6)
                fail(E, "attention_cached accepted broken offsets or NULL arguments");
            std::set<int64_t> distinct(ids.begin(), ids.end());
            if (distinct.size() != ids.size()) fail(E, "attention_cached accepted repeated seq ids");
            if (p.num_heads <= 0 || p.num_heads % Hkv) fail(E, "attention_cached accepted bad num_heads");
            if (!variant_valid(p.variant, p.num_heads)) fail(E, "attention_cached accepted a bad variant");
            if (tq == 0) {
                if (!out.untouched()) fail(E, "canary: attention_cached wrote out with no queries");
                continue;
            }
            if (q.need == kImpossible || out.need == kImpossible || q.null || out.null)
                fail(E, "attention_cached accepted an impossible or NULL q or out");
            const double scale = p.scale != 0.0f ? p.scale : 1.0 / std::sqrt(static_cast<double>(D));
            if (!std::isfinite(p.scale)) fail(E, "attention_cached accepted a non-finite scale");
            for (size_t s = 0; s < ids.size(); ++s) {
                const auto it = model.find(ids[s]);
                if (it == model.end()) fail(E, "attention_cached accepted an unknown sequence");
                const int64_t len = static_cast<int64_t>(it->second.k.size()) / (Hkv * D);
                const int64_t nq = qo[s + 1] - qo[s];
                if (nq > len) fail(E, "attention_cached accepted more queries than cached tokens");
                if (nq == 0) continue;
                mha::ref::AttentionCase c{1, nq, len, p.num_heads, Hkv, D, Dv, scale, p.causal != 0};
                c.window = p.variant.window;
                c.softcap = p.variant.softcap;
                c.alibi = p.variant.alibi_slopes;
                c.sinks = p.variant.sink_logits;
                std::vector<double> want;
                mha::ref::attention(c, q.v.data() + qo[s] * p.num_heads * D, it->second.k.data(), it->second.v.data(), want);
                const float *o = out.data() + qo[s] * p.num_heads * Dv;
                if (!well_conditioned(scale) || !variant_conditioned(p.variant, p.num_heads)) {
                    expect_convex(E, o, want.size(), it->second.v);
                    continue;
                }
                for (size_t i = 0; i < want.size(); ++i) expect_close(E, "cached out", o[i], want[i], 1e-4);
            }
        } else {  // the getters, with NULL outputs now and then
            const int64_t id = seq_id(in);
            int64_t len = -1;
            const bool null_out = in.flag(8);
            const mha_status st = mha_kv_cache_seq_len(cache, id, null_out ? nullptr : &len);
            const auto it = model.find(id);
            if ((st == MHA_OK) != (it != model.end() && !null_out)) fail(E, "seq_len disagrees with the sequences held");
            if (st == MHA_OK && len != static_cast<int64_t>(it->second.k.size()) / (Hkv * D)) fail(E, "seq_len is wrong");
            if (st != MHA_OK && !mha_last_error()[0]) fail(E, "seq_len failed with no message");
            uint64_t bytes = 0;
            if (mha_kv_cache_bytes(cache, &bytes) != MHA_OK || mha_kv_cache_bytes(cache, nullptr) == MHA_OK ||
                mha_kv_cache_free_tokens(cache, nullptr) == MHA_OK || mha_kv_cache_get_config(cache, nullptr) == MHA_OK)
                fail(E, "a getter's NULL checks");
            int64_t free_tokens = -1;
            const int64_t capacity = (got.max_tokens + got.block_tokens - 1) / got.block_tokens * got.block_tokens;
            if (mha_kv_cache_free_tokens(cache, &free_tokens) != MHA_OK || free_tokens < 0 || free_tokens > capacity)
                fail(E, "free_tokens out of range");
        }
    }
}

// mha_runtime_create*, scratch_bytes, the NULL-accepting destroys, last_error.
void fuzz_misc(Input &in) {
    const char *E = "misc";
    const uint8_t b = in.byte();
    uint64_t bytes = 0;
    switch (b % 6) {
    case 0:
        if (mha_runtime_scratch_bytes(runtime(b & 8 ? 1 : 0), &bytes) != MHA_OK) fail(E, "scratch_bytes failed");
        if (mha_runtime_scratch_bytes(nullptr, &bytes) == MHA_OK || mha_runtime_scratch_bytes(runtime(0), nullptr) == MHA_OK)
            fail(E, "scratch_bytes accepted NULL");
        break;
    case 1:
        if (mha_runtime_create(1, nullptr) == MHA_OK || !mha_last_error()[0]) fail(E, "runtime_create accepted NULL out");
        break;
    case 2: {
        mha_runtime *rt = reinterpret_cast<mha_runtime *>(1);
        // A missing config file fails and leaves *out NULL.
        if (mha_runtime_create_with_config(1, "/nonexistent/mha-fuzz.json", &rt) == MHA_OK || rt) fail(E, "a missing config");
        break;
    }
    case 3:
        mha_runtime_destroy(nullptr);
        mha_layer_destroy(nullptr);
        mha_encoder_layer_destroy(nullptr);
        mha_kv_cache_destroy(nullptr);
        break;
    case 4: {
        mha_layer_config c{};
        c.embed_dim = in.dim();
        c.num_heads = in.dim();
        c.num_kv_heads = in.flag() ? 0 : in.dim();
        c.head_dim = in.flag() ? 0 : in.dim();
        c.value_dim = in.flag() ? 0 : in.dim();
        c.kdim = in.flag() ? 0 : in.dim();
        c.vdim = in.flag() ? 0 : in.dim();
        Rng rng{in.seed()};
        const int64_t E3 = mul(3, c.embed_dim);
        In ipw(count({E3, c.embed_dim}), rng, in.flag(8)), ipb(E3, rng, in.flag()), opw(count({c.embed_dim, c.embed_dim}), rng, in.flag(8)),
            opb(c.embed_dim, rng, in.flag());
        mha_layer_weights w;
        std::memset(&w, 0xab, sizeof w);
        const mha_layer_weights before = w;
        const mha_status st = mha_layer_weights_from_in_proj(in.flag(32) ? nullptr : &c, ipw.ptr(), ipb.ptr(), opw.ptr(), opb.ptr(),
                                                             in.flag(32) ? nullptr : &w);
        if (st != MHA_OK) {
            if (st == MHA_INTERNAL || !mha_last_error()[0]) fail(E, "from_in_proj failed without a proper status");
            if (std::memcmp(&w, &before, sizeof w)) fail(E, "canary: a failed from_in_proj wrote its output");
            break;
        }
        const int64_t Ed = c.embed_dim;
        if (Ed <= 0 || ipw.null) fail(E, "from_in_proj accepted a bad embed_dim or a NULL in_proj_weight");  // out_proj_weight: checked by create
        if (w.q_weight != ipw.ptr() || w.k_weight != ipw.ptr() + Ed * Ed || w.v_weight != ipw.ptr() + 2 * Ed * Ed ||
            w.out_weight != opw.ptr() || w.q_bias != (ipb.ptr() ? ipb.ptr() : nullptr) || w.norm_weight || w.norm_bias)
            fail(E, "from_in_proj pointers");
        break;
    }
    default: {
        // Non-finite or broken inputs to softmax: NaN rows stay NaN, nothing crashes.
        Rng rng{in.seed()};
        const int64_t rows = 1 + in.small(4), cols = 1 + in.small(20);
        std::vector<float> x(static_cast<size_t>(rows * cols));
        for (auto &v : x) {
            const uint8_t k = in.byte();
            v = k < 200 ? rng.value() * 1e30f : (k < 220 ? NAN : (k < 240 ? INFINITY : -INFINITY));
        }
        Out y(rows * cols, false);
        y.save();
        if (!check_status(E, mha_softmax(runtime(0), rows, cols, x.data(), cols, y.ptr(), cols), {&y}))
            fail(E, "softmax refused finite sizes");
        break;
    }
    }
}

} // namespace fuzz
