// Loads and stores of the first n < vector-width lanes, for row tails, and a lane mask as bits:
// xsimd 8.1 has neither masked memory operations nor the mask, so each ISA gets a small helper.
// Lanes past n are never read or written.
// Include only from an ISA's translation unit.
#pragma once

#include <immintrin.h>

#include <cstdint>

#include <xsimd/xsimd.hpp>

namespace mha::softmax_detail {
namespace {

template <class Arch>
struct Partial;

#if defined(__AVX512F__)
template <>
struct Partial<xsimd::avx512f> {
    using V = xsimd::batch<float, xsimd::avx512f>;
    static __mmask16 mask(int64_t n) { return static_cast<__mmask16>((1u << n) - 1u); }
    // Lanes past n hold `fill`.
    static V load(const float *p, int64_t n, float fill) {
        return _mm512_mask_loadu_ps(_mm512_set1_ps(fill), mask(n), p);
    }
    static void store(float *p, int64_t n, const V &v) { _mm512_mask_storeu_ps(p, mask(n), v); }
    // Bit i: lane i of b.
    static unsigned bits(const xsimd::batch_bool<float, xsimd::avx512f> &b) { return static_cast<__mmask16>(b); }
};
#endif

#if defined(__AVX2__)
template <>
struct Partial<xsimd::fma3<xsimd::avx2>> {
    using V = xsimd::batch<float, xsimd::fma3<xsimd::avx2>>;
    static __m256i mask(int64_t n) {
        return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    }
    static V load(const float *p, int64_t n, float fill) {
        const __m256i m = mask(n);
        return _mm256_blendv_ps(_mm256_set1_ps(fill), _mm256_maskload_ps(p, m), _mm256_castsi256_ps(m));
    }
    static void store(float *p, int64_t n, const V &v) { _mm256_maskstore_ps(p, mask(n), v); }
    // Bit i: lane i of b.
    static unsigned bits(const xsimd::batch_bool<float, xsimd::fma3<xsimd::avx2>> &b) {
        return static_cast<unsigned>(_mm256_movemask_ps(static_cast<__m256>(b)));
    }
};
#endif

} // namespace
} // namespace mha::softmax_detail
