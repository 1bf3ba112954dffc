// The Add & Norm row kernel, written once over an xsimd architecture and instantiated per ISA
// (layer/kernels_<isa>.cpp). Sums run in four vector accumulators, vector v of the row into
// accumulator v % 4, combined in one fixed order: the bits depend on the row alone.
#pragma once

#include <cmath>
#include <cstdint>

#include <xsimd/xsimd.hpp>

#include "layer/norm_table.hpp"
#include "simd/fmadd.hpp"
#include "softmax/partial.hpp"

namespace mha::layer_detail {
namespace {

template <class Arch>
struct NormRows {
    using V = xsimd::batch<float, Arch>;
    using P = softmax_detail::Partial<Arch>;
    static constexpr int64_t W = static_cast<int64_t>(V::size);

    // f(vector index, lanes, offset) over a row of n values, the last vector partial.
    template <class F>
    static void each(int64_t n, const F &f) {
        int64_t j = 0, v = 0;
        for (; j + W <= n; j += W, ++v) f(v, W, j);
        if (j < n) f(v, n - j, j);
    }
    static V load(const float *p, int64_t lanes, float fill = 0.0f) {
        return lanes == W ? V::load_unaligned(p) : P::load(p, lanes, fill);
    }
    static void store(float *p, int64_t lanes, const V &x) {
        if (lanes == W)
            x.store_unaligned(p);
        else
            P::store(p, lanes, x);
    }
    static float total(const V (&s)[4]) { return xsimd::hadd((s[0] + s[1]) + (s[2] + s[3])); }

    // out = x + add (add may be NULL: out = x), then with norm out = LayerNorm(out); out may be x
    // or add.
    static void row(bool norm, int64_t n, const float *x, const float *add, float *out, const float *weight,
                    const float *bias, float eps) {
        V s[4] = {V(0.0f), V(0.0f), V(0.0f), V(0.0f)};
        each(n, [&](int64_t v, int64_t lanes, int64_t j) {
            V y = load(x + j, lanes);
            if (add) y += load(add + j, lanes);
            store(out + j, lanes, y);
            s[v % 4] += y;
        });
        if (!norm) return;
        const float mean = total(s) / static_cast<float>(n);
        V d[4] = {V(0.0f), V(0.0f), V(0.0f), V(0.0f)};
        each(n, [&](int64_t v, int64_t lanes, int64_t j) {
            const V c = load(out + j, lanes, mean) - V(mean);  // padding lanes give 0
            d[v % 4] = simd::fmadd(c, c, d[v % 4]);
        });
        const float var = total(d) / static_cast<float>(n);
        const V rstd(1.0f / std::sqrt(var + eps)), vm(mean);
        each(n, [&](int64_t, int64_t lanes, int64_t j) {
            V y = (load(out + j, lanes) - vm) * rstd;
            if (weight) y *= load(weight + j, lanes);
            if (bias) y += load(bias + j, lanes);
            store(out + j, lanes, y);
        });
    }
};

} // namespace
} // namespace mha::layer_detail
