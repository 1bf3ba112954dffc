// The score modifiers (soft-capping, ALiBi) and the masks of the fused attention, applied to a
// row of scaled scores, written once over an xsimd architecture. Include only from an ISA's
// translation unit (through attention_kernel.hpp).
#pragma once

#include <cstdint>
#include <limits>

#include <xsimd/xsimd.hpp>

#include "attention/attention_shape.hpp"
#include "simd/fmadd.hpp"
#include "softmax/softmax_kernels.hpp"

namespace mha::attention_detail {
namespace {

template <class Arch>
struct ScoreModifiers {
    static constexpr int W = static_cast<int>(xsimd::batch<float, Arch>::size);
    using V = xsimd::batch<float, Arch>;
    using Tail = softmax_detail::Partial<Arch>;
    static constexpr float kNegInf = -std::numeric_limits<float>::infinity();

    // Sets the scores of keys [j0, j0 + n) that row i of batch b may not see to -inf.
    static void apply_masks(const Shape &s, int64_t b, int64_t i, int64_t j0, int64_t n, float *row) {
        const int64_t lim = s.key_limit(b, i) - j0;
        for (int64_t j = lim < 0 ? 0 : lim; j < n; ++j) row[j] = kNegInf;
        const int64_t first = std::min(s.key_start(b, i) - j0, std::min(lim, n));  // the window
        for (int64_t j = 0; j < first; ++j) row[j] = kNegInf;
        if (s.mask) {
            const uint8_t *mrow = s.mask + b * s.mask_batch_stride + i * s.mask_row_stride + j0;
            const int64_t end = lim < n ? lim : n;
            for (int64_t j = 0; j < end; ++j)
                if (!mrow[j]) row[j] = kNegInf;
        }
    }

    // tanh(x) = sign(x) (1 - e) / (1 + e) with e = exp(-2|x|): one vexp per vector, 1 at large
    // |x|, NaN stays NaN. Below |x| = 1/8, where 1 - e cancels (a cap far above the scores made
    // every capped score 0: x = s / cap rounds e to 1), its odd Taylor series to x^7, whose next
    // term is under 2e-10 of x there. Relative error: a few ulp everywhere.
    static V vtanh(const V &x) {
        const V ax = xsimd::abs(x);
        const V e = softmax_detail::vexp_nonpositive<Arch>(V(-2.0f) * ax);
        V t = (V(1.0f) - e) / (V(1.0f) + e);
        t = xsimd::select(x < V(0.0f), -t, t);
        const V x2 = x * x;
        const V p = simd::fmadd(x2, simd::fmadd(x2, V(-17.0f / 315.0f), V(2.0f / 15.0f)), V(-1.0f / 3.0f));
        const V small = simd::fmadd(x * x2, p, x);
        return xsimd::select(ax < V(0.125f), small, t);
    }

    // Soft-capping and ALiBi on the scaled scores of keys [j0, j0 + n) for a query at position p
    // of head h: s = cap tanh(s / cap), then s += slope[h] (j - p). Scores are independent of each
    // other, so the tile and panel a key is computed in never change its bits.
    static void modify_scores(const Shape &s, int64_t h, int64_t p, int64_t j0, int64_t n, float *row) {
        if (s.softcap != 0.0f) {
            const V cap(s.softcap), inv(1.0f / s.softcap);
            int64_t j = 0;
            for (; j + W <= n; j += W) (cap * vtanh(V::load_unaligned(row + j) * inv)).store_unaligned(row + j);
            if (j < n) Tail::store(row + j, n - j, cap * vtanh(Tail::load(row + j, n - j, 0.0f) * inv));
        }
        if (s.alibi) {
            const float slope = s.alibi[h];
            alignas(64) float iota[W];
            for (int t = 0; t < W; ++t) iota[t] = static_cast<float>(t);
            const V vs(slope), vi = V::load_aligned(iota);
            int64_t j = 0;
            // j0 + j - p is an integer below 2^24 in magnitude: exact in float.
            for (; j + W <= n; j += W)
                simd::fmadd(vs, V(static_cast<float>(j0 + j - p)) + vi, V::load_unaligned(row + j)).store_unaligned(row + j);
            if (j < n)
                Tail::store(row + j, n - j,
                            simd::fmadd(vs, V(static_cast<float>(j0 + j - p)) + vi, Tail::load(row + j, n - j, 0.0f)));
        }
    }
};

} // namespace
} // namespace mha::attention_detail
