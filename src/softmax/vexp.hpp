// exp(x) on SIMD registers, written once over an xsimd architecture. Include only from an ISA's
// translation unit.
//
// exp(x) = 2^n * e^t with n = round(x / ln2) and t = x - n ln2 in [-ln2/2, ln2/2], the reduction
// in two steps (Cody & Waite: ln2 = hi + lo, so n * hi is exact), then e^t by a degree-5
// polynomial, and 2^n built in the exponent bits. This follows the "rr2-p5" scheme of XNNPACK's
// exp kernels; the coefficients are our own fit (tools in tests/data/fit_exp_poly.py):
// relative error under 1e-7 on the reduced range.
#pragma once

#include <cstdint>
#include <limits>

#include <xsimd/xsimd.hpp>

namespace mha::softmax_detail {
namespace {

template <class Arch>
inline xsimd::batch<float, Arch> vexp(const xsimd::batch<float, Arch> &x) {
    using V = xsimd::batch<float, Arch>;
    using I = xsimd::batch<int32_t, Arch>;
    // Below ln(FLT_MIN) the result would be subnormal: it is flushed to exactly 0, which is also
    // what x = -inf gives. Above 88 (never reached by max-subtracted softmax inputs) it saturates
    // at 2^127-ish instead of overflowing.
    const V lo(-87.33654f), hi(88.0f);
    // max(lo, x) and min(hi, .) keep a NaN x as NaN (the x86 min/max return their second operand
    // when either is NaN).
    const V xc = xsimd::min(hi, xsimd::max(lo, x));
    const V n = xsimd::nearbyint(xc * V(1.44269504f));
    V t = xsimd::fma(n, V(-0.693145752f), xc);    // ln2 hi: 0x1.62E400p-1, exact in n * hi
    t = xsimd::fma(n, V(-1.42860677e-6f), t);     // ln2 lo
    V p = xsimd::fma(V(0x1.0fa834p-7f), t, V(0x1.573a54p-5f));
    p = xsimd::fma(p, t, V(0x1.555a6ap-3f));
    p = xsimd::fma(p, t, V(0x1.fffdc6p-2f));
    p = xsimd::fma(p, t, V(0x1.fffff6p-1f));
    p = xsimd::fma(p, t, V(1.0f));
    const V scale = xsimd::bitwise_cast<V>((xsimd::to_int(n) + I(127)) << 23);
    return xsimd::select(x < lo, V(0.0f), p * scale);
}

} // namespace
} // namespace mha::softmax_detail
