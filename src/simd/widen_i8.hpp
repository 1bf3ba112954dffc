// W int8 values widened to one vector of fp32 (vpmovsxbd + vcvtdq2ps), on every ISA: xsimd 8.1
// has no widening load from int8. Include only from an ISA's translation unit.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <type_traits>

#include <xsimd/xsimd.hpp>

namespace mha::simd {
namespace {

template <class Arch>
inline xsimd::batch<float, Arch> widen_i8(const int8_t *p) {
#if defined(__AVX512F__)
    if constexpr (std::is_same_v<Arch, xsimd::avx512f>)
        return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i *>(p))));
#endif
    if constexpr (xsimd::batch<float, Arch>::size == 8)
        return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i *>(p))));
    alignas(64) float lanes[xsimd::batch<float, Arch>::size];
    for (size_t i = 0; i < xsimd::batch<float, Arch>::size; ++i) lanes[i] = static_cast<float>(p[i]);
    return xsimd::batch<float, Arch>::load_aligned(lanes);
}

} // namespace
} // namespace mha::simd
