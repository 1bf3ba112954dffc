// The int8 KV cache's arithmetic in the fused attention: its K and V panels widened to fp32, each
// key's scale applied to scores and probabilities, and decode's scores widened in registers,
// written once over an xsimd architecture and the GEMM microkernel shape (MR rows, NV vectors).
// Include only from an ISA's translation unit (through attention_kernel.hpp).
#pragma once

#include <algorithm>
#include <cstdint>

#include <xsimd/xsimd.hpp>

#include "attention/attention_shape.hpp"
#include "simd/fmadd.hpp"
#include "simd/widen_i8.hpp"
#include "softmax/softmax_kernels.hpp"

namespace mha::attention_detail {
namespace {

template <class Arch, int MR, int NV>
struct CacheI8 {
    static constexpr int W = static_cast<int>(xsimd::batch<float, Arch>::size);
    static constexpr int NR = NV * W;
    using V = xsimd::batch<float, Arch>;
    using Tail = softmax_detail::Partial<Arch>;

    // How far ahead (bytes) the int8 widening asks for the cache's lines: decode streams the
    // cache from memory and the hardware prefetchers fall behind. Zen 5, decode B16 Lk4096
    // H32/8 D128, 1 thread: none 21.9 ms, 1 KiB 18.4, 2 KiB 14.7, 4 KiB 13.7, 8 KiB 13.6.
    static constexpr int64_t kPrefetchI8 = 4096;

    // The int8 cache's arithmetic, the same on every path (so prefill, chunks and decode agree
    // bit for bit): a score is the microkernel's FMA chain over the head dimension on the stored
    // integers (exact in fp32), times the call's scale, times the key's scale; P V is the chain
    // over the keys of P times the value's scale, against the stored integers. Scaling once per
    // score and once per probability, not once per stored value, is what lets decode widen in
    // registers.
    //
    // An int8 cache's K panels of keys [j, j + n) of KV head h (within one block, j % NR == 0)
    // widened to fp32 in the same panel layout, unscaled. Lanes past n get 0.
    static void widen_k(const CacheView &c, int64_t b, int64_t h, int64_t j, int64_t n, int64_t D, float *dst) {
        const int8_t *q = c.k_panels_i8(b, h, j, D);
        for (int64_t p = 0; p * NR < n; ++p) {
            alignas(64) float lane_scale[NR];
            for (int l = 0; l < NR; ++l) lane_scale[l] = p * NR + l < n ? 1.0f : 0.0f;
            V f[NV];
            for (int c = 0; c < NV; ++c) f[c] = V::load_aligned(lane_scale + c * W);
            const int8_t *qp = q + p * NR * D;
            float *dp = dst + p * NR * D;
            for (int64_t d = 0; d < D; ++d) {
                if (d * NR % 64 == 0) __builtin_prefetch(qp + d * NR + kPrefetchI8);
                for (int c = 0; c < NV; ++c)
                    (simd::widen_i8<Arch>(qp + d * NR + c * W) * f[c]).store_unaligned(dp + d * NR + c * W);
            }
        }
    }

    // An int8 cache's V rows of keys [j, j + n) of KV head h (within one block), widened into
    // NR-column panels of depth `depth` from row `row`, unscaled: value (j + t, c) at
    // dst[c / NR * depth * NR + (row + t) * NR + c % NR].
    static void widen_v(const CacheView &c, int64_t b, int64_t h, int64_t j, int64_t n, int64_t Dv, int64_t depth,
                        int64_t row, float *dst) {
        const int8_t *q = c.v_panels_i8(b, h, j);
        for (int64_t p = 0; p * NR < Dv; ++p)
            for (int64_t t = 0; t < n; ++t) {
                const int8_t *qr = q + p * c.v_panel + t * NR;
                float *dr = dst + p * depth * NR + (row + t) * NR;
                for (int l = 0; l < NV; ++l) simd::widen_i8<Arch>(qr + l * W).store_unaligned(dr + l * W);
            }
    }

    // Rows [r0, r1) of x (stride ld), columns [0, n) for keys [j0, j0 + n) of KV head h: times
    // each key's K scale (scores) or V scale (probabilities) of the int8 cache.
    static void scale_keys_i8(const CacheView &c, bool v, int64_t b, int64_t h, int64_t j0, int64_t n, float *x,
                              int64_t r0, int64_t r1, int64_t ld) {
        for (int64_t j = 0, run; j < n; j += run) {
            run = std::min(n - j, c.run(j0 + j));
            const float *sc = v ? c.v_scales(b, h, j0 + j) : c.k_scales(b, h, j0 + j);
            for (int64_t r = r0; r < r1; ++r) {
                float *xr = x + r * ld + j;
                int64_t t = 0;
                for (; t + W <= run; t += W) (V::load_unaligned(xr + t) * V::load_unaligned(sc + t)).store_unaligned(xr + t);
                if (t < run) Tail::store(xr + t, run - t, Tail::load(xr + t, run - t, 0.0f) * Tail::load(sc + t, run - t, 0.0f));
            }
        }
    }

    // Decode's scores from an int8 cache, widening K in registers: rows [0, M) of the packed
    // queries qp (MR-row panels) against the n keys of one block's K panels k8, into s (stride
    // lds), each times its key's scale sc. The same chain as the microkernel on widen_k's
    // panels followed by scale_keys_i8, so the same bits as the packed path.
    // pf: where the next call's K lies (see direct_scores); its lines are asked for at the
    // offsets this call reads, one call ahead. Two panels at a time while R x 2 x NV sums and
    // their operands fit the vector registers: at decode's 4 rows one panel's 8 chains are too
    // few to cover the FMA latency (Zen 5, decode B16 Lk4096 H32/8 D128: 7.0 -> 6.6 ms).
    template <int R>
    static void scores_i8_rows(int64_t n, int64_t D, float scale, const float *qp, const int8_t *k8, const float *sc,
                               float *s, int64_t lds, const int8_t *pf) {
        constexpr int kRegs = W == 16 ? 32 : 16;
        constexpr int P = 2 * R * NV + 2 * NV + 1 <= kRegs ? 2 : 1;
        int64_t p = 0;
        for (; (p + P) * NR <= n; p += P)
            scores_i8_pass<R, P>(NR * P, D, scale, qp, k8 + p * NR * D, pf + p * NR * D, sc + p * NR, s + p * NR, lds);
        for (; p * NR < n; ++p)
            scores_i8_pass<R, 1>(std::min<int64_t>(NR, n - p * NR), D, scale, qp, k8 + p * NR * D, pf + p * NR * D,
                                 sc + p * NR, s + p * NR, lds);
    }
    template <int R, int P>
    static void scores_i8_pass(int64_t m, int64_t D, float scale, const float *qp, const int8_t *kp, const int8_t *kf,
                               const float *sc, float *s, int64_t lds) {
        V acc[R][P][NV];
        for (int r = 0; r < R; ++r)
            for (int q = 0; q < P; ++q)
                for (int c = 0; c < NV; ++c) acc[r][q][c] = V(0.0f);
        for (int64_t d = 0; d < D; ++d) {
            V bv[P][NV];
            for (int q = 0; q < P; ++q) {
                if (d * NR % 64 == 0) __builtin_prefetch(kf + q * NR * D + d * NR);
                for (int c = 0; c < NV; ++c) bv[q][c] = simd::widen_i8<Arch>(kp + q * NR * D + d * NR + c * W);
            }
            for (int r = 0; r < R; ++r) {
                const V a(qp[d * MR + r]);
                for (int q = 0; q < P; ++q)
                    for (int c = 0; c < NV; ++c) acc[r][q][c] = simd::fmadd(a, bv[q][c], acc[r][q][c]);
            }
        }
        for (int q = 0; q < P; ++q)
            for (int c = 0; c < NV && q * NR + c * W < m; ++c) {
                const int64_t o = q * NR + c * W, lanes = std::min<int64_t>(W, m - o);
                const V f = lanes == W ? V::load_unaligned(sc + o) : Tail::load(sc + o, lanes, 0.0f);
                for (int r = 0; r < R; ++r) {
                    const V score = acc[r][q][c] * V(scale) * f;  // (chain x scale) x the key's scale
                    if (lanes == W)
                        score.store_unaligned(s + r * lds + o);
                    else
                        Tail::store(s + r * lds + o, lanes, score);
                }
            }
    }
    template <int R = 1>
    static void scores_i8(int64_t rows, int64_t n, int64_t D, float scale, const float *qp, const int8_t *k8,
                          const float *sc, float *s, int64_t lds, const int8_t *pf) {
        if constexpr (R <= MR) {
            if (rows == R) return scores_i8_rows<R>(n, D, scale, qp, k8, sc, s, lds, pf);
            scores_i8<R + 1>(rows, n, D, scale, qp, k8, sc, s, lds, pf);
        }
    }
};

} // namespace
} // namespace mha::attention_detail
