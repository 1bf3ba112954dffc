// The FMA-throughput probe, written once over an xsimd architecture: independent accumulator
// chains keep both FMA ports busy through a 4-cycle latency (2 ports x 4 cycles = 8 chains minimum),
// as many as fit in the registers beside the two constants: 16 of AVX-512's 32, 12 of AVX2's 16
// (16 there spilled two chains to the stack, and the probe read 57.7 GFLOP/s on a Zen 3 core whose
// GEMM ran at 76).
#pragma once

#include <chrono>
#include <cstdint>

#include <xsimd/xsimd.hpp>

#include "simd/fmadd.hpp"

namespace mha::bench {
namespace {

// Runs `iters` rounds of kChains FMAs and returns the GFLOP/s this thread achieved.
template <class Arch>
double fma_gflops_probe(int64_t iters) {
    using V = xsimd::batch<float, Arch>;
    constexpr int kChains = V::size >= 16 ? 16 : 12;
    V acc[kChains];
    for (int i = 0; i < kChains; ++i) acc[i] = V(1.0f + 1e-3f * static_cast<float>(i));
    const V x(0.999999f), y(1e-7f);
    const auto t0 = std::chrono::steady_clock::now();
    for (int64_t it = 0; it < iters; ++it) {
#pragma GCC unroll 16
        for (int i = 0; i < kChains; ++i) acc[i] = mha::simd::fmadd(acc[i], x, y);
    }
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    volatile float sink = 0;
    for (int i = 0; i < kChains; ++i) sink = sink + xsimd::hadd(acc[i]);
    return 2.0 * kChains * static_cast<double>(V::size) * static_cast<double>(iters) / s * 1e-9;
}

// Sums n floats with 8 independent vector accumulators; returns the sum so the reads stay live.
template <class Arch>
float read_sum_probe(const float *x, int64_t n) {
    using V = xsimd::batch<float, Arch>;
    constexpr int64_t W = static_cast<int64_t>(V::size);
    V acc[8];
    for (auto &a : acc) a = V(0.0f);
    int64_t i = 0;
    for (; i + 8 * W <= n; i += 8 * W)
#pragma GCC unroll 8
        for (int j = 0; j < 8; ++j) acc[j] += V::load_unaligned(x + i + j * W);
    float s = 0;
    for (; i < n; ++i) s += x[i];
    for (auto &a : acc) s += xsimd::hadd(a);
    return s;
}

} // namespace
} // namespace mha::bench
