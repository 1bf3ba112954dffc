// The softmax kernels, written once over an xsimd architecture and instantiated per ISA
// (kernels_<isa>.cpp). Built from three small primitives, as XNNPACK builds its softmax: the row
// max, exp(x - max) with a running sum and a store, and a scale.
//
// AVX-512 takes the exps in base 2, as FlashAttention-2 does: exp(x - max) = 2^(x log2e - max
// log2e), with max log2e rounded once (base2()) and x log2e - max log2e one FMA, which
// vexp2_nonpositive takes without a range reduction of its own. The rounding of max log2e scales
// a row's every entry and its sum alike, so it cancels in the division; the online fold and the
// chunk merges rescale by 2^(base2(m_old) - base2(m_new)), so it cancels across blocks too.
// Zen 5, 1 thread, against exp(x - max): softmax 1.02-1.03x at 1024 x 128, 1.09x at 8 x 32768.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "softmax/partial.hpp"
#include "softmax/vexp.hpp"

namespace mha::softmax_detail {
namespace {

template <class Arch>
struct RowKernels {
    using V = xsimd::batch<float, Arch>;
    using P = Partial<Arch>;
    static constexpr int64_t W = static_cast<int64_t>(V::size);
    static constexpr float kNegInf = -std::numeric_limits<float>::infinity();

    static float reduce_max(const V &v) {
#if defined(__AVX512F__)
        if constexpr (std::is_same_v<Arch, xsimd::avx512f>) return _mm512_reduce_max_ps(v);
#endif
        alignas(64) float lanes[W];
        v.store_aligned(lanes);
        float m = lanes[0];
        for (int64_t i = 1; i < W; ++i) m = lanes[i] > m ? lanes[i] : m;
        return m;
    }

    // The largest of x[0:n] (-inf for n == 0). A NaN may or may not survive the reduction; the
    // callers catch NaN through the sum instead (see row()).
    static float row_max(const float *x, int64_t n) { return reduce_max(row_max_lanes(x, n)); }

    // row_max before its horizontal step: a vector whose lanes' largest is the row's (all -inf
    // for n == 0). Each load is the second operand of its max, so it folds into the instruction.
    static V row_max_lanes(const float *x, int64_t n) {
        V m0(kNegInf), m1(kNegInf), m2(kNegInf), m3(kNegInf);
        int64_t i = 0;
        for (; i + 4 * W <= n; i += 4 * W) {
            m0 = xsimd::max(m0, V::load_unaligned(x + i));
            m1 = xsimd::max(m1, V::load_unaligned(x + i + W));
            m2 = xsimd::max(m2, V::load_unaligned(x + i + 2 * W));
            m3 = xsimd::max(m3, V::load_unaligned(x + i + 3 * W));
        }
        for (; i + W <= n; i += W) m0 = xsimd::max(m0, V::load_unaligned(x + i));
        if (i < n) m1 = xsimd::max(m1, P::load(x + i, n - i, kNegInf));
        return xsimd::max(xsimd::max(m0, m1), xsimd::max(m2, m3));
    }

    static bool has_nan(const float *x, int64_t n) {
        for (int64_t i = 0; i < n; ++i)
            if (std::isnan(x[i])) return true;
        return false;
    }

    // Rows whose max is at least this large in magnitude take exp(x - max) as such
    // (vexp_nonpositive): there max log2e would round by 1/16 or more (and overflow past 2.4e38),
    // and 2^(that rounding) scaling the whole row could leave float's range.
    static constexpr float kBase2Limit = 0x1p20f;
    // Base 2 on AVX-512 only: without vreduceps and vscalefps (AVX2) its exp takes as many
    // operations as exp(x - max) does, and timed slower (Zen 5, 512 x 512: 0.94x).
    static constexpr bool kBase2 = std::is_same_v<Arch, xsimd::avx512f>;
    static bool in_base2(float max) { return kBase2 && std::fabs(max) < kBase2Limit; }  // false for +-inf, NaN

    // What a row's exps with max m are relative to, in base 2 (each is 2^(x log2e - ref(m))).
    static double ref(float m) { return in_base2(m) ? base2(m) : static_cast<double>(m) * kLog2e; }

    // The factor that takes exps and sums relative to max m_old to m_new >= m_old (or -inf, NaN):
    // 2^(ref(m_old) - ref(m_new)), 0 for m_old = -inf. The online fold's and the chunk merges'.
    static float rescale(float m_old, float m_new) {
        return static_cast<float>(std::exp2(ref(m_old) - ref(m_new)));
    }

    // exp(x - m) taken as a row with max m takes its exps, 2^(x log2e - ref(m)), for one more term
    // of its sum (the attention's sinks).
    static float exp_against(float x, float m) {
        return static_cast<float>(std::exp2(static_cast<double>(x) * kLog2e - ref(m)));
    }

    // max log2e, rounded: the base-2 max every exp of a row with this max is taken against. The
    // rounding must happen here: contracted into an FMA, base2(m_old) - base2(m_new) would no
    // longer cancel it (the rescale would be off by up to an ulp of m log2e, 6e-7 at m = 30).
    static float base2(float max) {
        float r = max * kLog2e;
        asm("" : "+x"(r));
        return r;
    }

    // y[i] = exp(x[i] - max) for i < n (on AVX-512 2^(x[i] log2e - base2(max)), see the top);
    // returns their sum. Vector v of the row (x[v W : v W + W]) always goes into accumulator v % 4,
    // and the four are combined in one fixed order, so entries that add 0 (exp(-inf)) past the end
    // of a row never change its sum: a row gives the same bits whatever n its caller covers beyond
    // the row's last finite score. x == y is allowed.
    static float exp_store_sum(const float *x, int64_t n, float max, float *y) {
        return xsimd::hadd(exp_store_partial(x, n, max, y));
    }

    // exp_store_sum before its last step: the row's sum as one vector, whose lanes xsimd::hadd
    // adds up (hadd_rows does that for many rows at once, in the same order).
    static V exp_store_partial(const float *x, int64_t n, float max, float *y) {
        if constexpr (kBase2)
            if (in_base2(max)) return exp_store_base2(x, n, -base2(max), y);
        const V vm(max);  // AVX2, or a huge max (see kBase2Limit): exp(x - max) as such
        return exp_store_loop(x, n, y, [&](const V &v) { return vexp_nonpositive<Arch>(v - vm); });
    }

    // exp_store_partial of a row with in_base2(max), given neg_ref = -base2(max) (AVX-512 only).
    static V exp_store_base2(const float *x, int64_t n, float neg_ref, float *y) {
        static_assert(kBase2, "base 2 is AVX-512's");
        const V vl(kLog2e), vm(neg_ref);
        return exp_store_loop(x, n, y, [&](const V &v) { return vexp2_nonpositive<Arch>(simd::fmadd(v, vl, vm)); });
    }

    // exp_store_partial's loop, for either exp.
    template <class Exp>
    static V exp_store_loop(const float *x, int64_t n, float *y, const Exp &exp) {
        V s[4] = {V(0.0f), V(0.0f), V(0.0f), V(0.0f)};
        int64_t i = 0;
        for (; i + 4 * W <= n; i += 4 * W) {
            const V e0 = exp(V::load_unaligned(x + i));
            const V e1 = exp(V::load_unaligned(x + i + W));
            const V e2 = exp(V::load_unaligned(x + i + 2 * W));
            const V e3 = exp(V::load_unaligned(x + i + 3 * W));
            e0.store_unaligned(y + i);
            e1.store_unaligned(y + i + W);
            e2.store_unaligned(y + i + 2 * W);
            e3.store_unaligned(y + i + 3 * W);
            s[0] += e0;
            s[1] += e1;
            s[2] += e2;
            s[3] += e3;
        }
        // The last n mod 4W into s[0], s[1], ... in turn, each named by a constant: an index that
        // varies at run time would keep all four sums on the stack, the loop above included.
        auto tail = [&](V &sum) {
            if (i >= n) return;
            const int64_t left = n - i;
            const V e = exp(left >= W ? V::load_unaligned(x + i) : P::load(x + i, left, kNegInf));  // padding: exp(-inf) = 0
            if (left >= W)
                e.store_unaligned(y + i);
            else
                P::store(y + i, left, e);
            sum += e;
            i += W;
        };
        tail(s[0]);
        tail(s[1]);
        tail(s[2]);
        tail(s[3]);
        return (s[0] + s[1]) + (s[2] + s[3]);
    }

    // Lane r of the result: xsimd::hadd(v[r]) for r < n <= W, bit for bit (lanes past n: 0). On
    // AVX-512 sixteen rows at a time through the same pairings and operand order (the upper half
    // onto the lower, then lanes i and i + 4, then neighbours and the last two with the odd lane
    // first, as haddps adds them), each step adding two rows' lanes in one vector instead of one
    // row's in a chain of dependent shuffles (the per-row reductions were a sixth of the fold's
    // samples at L512 D64). The order shows in the bits only through NaN: x86 returns the first
    // operand's NaN. v[n..W) are not read.
    // AVX2 eight rows at a time the same way, in xsimd's order for AVX (lanes i and i + 4, then
    // neighbours, then the two pairs, each the first operand of its haddps).
    static V hadd_rows(const V *v, int64_t n) {
#if defined(__AVX512F__)
        if constexpr (std::is_same_v<Arch, xsimd::avx512f>)
            return reduce_rows(v, n, 0.0f, [](__m512 a, __m512 b) { return _mm512_add_ps(a, b); });
        else
#endif
            return reduce_rows8(v, n, 0.0f, [](__m256 a, __m256 b) { return _mm256_add_ps(a, b); });
    }

    // Lane r of the result: the largest lane of v[r] for r < n <= W (lanes past n: -inf). A NaN
    // lane may or may not survive, as in row_max.
    static V max_rows(const V *v, int64_t n) {
#if defined(__AVX512F__)
        if constexpr (std::is_same_v<Arch, xsimd::avx512f>)
            return reduce_rows(v, n, kNegInf, [](__m512 a, __m512 b) { return _mm512_max_ps(a, b); });
        else
#endif
            return reduce_rows8(v, n, kNegInf, [](__m256 a, __m256 b) { return _mm256_max_ps(a, b); });
    }

    // hadd_rows' network for eight rows of AVX2 vectors (rows past n count as `pad`).
    template <class Op>
    static V reduce_rows8(const V *v, int64_t n, float pad, const Op &op) {
        __m256 r[8];
        for (int i = 0; i < 8; ++i) r[i] = i < n ? static_cast<__m256>(v[i]) : _mm256_set1_ps(pad);
        __m256 a[4], b[2];
        for (int k = 0; k < 4; ++k)  // y_i = x_i + x_{i+4}: rows 2k (lanes 0-3), 2k+1 (4-7)
            a[k] = op(_mm256_permute2f128_ps(r[2 * k], r[2 * k + 1], 0x20), _mm256_permute2f128_ps(r[2 * k], r[2 * k + 1], 0x31));
        for (int k = 0; k < 2; ++k)  // y_0 + y_1, y_2 + y_3: rows 4k, 4k + 2 (low half), 4k + 1, 4k + 3
            b[k] = op(_mm256_shuffle_ps(a[2 * k], a[2 * k + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                      _mm256_shuffle_ps(a[2 * k], a[2 * k + 1], _MM_SHUFFLE(3, 1, 3, 1)));
        // the two pairs: lanes rows 0, 2, 4, 6, 1, 3, 5, 7, which the permutation puts in order
        const __m256 sum = op(_mm256_shuffle_ps(b[0], b[1], _MM_SHUFFLE(2, 0, 2, 0)),
                              _mm256_shuffle_ps(b[0], b[1], _MM_SHUFFLE(3, 1, 3, 1)));
        return _mm256_permutevar8x32_ps(sum, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    }

#if defined(__AVX512F__)
    // hadd_rows' reduction network with the operation op (rows past n count as `pad`).
    template <class Op>
    static V reduce_rows(const V *v, int64_t n, float pad, const Op &op) {
        __m512 r[16];
        for (int i = 0; i < 16; ++i) r[i] = i < n ? static_cast<__m512>(v[i]) : _mm512_set1_ps(pad);
        __m512 a[8], b[4], c[2];
        for (int k = 0; k < 8; ++k)  // y_i = x_{8+i} + x_i: rows 2k (lanes 0-7), 2k+1 (8-15)
            a[k] = op(_mm512_shuffle_f32x4(r[2 * k], r[2 * k + 1], _MM_SHUFFLE(3, 2, 3, 2)),
                      _mm512_shuffle_f32x4(r[2 * k], r[2 * k + 1], _MM_SHUFFLE(1, 0, 1, 0)));
        for (int k = 0; k < 4; ++k)  // t_i = y_i + y_{i+4}: quarter q = row 4k + q
            b[k] = op(_mm512_shuffle_f32x4(a[2 * k], a[2 * k + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                      _mm512_shuffle_f32x4(a[2 * k], a[2 * k + 1], _MM_SHUFFLE(3, 1, 3, 1)));
        for (int k = 0; k < 2; ++k)  // c_j = t_2j+1 + t_2j: quarter q = rows 8k + q, 8k + 4 + q
            c[k] = op(_mm512_shuffle_ps(b[2 * k], b[2 * k + 1], _MM_SHUFFLE(3, 1, 3, 1)),
                      _mm512_shuffle_ps(b[2 * k], b[2 * k + 1], _MM_SHUFFLE(2, 0, 2, 0)));
        // c_1 + c_0: lane 4q + p is row 4p + q, which the permutation puts in lane 4p + q
        const __m512 sum = op(_mm512_shuffle_ps(c[0], c[1], _MM_SHUFFLE(3, 1, 3, 1)),
                              _mm512_shuffle_ps(c[0], c[1], _MM_SHUFFLE(2, 0, 2, 0)));
        return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), sum);
    }
#endif

    // y[0:n] = x[0:n] * s; x == y is allowed.
    static void scale_to(const float *x, int64_t n, float s, float *y) {
        const V vs(s);
        int64_t i = 0;
        for (; i + W <= n; i += W) (V::load_unaligned(x + i) * vs).store_unaligned(y + i);
        if (i < n) P::store(y + i, n - i, P::load(x + i, n - i, 0.0f) * vs);
    }

    // y[0:n] += x[0:n]
    static void add(const float *x, int64_t n, float *y) {
        int64_t i = 0;
        for (; i + W <= n; i += W) (V::load_unaligned(y + i) + V::load_unaligned(x + i)).store_unaligned(y + i);
        if (i < n) P::store(y + i, n - i, P::load(y + i, n - i, 0.0f) + P::load(x + i, n - i, 0.0f));
    }

    // y[0:n] *= s
    static void scale(float *y, int64_t n, float s) { scale_to(y, n, s, y); }

    static void fill(float *y, int64_t n, float v) {
        int64_t i = 0;
        for (; i + W <= n; i += W) V(v).store_unaligned(y + i);
        if (i < n) P::store(y + i, n - i, V(v));
    }

    // One row of softmax; see mha/softmax.hpp for the semantics of -inf, NaN and empty rows.
    // A NaN x makes exp(x - max) NaN, so the sum and then every output of the row become NaN;
    // only a row whose max came out -inf needs an explicit look for NaN.
    static void row(const float *x, int64_t n, float *y) {
        const float m = row_max(x, n);
        if (m == kNegInf) return fill(y, n, has_nan(x, n) ? std::numeric_limits<float>::quiet_NaN() : 0.0f);
        const float sum = exp_store_sum(x, n, m, y);
        scale(y, n, 1.0f / sum);
    }

    static void rows(int64_t rows, int64_t cols, const float *x, int64_t ldx, float *y, int64_t ldy) {
        for (int64_t r = 0; r < rows; ++r) row(x + r * ldx, cols, y + r * ldy);
    }

    // The online softmax step (Milakov & Gimelshein 2018, as used by FlashAttention): folds a
    // block of scores into the running max m and sum l of each row, turns the block into
    // P = exp(s - m_new) in place, and rescales the row's accumulated output by exp(m_old - m_new),
    // both in base 2 (see the top): the rescale is 2^(base2(m_old) - base2(m_new)).
    // W rows at a time, their maxima, factors and sums in one vector each: the row-by-row scalar
    // bookkeeping was a quarter of the fold at 128 keys a row (Xeon, 13 x 128: 407 -> 302 ns).
    // Every row's bits are its own, whatever the other rows of the block hold (a row with a NaN
    // comes out NaN, its max a NaN or a number: row_max's NaN may or may not survive, and a row of
    // only -inf and NaN gets m = NaN).
    static void online_fold(int64_t rows, int64_t cols, float *s, int64_t lds, float *m, float *l, float *acc,
                            int64_t ldacc, int64_t acc_cols) {
        const V neg_inf(kNegInf);
        for (int64_t r0 = 0; r0 < rows; r0 += W) {
            const int64_t nr = rows - r0 < W ? rows - r0 : W;
            const unsigned live = (1u << nr) - 1u;
            V vb;
            {
                V lanes[W];
                for (int64_t i = 0; i < nr; ++i) lanes[i] = row_max_lanes(s + (r0 + i) * lds, cols);
                vb = max_rows(lanes, nr);
            }
            if (const unsigned empty = P::bits(vb == neg_inf) & live) {  // only -inf and NaN: NaN if it has one
                alignas(64) float bm[W];
                vb.store_aligned(bm);
                for (int64_t i = 0; i < nr; ++i)
                    if ((empty >> i & 1) && has_nan(s + (r0 + i) * lds, cols)) bm[i] = std::numeric_limits<float>::quiet_NaN();
                vb = V::load_aligned(bm);
            }
            const V mo = P::load(m + r0, nr, kNegInf);
            const V mn = xsimd::select(xsimd::isnan(vb) || xsimd::isnan(mo), vb + mo, xsimd::select(vb > mo, vb, mo));
            // Nothing visible yet (m_new = -inf): P = 0, the state stays.
            const auto seen = !(mn == neg_inf);  // (xsimd's != is false for NaN)
            const unsigned seen_bits = P::bits(seen) & live;
            alignas(64) float m_new[W], alpha[W], neg_ref[W];
            mn.store_aligned(m_new);
            unsigned ref2 = 0;  // the rows whose exps are 2^(x log2e - base2(m_new)), as in exp_store_partial
            V a;
            if constexpr (kBase2) {
                const V b_new = base2(mn), lim(kBase2Limit);
                a = vexp2_nonpositive<Arch>(xsimd::select(seen, base2(mo) - b_new, V(0.0f)));  // 0 where m was -inf
                a.store_aligned(alpha);
                ref2 = P::bits(xsimd::abs(mn) < lim);  // in_base2, lane by lane
                // Rows with a huge max (rare) take their factors one by one, and only they: a
                // row's bits never depend on the other rows of its block.
                if (unsigned huge = seen_bits & ~(ref2 & P::bits(xsimd::abs(mo) < lim || mo == neg_inf))) {
                    for (; huge; huge &= huge - 1) {
                        const int i = __builtin_ctz(huge);
                        alpha[i] = rescale(m[r0 + i], m_new[i]);
                    }
                    a = V::load_aligned(alpha);
                }
                (-b_new).store_aligned(neg_ref);
            } else {
                a = vexp_nonpositive<Arch>(xsimd::select(seen, mo - mn, V(0.0f)));
                a.store_aligned(alpha);
            }
            V part[W];
            for (int64_t i = 0; i < nr; ++i) {
                float *sr = s + (r0 + i) * lds;
                if (!(seen_bits >> i & 1)) {
                    fill(sr, cols, 0.0f);
                    part[i] = V(0.0f);
                    continue;
                }
                if constexpr (kBase2)
                    if (ref2 >> i & 1) {  // exp_store_partial, its reference at hand
                        part[i] = exp_store_base2(sr, cols, neg_ref[i], sr);
                        continue;
                    }
                part[i] = exp_store_partial(sr, cols, m_new[i], sr);
            }
            const V lo = P::load(l + r0, nr, 0.0f);
            P::store(l + r0, nr, xsimd::select(seen, simd::fmadd(lo, a, hadd_rows(part, nr)), lo));
            P::store(m + r0, nr, xsimd::select(seen, mn, mo));
            // Before any visible score (m = -inf) acc holds only +-0 or NaN (P was all zeros),
            // which times alpha = 0 stay as they are: the pass would change no bit.
            for (unsigned r = seen_bits & P::bits(!(a == V(1.0f)) && !(mo == neg_inf)); r; r &= r - 1) {
                const int i = __builtin_ctz(r);
                scale(acc + (r0 + i) * ldacc, acc_cols, alpha[i]);
            }
        }
    }

    // base2() lane by lane, each product rounded on its own (see base2).
    static V base2(const V &max) {
        auto r = static_cast<typename V::register_type>(max * V(kLog2e));
        asm("" : "+x"(r));
        return V(r);
    }

    // acc[r, :] /= l[r]; a row that never saw a visible score (l == 0) becomes zeros.
    static void online_finish(int64_t rows, const float *l, float *acc, int64_t ldacc, int64_t acc_cols) {
        for (int64_t r = 0; r < rows; ++r) online_finish_row(l[r], acc + r * ldacc, acc_cols, acc + r * ldacc);
    }

    // One row of online_finish, written to y (y == acc is allowed).
    static void online_finish_row(float l, const float *acc, int64_t acc_cols, float *y) {
        if (l == 0.0f)
            fill(y, acc_cols, 0.0f);
        else
            scale_to(acc, acc_cols, 1.0f / l, y);
    }

    static void exp(int64_t n, const float *x, float *y) {
        int64_t i = 0;
        for (; i + W <= n; i += W) vexp<Arch>(V::load_unaligned(x + i)).store_unaligned(y + i);
        if (i < n) P::store(y + i, n - i, vexp<Arch>(P::load(x + i, n - i, 0.0f)));
    }

    static void exp_nonpositive(int64_t n, const float *x, float *y) {
        int64_t i = 0;
        for (; i + W <= n; i += W) vexp_nonpositive<Arch>(V::load_unaligned(x + i)).store_unaligned(y + i);
        if (i < n) P::store(y + i, n - i, vexp_nonpositive<Arch>(P::load(x + i, n - i, 0.0f)));
    }

    // (Not in AVX2's table: vexp2_nonpositive is AVX-512 only.)
    static void exp2_nonpositive(int64_t n, const float *x, float *y) {
        if constexpr (kBase2) {
            int64_t i = 0;
            for (; i + W <= n; i += W) vexp2_nonpositive<Arch>(V::load_unaligned(x + i)).store_unaligned(y + i);
            if (i < n) P::store(y + i, n - i, vexp2_nonpositive<Arch>(P::load(x + i, n - i, 0.0f)));
        }
    }
};

} // namespace
} // namespace mha::softmax_detail
