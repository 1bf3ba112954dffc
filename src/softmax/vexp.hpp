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

// e^t for t in [-ln2/2, ln2/2].
template <class V>
inline V exp_poly(const V &t) {
    V p = simd::fmadd(V(0x1.0fa834p-7f), t, V(0x1.573a54p-5f));
    p = simd::fmadd(p, t, V(0x1.555a6ap-3f));
    p = simd::fmadd(p, t, V(0x1.fffdc6p-2f));
    p = simd::fmadd(p, t, V(0x1.fffff6p-1f));
    return simd::fmadd(p, t, V(1.0f));
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

// exp(x) for x <= 0, -inf or NaN: what softmax takes (x - max, and the online fold's
// exp(m_old - m_new)). The same on AVX-512; without vscalefps there is no overflow to guard
// here, so 2^n comes straight from the rounding's bits, 13 vector operations instead of 16 (a
// magic bias of 1.5 * 2^23 + 127 leaves n + 127 in the low mantissa bits, which a shift moves
// into the exponent field: n + 127 is in [1, 127] for x in [cutoff, 0]). Same accuracy as vexp;
// x < cutoff (-inf too) gives exactly 0, NaN stays NaN (max returns its second operand on NaN).
template <class Arch>
inline xsimd::batch<float, Arch> vexp_nonpositive(const xsimd::batch<float, Arch> &x) {
    using V = xsimd::batch<float, Arch>;
#if defined(__AVX512F__)
    if constexpr (std::is_same_v<Arch, xsimd::avx512f>) return vexp<Arch>(x);
#endif
    using I = xsimd::batch<int32_t, Arch>;
    constexpr float kBias = 0x1.8000FEp23f;
    const V xc = xsimd::max(V(kExpCutoff), x);
    const V nb = simd::fmadd(xc, V(kLog2e), V(kBias));
    const V two_n = xsimd::bitwise_cast<V>(xsimd::bitwise_cast<I>(nb) << 23);
    const V t = simd::fmadd(nb - V(kBias), V(kMinusLn2), xc);
    return xsimd::select(x < V(kExpCutoff), V(0.0f), exp_poly(t) * two_n);
}

} // namespace
} // namespace mha::softmax_detail
