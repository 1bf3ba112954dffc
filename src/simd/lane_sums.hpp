// Sums of W vectors at once (W = the vector width): lane t of the result is the sum of vector
// t's lanes. This is xsimd::haddp, except on AVX-512, where xsimd 8.1's haddp returns wrong sums;
// there a shuffle tree of 30 shuffles and 15 adds does it. Include only from an ISA's
// translation unit.
#pragma once

#include <immintrin.h>

#include <type_traits>

#include <xsimd/xsimd.hpp>

namespace mha::simd {
namespace {

template <class Arch>
inline xsimd::batch<float, Arch> lane_sums(const xsimd::batch<float, Arch> *v) {
#if defined(__AVX512F__)
    if constexpr (std::is_same_v<Arch, xsimd::avx512f>) {
        // Pairs: in each 128-bit lane, [a0+a2, b0+b2, a1+a3, b1+b3].
        __m512 u[8];
        for (int i = 0; i < 8; ++i)
            u[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
        // Quads: in each 128-bit lane k, the sums of vectors 4i..4i+3 over lane k.
        __m512 w[4];
        for (int i = 0; i < 4; ++i) {
            const __m512d a = _mm512_castps_pd(u[2 * i]), b = _mm512_castps_pd(u[2 * i + 1]);
            w[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
        }
        // Across the 128-bit lanes: (0 + 1, 2 + 3), then all four.
        __m512 x[2];
        for (int i = 0; i < 2; ++i)
            x[i] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0x88),
                                 _mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0xdd));
        return _mm512_add_ps(_mm512_shuffle_f32x4(x[0], x[1], 0x88), _mm512_shuffle_f32x4(x[0], x[1], 0xdd));
    }
#endif
    return xsimd::haddp(v);
}

} // namespace
} // namespace mha::simd
