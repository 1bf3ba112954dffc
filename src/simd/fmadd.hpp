// a * b + c with one rounding, on every ISA. xsimd 8.1 has no AVX-512 kernel for xsimd::fma and
// falls back to a multiply and an add, which only becomes an FMA if the compiler contracts it
// (it does not under the sanitizers), so results would depend on the build. Include only from an
// ISA's translation unit.
#pragma once

#include <immintrin.h>

#include <type_traits>

#include <xsimd/xsimd.hpp>

namespace mha::simd {
namespace {

template <class Arch>
inline xsimd::batch<float, Arch> fmadd(const xsimd::batch<float, Arch> &a, const xsimd::batch<float, Arch> &b,
                                       const xsimd::batch<float, Arch> &c) {
#if defined(__AVX512F__)
    if constexpr (std::is_same_v<Arch, xsimd::avx512f>) return _mm512_fmadd_ps(a, b, c);
#endif
    return xsimd::fma(a, b, c);
}

} // namespace
} // namespace mha::simd
