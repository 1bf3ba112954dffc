// Ragged attention (mha::attention_varlen) and attention over the paged KV cache
// (mha::attention_cached): validation, then the one scheduler and kernels every attention path
// shares (src/attention/), so a token's bits do not depend on which of them computed it.
#include <algorithm>
#include <cmath>
#include <string>
#include <unordered_set>
#include <vector>

#include "attention/attention_shape.hpp"
#include "mha/error.hpp"
#include "mha/serving.hpp"
#include "runtime/runtime_state.hpp"
#include "runtime/validate.hpp"
#include "serving/kv_cache_impl.hpp"

namespace mha {
namespace {

std::string str(int64_t x) { return std::to_string(x); }

void positive(const char *name, int64_t x) {
    if (x <= 0) invalid_argument(std::string(name) + " = " + str(x) + " must be positive");
}

// Checks that rows x width floats (rows `ld` apart) fit in int64 and that data is not NULL when
// there are any.
void check_tensor(const char *name, const void *data, int64_t rows, int64_t width, int64_t ld) {
    int64_t extent;
    if (rows > 0 && (__builtin_mul_overflow(rows, ld, &extent) || extent > INT64_MAX / 8))
        invalid_argument(std::string(name) + ": " + str(rows) + " rows of " + str(ld) + " floats overflow");
    if (rows > 0 && width > 0 && !data) invalid_argument(std::string(name) + " is NULL");
}

int64_t checked_mul(int64_t a, int64_t b, const char *what) {
    int64_t r;
    if (__builtin_mul_overflow(a, b, &r) || r > INT64_MAX / 8) invalid_argument(std::string(what) + ": the sizes overflow");
    return r;
}

float resolved_scale(float scale, int64_t head_dim) {
    if (!std::isfinite(scale)) invalid_argument("scale must be finite");
    return scale != 0.0f ? scale : 1.0f / std::sqrt(static_cast<float>(head_dim));
}

attention_detail::Shape ragged_shape(const detail::RuntimeState &st, int64_t num_seqs, const int64_t *q_off,
                                     const int64_t *kv_off, int64_t H, int64_t Hkv, int64_t D, int64_t Dv, float scale,
                                     bool causal) {
    int64_t max_q = 0, max_kv = 0;
    for (int64_t s = 0; s < num_seqs; ++s) {
        max_q = std::max(max_q, q_off[s + 1] - q_off[s]);
        max_kv = std::max(max_kv, kv_off[s + 1] - kv_off[s]);
    }
    attention_detail::Shape s{num_seqs, max_q, max_kv, H, Hkv, D, Dv, scale, causal, nullptr, nullptr, 0, 0, nullptr,
                              std::max<int64_t>(1, std::min(st.tiles.attn_block_q, max_q)), st.tiles.attn_block_k,
                              st.tiles.attn_kv_chunk};
    s.q_off = q_off;
    s.kv_off = kv_off;
    return s;
}

// Checks a row stride: 0 (dense: width) or at least width. Returns the stride in floats.
int64_t row_stride(const char *name, int64_t stride, int64_t width) {
    if (stride < 0 || (stride != 0 && stride < width))
        invalid_argument(std::string(name) + " = " + str(stride) + " must be 0 (dense) or >= " + str(width));
    return stride ? stride : width;
}

} // namespace

void attention_varlen_validate(const VarlenParams &p, const float *q, const float *k, const float *v,
                               const float *out) {
    positive("num_heads", p.num_heads);
    positive("num_kv_heads", p.num_kv_heads);
    positive("head_dim", p.head_dim);
    positive("value_dim", p.value_dim);
    if (p.num_heads % p.num_kv_heads != 0)
        invalid_argument("num_heads = " + str(p.num_heads) + " is not a multiple of num_kv_heads = " + str(p.num_kv_heads));
    const int64_t total_q = detail::check_offsets("q_offsets", p.q_offsets, p.num_seqs);
    const int64_t total_kv = detail::check_offsets("kv_offsets", p.kv_offsets, p.num_seqs);
    const int64_t wq = checked_mul(p.num_heads, p.head_dim, "q"), wk = checked_mul(p.num_kv_heads, p.head_dim, "k"),
                  wv = checked_mul(p.num_kv_heads, p.value_dim, "v"), wo = checked_mul(p.num_heads, p.value_dim, "out");
    const int64_t ldq = row_stride("q_stride", p.q_stride, wq);
    check_tensor("q", q, total_q, wq, ldq);
    check_tensor("k", k, total_kv, wk, row_stride("k_stride", p.k_stride, wk));
    check_tensor("v", v, total_kv, wv, row_stride("v_stride", p.v_stride, wv));
    const int64_t ldo = row_stride("out_stride", p.out_stride, wo);
    check_tensor("out", out, total_q, wo, ldo);
    if (total_q > 0) attention_detail::check_in_place(q, out, p.head_dim, p.value_dim, ldq, ldo, false);
    resolved_scale(p.scale, p.head_dim);
    attention_variant_validate(p.variant, p.num_heads);
}

void attention_varlen(Runtime &rt, const VarlenParams &p, const float *q, const float *k, const float *v, float *out) {
    attention_varlen_validate(p, q, k, v, out);
    const int64_t total_q = p.num_seqs > 0 ? p.q_offsets[p.num_seqs] : 0;
    if (total_q == 0) return;
    const float scale = resolved_scale(p.scale, p.head_dim);
    auto &st = rt.state();
    const auto &ak = attention_detail::find_attention_kernel(st.tiles.gemm_ukernel);
    auto s = ragged_shape(st, p.num_seqs, p.q_offsets, p.kv_offsets, p.num_heads, p.num_kv_heads, p.head_dim,
                          p.value_dim, scale, p.causal);
    attention_detail::run_dense(st, ak, s, p, q, k, v, out);
}

void attention_cached(Runtime &rt, const KVCache &cache, const CachedParams &p, const float *q, float *out) {
    const KVCache::Impl &c = cache.impl();
    const KVCacheConfig &cfg = c.cfg;
    auto &st = rt.state();
    c.check_runtime(st);
    positive("num_heads", p.num_heads);
    if (p.num_heads % cfg.num_kv_heads != 0)
        invalid_argument("num_heads = " + str(p.num_heads) + " is not a multiple of the cache's num_kv_heads = " +
                         str(cfg.num_kv_heads));
    if (p.num_seqs > 0 && !p.seq_ids) invalid_argument("seq_ids is NULL");
    const int64_t total_q = detail::check_offsets("q_offsets", p.q_offsets, p.num_seqs);
    const int64_t wq = checked_mul(p.num_heads, cfg.head_dim, "q"), wo = checked_mul(p.num_heads, cfg.value_dim, "out");
    if (p.q_stride < 0 || (p.q_stride != 0 && p.q_stride < wq))
        invalid_argument("q_stride = " + str(p.q_stride) + " must be 0 (dense) or >= " + str(wq));
    if (p.out_stride < 0 || (p.out_stride != 0 && p.out_stride < wo))
        invalid_argument("out_stride = " + str(p.out_stride) + " must be 0 (dense) or >= " + str(wo));
    const int64_t ldq = p.q_stride ? p.q_stride : wq, ldo = p.out_stride ? p.out_stride : wo;
    check_tensor("q", q, total_q, wq, ldq);
    check_tensor("out", out, total_q, wo, ldo);
    if (total_q > 0) attention_detail::check_in_place(q, out, cfg.head_dim, cfg.value_dim, ldq, ldo, false);
    const float scale = resolved_scale(p.scale, cfg.head_dim);
    attention_variant_validate(p.variant, p.num_heads);
    if (cfg.window > 0 && (p.variant.window == 0 || p.variant.window > cfg.window))
        invalid_argument("variant.window = " + str(p.variant.window) + ": the kv cache releases what a window of " +
                         str(cfg.window) + " does not reach, so attention over it needs a window in [1, " +
                         str(cfg.window) + "]");
    std::unordered_set<int64_t> seen;
    for (int64_t s = 0; s < p.num_seqs; ++s)
        if (!seen.insert(p.seq_ids[s]).second)
            invalid_argument("seq_ids[" + str(s) + "] = " + str(p.seq_ids[s]) + " appears twice");

    const auto snap = c.snapshot(std::span<const int64_t>(p.seq_ids, static_cast<size_t>(p.num_seqs)));
    std::vector<int64_t> kv_off(static_cast<size_t>(p.num_seqs) + 1, 0);
    for (int64_t s = 0; s < p.num_seqs; ++s) {
        const int64_t n = p.q_offsets[s + 1] - p.q_offsets[s], len = snap.lens[static_cast<size_t>(s)];
        if (n > len)
            invalid_argument("sequence seq_ids[" + str(s) + "] = " + str(p.seq_ids[s]) + " has " + str(n) +
                             " query rows (q_offsets) but only " + str(len) + " cached tokens");
        kv_off[static_cast<size_t>(s) + 1] = kv_off[static_cast<size_t>(s)] + len;
        // A cache with a window released what its windows no longer reach: the queries' windows
        // must keep clear of it.
        const int64_t released = snap.released[static_cast<size_t>(s)];
        if (cfg.window > 0 && n > 0 && std::max<int64_t>(0, len - n - p.variant.window + 1) < released)
            invalid_argument("sequence seq_ids[" + str(s) + "] = " + str(p.seq_ids[s]) + ": its query at position " +
                             str(len - n) + " with variant.window = " + str(p.variant.window) +
                             " would see positions the cache released (before " + str(released) + ")");
    }
    if (total_q == 0) return;
    const auto &ak = attention_detail::find_attention_kernel(st.tiles.gemm_ukernel);
    auto s = ragged_shape(st, p.num_seqs, p.q_offsets, kv_off.data(), p.num_heads, cfg.num_kv_heads, cfg.head_dim,
                          cfg.value_dim, scale, p.causal);
    s.ldq = ldq;
    s.ldo = ldo;
    s.kv_cache = &snap.view;
    attention_detail::set_variant(s, p.variant);
    attention_detail::run_attention(st, ak, s, q, nullptr, nullptr, out);
}

} // namespace mha
