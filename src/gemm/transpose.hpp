// Per-ISA register transposes for packing: an L x L block (L = vector width) of floats is read
// as L rows and written as L columns. Include only from an ISA's translation unit.
#pragma once

#include <immintrin.h>

#include <cstdint>

#include <xsimd/xsimd.hpp>

namespace mha::gemm {
namespace {

template <class Arch>
struct Transpose;

#if defined(__AVX512F__)
template <>
struct Transpose<xsimd::avx512f> {
    static constexpr int L = 16;
    // Reads rows [0, g) of src (row stride ld, 16 floats each; rows past g read as zero) and
    // writes, for t in [0, 16), lanes [0, g) of column t to dst + t * dst_ld. inserts: through
    // columns_by_inserts, else columns (the same floats; see transpose_variant.hpp).
    static void block(const float *src, int64_t ld, int g, float *dst, int64_t dst_ld, bool inserts) {
        __m512 r[16];
        if (inserts)
            columns_by_inserts(src, ld, g, r);
        else
            columns(src, ld, g, r);
        const __mmask16 mask = static_cast<__mmask16>((1u << g) - 1u);
        for (int i = 0; i < 16; ++i) _mm512_mask_storeu_ps(dst + i * dst_ld, mask, r[i]);
    }
    // The same registers as columns(), with half its shuffles (see transpose_variant.hpp): column
    // 4q + s, lane 4p + u is element s of row 4p + u's 128-bit chunk q. The loads put chunk q of
    // rows u, 4 + u, 8 + u, 12 + u into the four 128-bit lanes of x[u] (the cross-lane half of the
    // transpose, done as the rows are loaded), then a 4 x 4 transpose within each lane across
    // x[0..3] gives columns 4q .. 4q + 3: 32 shuffles a block, and 48 inserts that need not use the
    // shuffle port. Rows from g on are read from a zero row.
    [[gnu::always_inline]] static void columns_by_inserts(const float *src, int64_t ld, int g, __m512 r[16]) {
        alignas(64) static constexpr float zero[16] = {};
        const float *row[16];
        for (int i = 0; i < 16; ++i) row[i] = i < g ? src + i * ld : zero;
        for (int q = 0; q < 4; ++q) {
            __m512 x[4];
            for (int u = 0; u < 4; ++u) {
                __m512 v = _mm512_castps128_ps512(_mm_loadu_ps(row[u] + 4 * q));
                v = _mm512_insertf32x4(v, _mm_loadu_ps(row[4 + u] + 4 * q), 1);
                v = _mm512_insertf32x4(v, _mm_loadu_ps(row[8 + u] + 4 * q), 2);
                x[u] = _mm512_insertf32x4(v, _mm_loadu_ps(row[12 + u] + 4 * q), 3);
            }
            const __m512 t0 = _mm512_unpacklo_ps(x[0], x[1]), t1 = _mm512_unpackhi_ps(x[0], x[1]);
            const __m512 t2 = _mm512_unpacklo_ps(x[2], x[3]), t3 = _mm512_unpackhi_ps(x[2], x[3]);
            r[4 * q] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t0), _mm512_castps_pd(t2)));
            r[4 * q + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t0), _mm512_castps_pd(t2)));
            r[4 * q + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t1), _mm512_castps_pd(t3)));
            r[4 * q + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t1), _mm512_castps_pd(t3)));
        }
    }
    // The block's columns in registers: r[t] lane i = src[i * ld + t] for rows i < g, zero past.
    // 16 row loads, then 64 shuffles: in-lane 4 x 4 transposes, then the 128-bit lanes exchanged.
    [[gnu::always_inline]] static void columns(const float *src, int64_t ld, int g, __m512 r[16]) {
        __m512 t[16];
        for (int i = 0; i < 16; ++i) r[i] = i < g ? _mm512_loadu_ps(src + i * ld) : _mm512_setzero_ps();
        for (int i = 0; i < 16; i += 2) {
            t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
            t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
        }
        for (int i = 0; i < 16; i += 4) {
            r[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
            r[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
            r[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
            r[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
        }
        for (int h = 0; h < 16; h += 8)
            for (int i = 0; i < 4; ++i) {
                t[h + i] = _mm512_shuffle_f32x4(r[h + i], r[h + i + 4], 0x88);
                t[h + i + 4] = _mm512_shuffle_f32x4(r[h + i], r[h + i + 4], 0xdd);
            }
        for (int i = 0; i < 8; ++i) {
            r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
            r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xdd);
        }
    }
};
#endif

#if defined(__AVX2__)
template <>
struct Transpose<xsimd::fma3<xsimd::avx2>> {
    static constexpr int L = 8;
    // Reads rows [0, g) of src (row stride ld, 8 floats each) and writes column t (t in [0, 8)) to
    // dst + t * dst_ld: lanes [0, g) from the rows, lanes [g, min(dst_ld, 8)) as zeros (the caller's
    // panel padding). Unlike the AVX-512 block it writes those padding lanes. inserts: as the
    // AVX-512 block.
    static void block(const float *src, int64_t ld, int g, float *dst, int64_t dst_ld, bool inserts) {
        __m256 t[8];
        if (inserts)
            columns_by_inserts(src, ld, g, t);
        else
            columns(src, ld, g, t);
        // Masked stores are microcoded on AMD (Zen 3: packing A for the 6-row kernel took 7% of an
        // L = 128 attention in them), so each column is stored whole, lanes from g on as the zeros
        // they hold, in column order: with dst_ld < 8 a store runs into the next columns, which
        // their own stores then overwrite. Only the stores that would run past the block's
        // 8 dst_ld floats are masked, to dst_ld lanes.
        const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(dst_ld < 8 ? dst_ld : 8)), lane);
        for (int i = 0; i < 8; ++i) {
            if (i * dst_ld + 8 <= 8 * dst_ld)
                _mm256_storeu_ps(dst + i * dst_ld, t[i]);
            else
                _mm256_maskstore_ps(dst + i * dst_ld, mask, t[i]);
        }
    }
    // The same registers as columns(), built as the AVX-512 form builds them: chunk q of rows u and
    // 4 + u loaded into the two 128-bit lanes of x[u], then 4 x 4 transposes within the lanes: 16
    // shuffles a block and 8 inserts, not 24 shuffles. Rows from g on are read from a zero row.
    [[gnu::always_inline]] static void columns_by_inserts(const float *src, int64_t ld, int g, __m256 t[8]) {
        alignas(32) static constexpr float zero[8] = {};
        const float *row[8];
        for (int i = 0; i < 8; ++i) row[i] = i < g ? src + i * ld : zero;
        for (int q = 0; q < 2; ++q) {
            __m256 x[4];
            for (int u = 0; u < 4; ++u)
                x[u] = _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_loadu_ps(row[u] + 4 * q)),
                                            _mm_loadu_ps(row[4 + u] + 4 * q), 1);
            const __m256 t0 = _mm256_unpacklo_ps(x[0], x[1]), t1 = _mm256_unpackhi_ps(x[0], x[1]);
            const __m256 t2 = _mm256_unpacklo_ps(x[2], x[3]), t3 = _mm256_unpackhi_ps(x[2], x[3]);
            t[4 * q] = _mm256_shuffle_ps(t0, t2, 0x44);
            t[4 * q + 1] = _mm256_shuffle_ps(t0, t2, 0xee);
            t[4 * q + 2] = _mm256_shuffle_ps(t1, t3, 0x44);
            t[4 * q + 3] = _mm256_shuffle_ps(t1, t3, 0xee);
        }
    }
    // The block's columns in registers: t[c] lane i = src[i * ld + c] for rows i < g, zero past.
    // 8 row loads, then 24 shuffles: in-lane 4 x 4 transposes, then the 128-bit lanes exchanged.
    [[gnu::always_inline]] static void columns(const float *src, int64_t ld, int g, __m256 t[8]) {
        __m256 r[8];
        for (int i = 0; i < 8; ++i) r[i] = i < g ? _mm256_loadu_ps(src + i * ld) : _mm256_setzero_ps();
        for (int i = 0; i < 8; i += 2) {
            t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
            t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
        }
        for (int i = 0; i < 8; i += 4) {
            r[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
            r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xee);
            r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
            r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xee);
        }
        for (int i = 0; i < 4; ++i) {
            t[i] = _mm256_permute2f128_ps(r[i], r[i + 4], 0x20);
            t[i + 4] = _mm256_permute2f128_ps(r[i], r[i + 4], 0x31);
        }
    }
};
#endif

} // namespace
} // namespace mha::gemm
