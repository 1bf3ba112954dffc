// The fused attention of one work item, written once over an xsimd architecture and the GEMM
// microkernel shape (FlashAttention, Dao et al. 2022, on the GEMM microkernels and the online
// softmax). Include only from an ISA's translation unit.
//
// The rows of every head that shares one KV head are stacked into one block of M rows, so each
// packed K and V tile serves the whole group (GQA/MQA without copies). For each key tile:
//   S = (scale Q) K^T        the GEMM microkernel on packed panels
//   masks -> -inf            causal, valid length and the boolean mask, from their compact forms
//   online softmax fold      S becomes P; running max/sum; the accumulator is rescaled
//   acc += P V               the microkernel again, P read in place
// Tiles that no row can see are never computed. The Lq x Lk matrix never exists.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "attention/attention_shape.hpp"
#include "gemm/sgemm_macro.hpp"
#include "softmax/softmax_kernels.hpp"

namespace mha::attention_detail {
namespace {

inline int64_t round_up_to(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// The scratch layout of one item.
struct ItemScratch {
    float *q_rows, *q_packed, *k_packed, *v_packed, *s, *m, *l, *acc;
    static int64_t sizes(const Shape &s, int mr, int nr, int64_t out[8]) {
        const int64_t M = s.group() * s.block_q, Mp = round_up_to(M, mr), BK = s.block_k;
        out[0] = M * s.head_dim;                       // q_rows: scaled Q rows, row-major
        out[1] = Mp * s.head_dim;                      // q_packed: MR-row panels
        out[2] = round_up_to(BK, nr) * s.head_dim;     // k_packed: K^T in NR-column panels
        out[3] = BK * round_up_to(s.value_dim, nr);    // v_packed: V in NR-column panels
        out[4] = M * BK;                               // s: scores, then probabilities
        out[5] = M;                                    // m: running max
        out[6] = M;                                    // l: running sum
        out[7] = M * s.value_dim;                      // acc: output accumulator
        int64_t total = 0;
        for (int i = 0; i < 8; ++i) total += round_up_to(out[i], 16);  // keep each part 64-byte aligned
        return total;
    }
    ItemScratch(const Shape &s, int mr, int nr, float *base) {
        int64_t sz[8];
        sizes(s, mr, nr, sz);
        float **parts[8] = {&q_rows, &q_packed, &k_packed, &v_packed, &this->s, &m, &l, &acc};
        for (int i = 0; i < 8; ++i) {
            *parts[i] = base;
            base += round_up_to(sz[i], 16);
        }
    }
};

template <class Arch, int MR, int NV>
struct FusedAttention {
    static constexpr int NR = NV * static_cast<int>(xsimd::batch<float, Arch>::size);
    using Rows = softmax_detail::RowKernels<Arch>;
    static constexpr float kNegInf = -std::numeric_limits<float>::infinity();

    // Sets the scores of keys [j0, j0 + n) that row i of batch b may not see to -inf.
    static void apply_masks(const Shape &s, int64_t b, int64_t i, int64_t j0, int64_t n, float *row) {
        const int64_t lim = s.key_limit(b, i) - j0;
        for (int64_t j = lim < 0 ? 0 : lim; j < n; ++j) row[j] = kNegInf;
        if (s.mask) {
            const uint8_t *mrow = s.mask + b * s.mask_batch_stride + i * s.mask_row_stride + j0;
            const int64_t end = lim < n ? lim : n;
            for (int64_t j = 0; j < end; ++j)
                if (!mrow[j]) row[j] = kNegInf;
        }
    }

    // S[0:M, 0:n] = scores of keys [j0, j0 + n) for the item's rows, masked.
    static void scores(const Shape &s, const float *k, const Item &it, int64_t M, int64_t rows_per_head, int64_t j0,
                       int64_t n, const ItemScratch &w) {
        const int64_t D = s.head_dim, kv_stride = s.kv_heads * D;
        const float *k0 = k + ((it.b * s.kv_len + j0) * s.kv_heads + it.g) * D;
        pack_panels_into(n, D, k0, kv_stride, 1, w.k_packed);
        gemm::sgemm_macro_packed<Arch, MR, NV>(M, n, D, w.q_packed, w.k_packed, w.s, s.block_k, 1.0f, 0.0f);
        for (int64_t r = 0; r < M; ++r)
            apply_masks(s, it.b, it.i0 + r % rows_per_head, j0, n, w.s + r * s.block_k);
    }

    static void pack_panels_into(int64_t count, int64_t kc, const float *src, int64_t sx, int64_t sp, float *out) {
        gemm::pack_panels<Arch, NR>(count, kc, src, sx, sp, out);
    }

    static void run(const Shape &s, const float *q, const float *k, const float *v, float *out, const Item &it,
                    float *scratch) {
        const int64_t G = s.group(), D = s.head_dim, Dv = s.value_dim, H = s.heads;
        const int64_t rows_per_head = it.i1 - it.i0, M = G * rows_per_head;
        const ItemScratch w(s, MR, NR, scratch);
        // Scaled Q rows of the group's heads, stacked head by head, then packed once.
        for (int64_t hh = 0; hh < G; ++hh)
            for (int64_t i = it.i0; i < it.i1; ++i) {
                const float *src = q + ((it.b * s.q_len + i) * H + it.g * G + hh) * D;
                float *dst = w.q_rows + (hh * rows_per_head + i - it.i0) * D;
                for (int64_t d = 0; d < D; ++d) dst[d] = src[d] * s.scale;
            }
        gemm::pack_panels<Arch, MR>(M, D, w.q_rows, D, 1, w.q_packed);
        std::fill(w.m, w.m + M, kNegInf);
        std::fill(w.l, w.l + M, 0.0f);
        std::fill(w.acc, w.acc + M * Dv, 0.0f);

        // Keys no row of the item can see are skipped whole: past the valid length, or (causal)
        // past the last row's diagonal.
        int64_t key_end = 0;
        for (int64_t i = it.i0; i < it.i1; ++i) key_end = std::max(key_end, s.key_limit(it.b, i));
        const int64_t kv_stride = s.kv_heads * Dv;
        for (int64_t j0 = 0; j0 < key_end; j0 += s.block_k) {
            const int64_t n = std::min(s.block_k, key_end - j0);
            scores(s, k, it, M, rows_per_head, j0, n, w);
            Rows::online_fold(M, n, w.s, s.block_k, w.m, w.l, w.acc, Dv, Dv);
            const float *v0 = v + ((it.b * s.kv_len + j0) * s.kv_heads + it.g) * Dv;
            gemm::pack_panels<Arch, NR>(Dv, n, v0, 1, kv_stride, w.v_packed);
            gemm::sgemm_macro_sup<Arch, MR, NV>(gemm::SupArgs{M, Dv, n, 0, (Dv + NR - 1) / NR, w.s, s.block_k, 1,
                                                              nullptr, 0, w.v_packed, w.acc, Dv, 1.0f, 1.0f});
        }
        Rows::online_finish(M, w.l, w.acc, Dv, Dv);
        for (int64_t r = 0; r < M; ++r) {
            const int64_t hh = r / rows_per_head, i = it.i0 + r % rows_per_head;
            std::memcpy(out + ((it.b * s.q_len + i) * H + it.g * G + hh) * Dv, w.acc + r * Dv,
                        static_cast<size_t>(Dv) * sizeof(float));
        }
        if (s.weights) write_weights(s, k, it, M, rows_per_head, key_end, w);
    }

    // weights[b, h, i, :] = exp(S - m) / l, recomputing S tile by tile; keys never visible get 0.
    static void write_weights(const Shape &s, const float *k, const Item &it, int64_t M, int64_t rows_per_head,
                              int64_t key_end, const ItemScratch &w) {
        const int64_t G = s.group();
        auto weight_row = [&](int64_t r) {
            const int64_t hh = r / rows_per_head, i = it.i0 + r % rows_per_head;
            return s.weights + ((it.b * s.heads + it.g * G + hh) * s.q_len + i) * s.kv_len;
        };
        for (int64_t j0 = 0; j0 < key_end; j0 += s.block_k) {
            const int64_t n = std::min(s.block_k, key_end - j0);
            scores(s, k, it, M, rows_per_head, j0, n, w);
            for (int64_t r = 0; r < M; ++r) {
                float *dst = weight_row(r) + j0;
                if (w.l[r] == 0.0f || std::isnan(w.l[r])) {
                    std::fill(dst, dst + n, w.l[r] == 0.0f ? 0.0f : w.l[r]);
                    continue;
                }
                Rows::exp_store_sum(w.s + r * s.block_k, n, w.m[r], dst);
                Rows::scale(dst, n, 1.0f / w.l[r]);
            }
        }
        for (int64_t r = 0; r < M; ++r) std::fill(weight_row(r) + key_end, weight_row(r) + s.kv_len, 0.0f);
    }
};

} // namespace
} // namespace mha::attention_detail
