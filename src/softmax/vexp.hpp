// exp(x) on SIMD registers, written once over an xsimd architecture, with an AVX-512 path that
// uses vscalefps. Include only from an ISA's translation unit.
//
// exp(x) = 2^n * e^t with n = round(x / ln2) and t = x - n ln2 in [-ln2/2, ln2/2], then e^t by a
// degree-5 polynomial. This is the "rr1-p5" scheme of XNNPACK's exp kernels (one-constant range
// reduction: for the |n| <= 126 that matter, the rounding of ln2 to float costs under 3e-7
// relative); the coefficients are our own minimax fit (tests/data/fit_exp_poly.py), relative
// error under 1e-7 on the reduced range.
//
// Results below FLT_MIN (x < -87.3365) are exactly 0, as is exp(-inf); NaN stays NaN; x above
// 88.72 gives +inf.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <type_traits>

#include <xsimd/xsimd.hpp>

#include "simd/fmadd.hpp"

namespace mha::softmax_detail {
namespace {

constexpr float kLog2e = 1.44269504f;
constexpr float kMinusLn2 = -0.693147182f;
constexpr float kExpCutoff = -87.33654f;  // ln(FLT_MIN)
// 1.5 * 2^23 + 127: added to x in [-126.5, 0.5), leaves round(x) + 127 in the low mantissa bits.
constexpr float kBias127 = 0x1.8000FEp23f;

// 1 + t (c1 + t (c2 + t (c3 + t (c4 + t c5)))) by Horner's rule.
template <class V>
inline V poly5(const V &t, float c1, float c2, float c3, float c4, float c5) {
    V p = simd::fmadd(V(c5), t, V(c4));
    p = simd::fmadd(p, t, V(c3));
    p = simd::fmadd(p, t, V(c2));
    p = simd::fmadd(p, t, V(c1));
    return simd::fmadd(p, t, V(1.0f));
}

// e^t for t in [-ln2/2, ln2/2].
template <class V>
inline V exp_poly(const V &t) {
    return poly5(t, 0x1.fffff6p-1f, 0x1.fffdc6p-2f, 0x1.555a6ap-3f, 0x1.573a54p-5f, 0x1.0fa834p-7f);
}

template <class Arch>
inline xsimd::batch<float, Arch> vexp(const xsimd::batch<float, Arch> &x) {
    using V = xsimd::batch<float, Arch>;
#if defined(__AVX512F__)
    if constexpr (std::is_same_v<Arch, xsimd::avx512f>) {
        // n and t stay finite for every x above the cutoff; vscalefps builds 2^n * p without
        // integer work, and the zero-masking does the cutoff (NaN compares "not less", so it passes).
        // round(x log2e) by the "magic bias": adding 1.5 * 2^23 leaves the rounded integer in the
        // low mantissa bits; subtracting it again gives n as a float (cheaper than vrndscaleps).
        const __m512 magic = _mm512_set1_ps(0x1.8p23f);
        const __m512 n = _mm512_sub_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(kLog2e), magic), magic);
        const V t = simd::fmadd(V(n), V(kMinusLn2), x);
        const __mmask16 keep = _mm512_cmp_ps_mask(x, _mm512_set1_ps(kExpCutoff), _CMP_NLT_UQ);
        return _mm512_maskz_scalef_ps(keep, exp_poly(t), n);
    }
#endif
    using I = xsimd::batch<int32_t, Arch>;
    // max(lo, x) and min(hi, .) keep a NaN x as NaN: the x86 min/max return their second operand
    // when either is NaN. hi keeps 2^n within the exponent field (n <= 128 is +inf).
    const V xc = xsimd::min(V(88.7228394f), xsimd::max(V(kExpCutoff), x));
    const V n = xsimd::nearbyint(xc * V(kLog2e));
    const V t = simd::fmadd(n, V(kMinusLn2), xc);
    const V scale = xsimd::bitwise_cast<V>((xsimd::to_int(n) + I(127)) << 23);
    return xsimd::select(x < V(kExpCutoff), V(0.0f), exp_poly(t) * scale);
}

// exp(x) for x <= 0, -inf or NaN: soft-capping's tanh (e^-2|x|), and AVX2's softmax (x - max)
// and online fold (m_old - m_new); AVX-512's work in base 2 (vexp2_nonpositive). The same as vexp
// on AVX-512; without vscalefps there is no overflow to guard here, so 2^n comes straight from the
// rounding's bits, 13 vector operations instead of 16 (a magic bias of 1.5 * 2^23 + 127 leaves
// n + 127 in the low mantissa bits, which a shift moves into the exponent field: n + 127 is in
// [1, 127] for x in [cutoff, 0]). Same accuracy as vexp; x < cutoff (-inf too) gives exactly 0,
// NaN stays NaN (max returns its second operand on NaN).
template <class Arch>
inline xsimd::batch<float, Arch> vexp_nonpositive(const xsimd::batch<float, Arch> &x) {
    using V = xsimd::batch<float, Arch>;
#if defined(__AVX512F__)
    if constexpr (std::is_same_v<Arch, xsimd::avx512f>) return vexp<Arch>(x);
#endif
    using I = xsimd::batch<int32_t, Arch>;
    const V xc = xsimd::max(V(kExpCutoff), x);
    const V nb = simd::fmadd(xc, V(kLog2e), V(kBias127));
    const V two_n = xsimd::bitwise_cast<V>(xsimd::bitwise_cast<I>(nb) << 23);
    const V t = simd::fmadd(nb - V(kBias127), V(kMinusLn2), xc);
    return xsimd::select(x < V(kExpCutoff), V(0.0f), exp_poly(t) * two_n);
}

// 2^t for t in [0, 1).
template <class V>
inline V exp2_poly(const V &t) {
    return poly5(t, 0x1.62e4bap-1f, 0x1.ebdb56p-3f, 0x1.c91ce6p-5f, 0x1.277854p-7f, 0x1.e974fep-10f);
}

constexpr float kExp2Cutoff = -126.0f;

// 2^x for x <= 0, -inf or NaN, on AVX-512: the exp of its softmax and online fold, which work in
// base 2 (see RowKernels::kBase2: x = s log2e - m log2e in one FMA, which absorbs the subtraction
// of the max). 2^x = 2^floor(x) 2^t with t = x - floor(x) in [0, 1) from vreduceps, 2^t by a
// degree-5 minimax fit (tests/data/fit_exp_poly.py: relative error under 1e-7) and 2^floor(x) from
// vscalefps, which floors its exponent itself: 8 vector operations where vexp takes 10. x < -126
// (-inf too) gives exactly 0 (2^-126 = FLT_MIN, vexp's cutoff), NaN stays NaN. (AVX2 has neither
// instruction; there the same exp would take as many operations as exp(x - max).)
template <class Arch>
inline xsimd::batch<float, Arch> vexp2_nonpositive([[maybe_unused]] const xsimd::batch<float, Arch> &x) {
    static_assert(std::is_same_v<Arch, xsimd::avx512f>, "vexp2_nonpositive is AVX-512 only");
#if defined(__AVX512F__)
    // imm 0x09: round down, precision exception suppressed; NaN passes the "not less" compare.
    const xsimd::batch<float, Arch> t = _mm512_reduce_ps(x, 0x09);
    const __mmask16 keep = _mm512_cmp_ps_mask(x, _mm512_set1_ps(kExp2Cutoff), _CMP_NLT_UQ);
    return _mm512_maskz_scalef_ps(keep, exp2_poly(t), x);
#endif
}

} // namespace
} // namespace mha::softmax_detail
