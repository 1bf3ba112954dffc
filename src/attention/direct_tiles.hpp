// P V for an item with few query rows (decode: one query per head, a GQA group of heads), with V
// read where it lies, no packing. Written once over an xsimd architecture. Include only from an
// ISA's translation unit.
//
// With M rows against a key tile, the packed path packs V (every key, once per item) for an
// MR-row microkernel that runs mostly empty. Here instead the caller walks the tokens so that the
// reads stream (that, more than the arithmetic, is what decode's speed rests on: see kDirectKeys
// in attention_shape.hpp), and
//   S[r, j] = q_r . k_j     query rows across the lanes (Q transposed once per item), k_j's values
//                           broadcast from its row in place, KB keys' sums in registers at once
//   t[r] += P[r, j] v_j     v_j's row read in place, broadcast P, up to 4 rows x 4 vectors of
//                           sums held in registers across the keys
// Every lane computes the GEMM microkernel's ordered FMA chain (over the head dimension for a
// score, over the keys for t), so the bits are those of the packed path, which puts keys across
// the lanes instead. (From the KV cache, whose K is stored as panels, direct items run the
// microkernel itself.)
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include <xsimd/xsimd.hpp>

#include "simd/fmadd.hpp"
#include "simd/widen_i8.hpp"
#include "softmax/partial.hpp"

namespace mha::attention_detail {
namespace {

template <class Arch>
struct DirectTiles {
    using V = xsimd::batch<float, Arch>;
    using Tail = softmax_detail::Partial<Arch>;
    static constexpr int W = static_cast<int>(V::size);
    // How far ahead block() asks for fp32 V rows: decode streams V from memory and the hardware
    // prefetchers fall behind (Zen 5, decode B16 Lk4096 H32/8 D128 from an fp32 cache: 26.6 -> 24.0
    // ms). int8 rows are asked for one call ahead instead (the caller says where that call reads).
    static constexpr int64_t kPrefetchKeys = 32;

    // s[r * lds + j] = (sum_d qt[d * ldqt + r] * k[j * ldk + d]) * scale for r < M <= 2 W, j < n,
    // the head dimension in order. qt is Q transposed, its rows padded to a whole vector (ldqt).
    static void scores(int64_t M, int64_t n, int64_t D, float scale, const float *qt, int64_t ldqt, const float *k,
                       int64_t ldk, float *s, int64_t lds) {
        if (M <= W)
            scores_keys<1, 8>(M, n, D, scale, qt, ldqt, k, ldk, s, lds);
        else
            scores_keys<2, 4>(M, n, D, scale, qt, ldqt, k, ldk, s, lds);
    }

    // Q^T for scores(): qt[d * ldqt + r] = q[r * D + d], rows M..ldqt zero.
    static void transpose_q(int64_t M, int64_t D, const float *q, float *qt, int64_t ldqt) {
        for (int64_t d = 0; d < D; ++d)
            for (int64_t r = 0; r < ldqt; ++r) qt[d * ldqt + r] = r < M ? q[r * D + d] : 0.0f;
    }

    // Where V's values lie: value (j, c) at v[j * ld + c / width * panel + c % width]. Rows of a
    // dense tensor: {ldv, W, W}; the cache's NR-column panels: {NR, NR, panel floats}. A vector
    // never straddles two panels (W divides width).
    struct Columns {
        int64_t ld, width, panel;
        template <class T>
        const T *at(const T *v, int64_t c) const { return v + c / width * panel + c % width; }
    };

    // acc[r * Dv + c] += sum_j p[r * ldp + j] * V(j, c) for r < M, j < n, c < Dv, the keys in order.
    // V is fp32, or an int8 cache's stored integers (T = int8_t), widened in registers. A tile's
    // sums run over several calls: the first starts them from zero (`fresh`: acc is not read), the
    // last adds them to `into` (same layout as acc; acc is then not written) instead.
    // For int8 V, pf is where the next call's V (or K) lies: its lines are asked for at the
    // offsets this call reads (one call ahead, across the jumps the hardware cannot follow).
    template <class T>
    static void accumulate(int64_t M, int64_t n, int64_t Dv, const float *p, int64_t ldp, const T *v,
                           const Columns &vc, float *acc, bool fresh, float *into, const T *pf = nullptr) {
        constexpr int64_t kRows = 4, kVecs = 4;
        for (int64_t r0 = 0; r0 < M; r0 += kRows)
            for (int64_t c0 = 0; c0 < Dv; c0 += kVecs * W) {
                const int64_t rows = std::min(kRows, M - r0), cols = std::min(kVecs * W, Dv - c0);
                const int vecs = static_cast<int>((cols + W - 1) / W);
                const float *pr = p + r0 * ldp;
                float *ar = acc + r0 * Dv + c0, *ir = into ? into + r0 * Dv + c0 : nullptr;
                const int64_t tail = cols - (vecs - 1) * W;  // lanes of the last vector
                switch (rows * 8 + vecs) {
#define MHA_DIRECT_BLOCK(R, C)                                                   \
    case R * 8 + C:                                                              \
        if (tail == W)                                                           \
            block<R, C, false, T>(n, pr, ldp, v, vc, c0, ar, fresh, ir, Dv, tail, pf); \
        else                                                                         \
            block<R, C, true, T>(n, pr, ldp, v, vc, c0, ar, fresh, ir, Dv, tail, pf);  \
        break;
                    MHA_DIRECT_BLOCK(1, 1) MHA_DIRECT_BLOCK(1, 2) MHA_DIRECT_BLOCK(1, 3) MHA_DIRECT_BLOCK(1, 4)
                    MHA_DIRECT_BLOCK(2, 1) MHA_DIRECT_BLOCK(2, 2) MHA_DIRECT_BLOCK(2, 3) MHA_DIRECT_BLOCK(2, 4)
                    MHA_DIRECT_BLOCK(3, 1) MHA_DIRECT_BLOCK(3, 2) MHA_DIRECT_BLOCK(3, 3) MHA_DIRECT_BLOCK(3, 4)
                    MHA_DIRECT_BLOCK(4, 1) MHA_DIRECT_BLOCK(4, 2) MHA_DIRECT_BLOCK(4, 3) MHA_DIRECT_BLOCK(4, 4)
#undef MHA_DIRECT_BLOCK
                }
            }
    }

private:
    // R vectors of rows x KB keys of sums in registers; past the tile's end the last key repeats
    // (its sums are not stored).
    template <int R, int KB>
    static void scores_keys(int64_t M, int64_t n, int64_t D, float scale, const float *qt, int64_t ldqt,
                            const float *k, int64_t ldk, float *s, int64_t lds) {
        alignas(64) float lanes[KB][R * W];
        for (int64_t j = 0; j < n; j += KB) {
            const int64_t nk = std::min<int64_t>(KB, n - j);
            const float *rows[KB];
            for (int t = 0; t < KB; ++t) rows[t] = k + (j + std::min<int64_t>(t, nk - 1)) * ldk;
            V acc[R][KB];
            for (int r = 0; r < R; ++r)
                for (int t = 0; t < KB; ++t) acc[r][t] = V(0.0f);
            for (int64_t d = 0; d < D; ++d) {
                V q[R];
                for (int r = 0; r < R; ++r) q[r] = V::load_aligned(qt + d * ldqt + r * W);
                for (int t = 0; t < KB; ++t) {
                    const V kv(rows[t][d]);
                    for (int r = 0; r < R; ++r) acc[r][t] = simd::fmadd(q[r], kv, acc[r][t]);
                }
            }
            for (int t = 0; t < KB; ++t)
                for (int r = 0; r < R; ++r) acc[r][t].store_aligned(lanes[t] + r * W);
            // Scaled here, one score at a time (the same product as the microkernel's alpha): a
            // vector multiply before the lanes' store made decode 2.5% slower (Zen 5, B4 Lk4096).
            for (int64_t r = 0; r < M; ++r)
                for (int64_t t = 0; t < nk; ++t) s[r * lds + j + t] = lanes[t][r] * scale;
        }
    }

    // R rows x C vectors of acc (row stride lda) from column c0, the last vector `tail` lanes wide
    // (Partial: tail < W), held in registers while the n keys go by. Full-width blocks have no
    // tail test in the key loop: with one there GCC kept every accumulator's copy in memory
    // up to date on each key (16 stores per key at 4 x 4; measured 2x slower decode on Zen 5).
    template <int R, int C, bool Partial, class T>
    static void block(int64_t n, const float *p, int64_t ldp, const T *v, const Columns &vc, int64_t c0,
                      float *acc, bool fresh, float *into, int64_t lda, int64_t tail, const T *pf) {
        auto load = [&](const float *x, int c) {
            if constexpr (Partial)
                if (c == C - 1) return Tail::load(x, tail, 0.0f);
            return V::load_unaligned(x);
        };
        // int8 rows lie in the cache's whole NR-wide panels: a full vector is always there to
        // read, and lanes past the tail are never stored.
        auto load_v = [&](const T *x, int c) {
            if constexpr (std::is_same_v<T, int8_t>)
                return simd::widen_i8<Arch>(x);
            else
                return load(x, c);
        };
        const int64_t ldv = vc.ld;
        const T *vcol[C];
        // int8: the columns that start a panel's row, whose lines are asked for (one call ahead).
        const T *fcol[C];
        int nf = 0;
        for (int c = 0; c < C; ++c) {
            vcol[c] = vc.at(v, c0 + c * W);
            if ((c0 + c * W) % vc.width == 0) fcol[nf++] = vc.at(pf ? pf : v, c0 + c * W);
        }
        const float *prow[R];
        for (int r = 0; r < R; ++r) prow[r] = p + r * ldp;
        V a[R][C];
        for (int r = 0; r < R; ++r)
            for (int c = 0; c < C; ++c) a[r][c] = fresh ? V(0.0f) : load(acc + r * lda + c * W, c);
        for (int64_t j = 0; j < n; ++j) {
            V vj[C];
            // V streams from memory in decode; the hardware prefetchers fall behind (Zen 5).
            if constexpr (std::is_same_v<T, int8_t>) {
                // A token's int8 row of a panel is part of a line: each line once, from the
                // vectors that start a panel's row.
                if (static_cast<uint64_t>(j * ldv) % 64 < static_cast<uint64_t>(ldv))
                    for (int c = 0; c < nf; ++c) __builtin_prefetch(fcol[c] + j * ldv);
            } else {
                for (int c = 0; c < C; ++c) __builtin_prefetch(vcol[c] + (j + kPrefetchKeys) * ldv);
            }
            for (int c = 0; c < C; ++c) vj[c] = load_v(vcol[c] + j * ldv, c);
            for (int r = 0; r < R; ++r) {
                const V pj(prow[r][j]);
                for (int c = 0; c < C; ++c) a[r][c] = simd::fmadd(pj, vj[c], a[r][c]);
            }
        }
        float *dst = into ? into : acc;
        for (int r = 0; r < R; ++r)
            for (int c = 0; c < C; ++c) {
                if (into) a[r][c] = load(into + r * lda + c * W, c) + a[r][c];
                if (Partial && c == C - 1)
                    Tail::store(dst + r * lda + c * W, tail, a[r][c]);
                else
                    a[r][c].store_unaligned(dst + r * lda + c * W);
            }
    }
};

} // namespace
} // namespace mha::attention_detail
