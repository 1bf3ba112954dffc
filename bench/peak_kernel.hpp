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

// A microkernel's k loop alone, with its operands in L1 and no C traffic: each step loads NV
// vectors of B and broadcasts MR values of A into MR x NV FMAs, as sgemm_ukernel does, over a depth
// of kc (A: MR kc floats, B: NV W kc, which the caller keeps within L1), `reps` times. Returns
// GFLOP/s: the ceiling of that register shape's loop on this core, which no blocking, packing or
// prefetch can lift; beside the FMA probe (no loads at all) it shows what the loads themselves cost.
template <class Arch, int MR, int NV>
double k_loop_gflops_probe(int64_t reps, int64_t kc, const float *a, const float *b) {
    using V = xsimd::batch<float, Arch>;
    constexpr int W = static_cast<int>(V::size);
    V acc[MR][NV];
    for (auto &row : acc)
        for (auto &x : row) x = V(0.0f);
    const auto t0 = std::chrono::steady_clock::now();
    for (int64_t r = 0; r < reps; ++r) {
        const float *ap = a, *bp = b;
        asm volatile("" : "+r"(ap), "+r"(bp));  // a fresh pass each time, not hoisted
        for (int64_t p = 0; p < kc; ++p) {
            V bv[NV];
#pragma GCC unroll 8
            for (int j = 0; j < NV; ++j) bv[j] = V::load_aligned(bp + j * W);
#pragma GCC unroll 32
            for (int i = 0; i < MR; ++i) {
                const V ai(ap[i]);
#pragma GCC unroll 8
                for (int j = 0; j < NV; ++j) acc[i][j] = mha::simd::fmadd(ai, bv[j], acc[i][j]);
            }
            ap += MR;
            bp += NV * W;
        }
    }
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    volatile float sink = 0;
    for (auto &row : acc)
        for (auto &x : row) sink = sink + xsimd::hadd(x);
    return 2.0 * MR * NV * W * static_cast<double>(kc) * static_cast<double>(reps) / s * 1e-9;
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
