// The unfused attention: per (batch, head), S = scale Q K^T with the GEMM, the masks, the row
// softmax, then O = P V with the GEMM. It stores the q_len x kv_len matrix, so it serves as a
// second opinion in tests and as a baseline, not as the default path.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "mha/attention.hpp"
#include "mha/error.hpp"
#include "mha/gemm.hpp"
#include "mha/softmax.hpp"

namespace mha {

void attention_unfused(Runtime &rt, const AttentionParams &p, const float *q, const float *k, const float *v,
                       float *out) {
    AttentionParams checked = p;
    checked.weights = nullptr;
    attention_validate(checked, q, k, v, out);
    if (p.variant.any())
        throw Error(Status::unsupported, "attention_unfused: the score modifiers (variant) are only in the fused path");
    if (p.batch == 0 || p.q_len == 0) return;
    const int64_t Lq = p.q_len, Lk = p.kv_len, H = p.num_heads, Hkv = p.num_kv_heads, D = p.head_dim,
                  Dv = p.value_dim, G = H / Hkv;
    const float scale = p.scale != 0.0f ? p.scale : 1.0f / std::sqrt(static_cast<float>(D));
    const int64_t ldq = p.q_stride ? p.q_stride : H * D, ldk = p.k_stride ? p.k_stride : Hkv * D,
                  ldv = p.v_stride ? p.v_stride : Hkv * Dv, ldo = p.out_stride ? p.out_stride : H * Dv;
    std::vector<float> s(static_cast<size_t>(Lq * std::max<int64_t>(Lk, 1)));
    for (int64_t b = 0; b < p.batch; ++b)
        for (int64_t h = 0; h < H; ++h) {
            const int64_t g = h / G;
            float *o = out + b * Lq * ldo + h * Dv;
            if (Lk == 0) {
                for (int64_t i = 0; i < Lq; ++i) std::fill(o + i * ldo, o + i * ldo + Dv, 0.0f);
                continue;
            }
            sgemm(rt, Trans::N, Trans::T, Lq, Lk, D, scale, q + b * Lq * ldq + h * D, ldq, k + b * Lk * ldk + g * D, ldk, 0.0f, s.data(), Lk);
            for (int64_t i = 0; i < Lq; ++i) {
                float *row = s.data() + i * Lk;
                int64_t lim = Lk;
                if (p.kv_valid_lens) lim = std::min<int64_t>(lim, p.kv_valid_lens[b]);
                if (p.causal) lim = std::min(lim, i + Lk - Lq + 1);
                for (int64_t j = std::max<int64_t>(lim, 0); j < Lk; ++j) row[j] = -std::numeric_limits<float>::infinity();
                if (p.mask)
                    for (int64_t j = 0; j < Lk; ++j)
                        if (!p.mask[b * p.mask_batch_stride + i * p.mask_row_stride + j])
                            row[j] = -std::numeric_limits<float>::infinity();
            }
            softmax(rt, Lq, Lk, s.data(), Lk, s.data(), Lk);
            if (p.weights) std::copy(s.begin(), s.begin() + Lq * Lk, p.weights + (b * H + h) * Lq * Lk);
            sgemm(rt, Trans::N, Trans::N, Lq, Dv, Lk, 1.0f, s.data(), Lk, v + b * Lk * ldv + g * Dv, ldv, 0.0f, o, ldo);
        }
}

} // namespace mha
