// Activations of the GEMM epilogue (the encoder's FFN: linear1's bias, then ReLU or GELU, while
// the block of C is still in cache), written once over an xsimd architecture. Include only from
// an ISA's translation unit.
//
// GELU is PyTorch's erf form, x/2 (1 + erf(x / sqrt 2)). With u = |x| / sqrt 2,
// 1 + erf(x / sqrt 2) is 2 - erfc(u) for x >= 0 and erfc(u) for x < 0 (no cancellation in the
// negative tail), and erfc(u) = t exp(-u^2 + P(t)), t = 1 / (1 + u/2), P of degree 9 our own
// least-squares fit (tests/data/fit_erfc_poly.py: relative error of erfc 1.2e-7 on [0, 9]; past 9
// erfc is below float's range and u is clamped there). NaN stays NaN; ReLU keeps NaN too.
#pragma once

#include <cstdint>

#include <xsimd/xsimd.hpp>

#include "gemm/sgemm_kernels.hpp"
#include "simd/fmadd.hpp"
#include "softmax/partial.hpp"
#include "softmax/vexp.hpp"

namespace mha::gemm {
namespace {

template <class Arch>
inline xsimd::batch<float, Arch> gelu(const xsimd::batch<float, Arch> &x) {
    using V = xsimd::batch<float, Arch>;
    // x86 min returns its second operand when either is NaN: NaN survives as u.
    const V u = xsimd::min(V(9.0f), xsimd::abs(x) * V(0.70710678f));
    const V t = V(1.0f) / simd::fmadd(u, V(0.5f), V(1.0f));
    V p = V(0x1.3fcc3cp-3f);
    for (const float c : {-0x1.78d622p-1f, 0x1.45b2c2p+0f, -0x1.a933f4p-1f, 0x1.d2f90cp-7f, -0x1.484716p-5f,
                          0x1.75bc78p-5f, 0x1.8a355ap-2f, 0x1.ff5cc4p-1f, -0x1.43f49p+0f})
        p = simd::fmadd(p, t, V(c));
    const V erfc = t * softmax_detail::vexp<Arch>(simd::fmadd(-u, u, p));
    return V(0.5f) * x * xsimd::select(x >= V(0.0f), V(2.0f) - erfc, erfc);
}

template <class Arch>
inline xsimd::batch<float, Arch> relu(const xsimd::batch<float, Arch> &x) {
    return xsimd::max(xsimd::batch<float, Arch>(0.0f), x);  // max(0, NaN) is NaN (the second operand)
}

// c[i * ldc + j] = act(c[i * ldc + j]) for i < rows, j < cols.
template <class Arch>
void activate(Epilogue act, int64_t rows, int64_t cols, float *c, int64_t ldc) {
    using V = xsimd::batch<float, Arch>;
    using P = softmax_detail::Partial<Arch>;
    constexpr int64_t W = static_cast<int64_t>(V::size);
    auto apply = [&](const V &x) { return act == Epilogue::gelu ? gelu<Arch>(x) : relu<Arch>(x); };
    for (int64_t i = 0; i < rows; ++i) {
        float *row = c + i * ldc;
        int64_t j = 0;
        for (; j + W <= cols; j += W) apply(V::load_unaligned(row + j)).store_unaligned(row + j);
        if (j < cols) P::store(row + j, cols - j, apply(P::load(row + j, cols - j, 0.0f)));
    }
}

} // namespace
} // namespace mha::gemm
