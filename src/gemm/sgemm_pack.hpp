// Packing for the GEMM, written once and compiled per ISA (include only from an ISA's translation
// unit). Packing lays an operand out in the order the microkernel reads it and absorbs transposes.
#pragma once

#include <cstdint>
#include <cstring>

#include "gemm/sgemm_kernels.hpp"
#include "gemm/transpose.hpp"

namespace mha::gemm {
namespace {

// Packs a count x kc operand into panels of W along x: element (x, p) = src[x * sx + p * sp] goes
// to out[(x / W) * W * kc + p * W + x % W]; the last panel is zero-padded to W.
// A is packed with x = row (sx = rs_a, sp = cs_a), B with x = column (sx = cs_b, sp = rs_b).
// pack_panels_into fills panels of depth ld >= kc a few depth steps at a time: element (x, p)
// goes to out[(x / W) * W * ld + p * W + x % W]. inserts: the register transpose a source contiguous
// along depth (sx != 1, sp == 1) goes through (TileConfig::transpose; the same floats either way).
template <class Arch, int W>
void pack_panels_into(int64_t count, int64_t kc, const float *src, int64_t sx, int64_t sp, float *out, int64_t ld,
                      bool inserts) {
    const int64_t full = count / W * W, tail = count - full;
    // The last panel's padding must be zeros: its kc depth steps are one contiguous run, zeroed in
    // one fill before the values land on it. (Zeroing only the W - tail lanes of each step became
    // a `rep stos` per step, whose start-up cost was a fifth of an L16 H8 D64 attention on Zen 5,
    // its 16 keys padded to a 32-key panel.)
    if (tail) std::memset(out + full * ld, 0, static_cast<size_t>(kc * W) * sizeof(float));
    if (sx == 1 && count >= 8 * W) {
        // The values of one depth step are contiguous (B, or A^T), across many panels: a row
        // dealt out to all of them writes one run to each, the runs kc W floats apart (64 KiB at
        // KC 512), all on the same few L1 sets. Eight rows at a time go into each panel in turn
        // instead, a 1 KiB run of writes each, the eight source rows read as eight streams. Xeon
        // (AMX), 1 thread, NN, against row by row: 64x1024x1024 0.939 -> 0.902 ms, 96x1024x1024
        // 1.301 -> 1.259, 64x4096x1024 3.544 -> 3.440, 128x1024x4096 6.599 -> 6.465; 1024^3 and
        // 2048^3 level to +0.5%, 1000^3 and 300x2000x1000 level (4 rows: alike; 16 rows: 1-2%
        // less). A few panels (attention's V, 2-4 panels) keep the row walk: L128-L512 level.
        constexpr int64_t kRows = 8;
        for (int64_t p0 = 0; p0 < kc; p0 += kRows) {
            const int64_t p1 = p0 + kRows < kc ? p0 + kRows : kc;
            for (int64_t x0 = 0; x0 < full; x0 += W)
                for (int64_t p = p0; p < p1; ++p) std::memcpy(out + x0 * ld + p * W, src + p * sp + x0, W * sizeof(float));
            if (tail)
                for (int64_t p = p0; p < p1; ++p)
                    std::memcpy(out + full * ld + p * W, src + p * sp + full, static_cast<size_t>(tail) * sizeof(float));
        }
    } else if (sx == 1) {
        // The values of one depth step are contiguous (B, or A^T): walk the source row by row, so
        // the reads stream through memory, and deal each row out to the panels.
        // Rows a page or more apart each start a new page, where the hardware prefetcher has to
        // learn the stream again before it runs ahead: request a few rows ahead by hand.
        constexpr int64_t kAhead = 4;
        const bool far = sp * static_cast<int64_t>(sizeof(float)) >= 2048;
        for (int64_t p = 0; p < kc; ++p) {
            const float *row = src + p * sp;
            if (far && p + kAhead < kc)
                for (int64_t x = 0; x < count; x += 16) __builtin_prefetch(row + kAhead * sp + x);
            for (int64_t x0 = 0; x0 < full; x0 += W) std::memcpy(out + x0 * ld + p * W, row + x0, W * sizeof(float));
            if (tail) std::memcpy(out + full * ld + p * W, row + full, static_cast<size_t>(tail) * sizeof(float));
        }
    } else if (sp == 1) {
        // Each x is contiguous along depth (A, or B^T): transpose L x L blocks in registers, a
        // group of L rows through the whole depth before the next group, so each row's lines are
        // read in order. Each row is its own stream (rows lie a page apart in large operands,
        // where the hardware prefetcher stops): the lines of the next block, the next group's
        // first at a group's end, are asked for a block ahead. Xeon (model 207), 1 thread, H8,
        // against all the rows of a panel a block at a time, two blocks ahead (K^T's packing
        // stalled on its 32 prefetches), K and V from L3, the same bits: attention L128 D128
        // +1.5-2.3%, causal +2%, D64 +0.5-1.3%, L512 level to +1%; GEMM NT and TN level.
        // The blocks go through the runtime's register transpose (`inserts`; transpose_variant.hpp).
        constexpr int L = Transpose<Arch>::L;
        const int64_t blocks = kc / L, whole = blocks * L;
        for (int64_t x0 = 0; x0 < count; x0 += W) {
            const int64_t w = count - x0 < W ? count - x0 : W;
            float *panel = out + x0 * ld;
            for (int64_t xg = 0; xg < w; xg += L) {
                const int g = static_cast<int>(w - xg < L ? w - xg : L);
                const int64_t next_group = xg + L < w ? x0 + xg + L : x0 + W;
                for (int64_t b = 0; b < blocks; ++b) {
                    const int64_t nx = b + 1 < blocks ? x0 + xg : next_group, np = b + 1 < blocks ? (b + 1) * L : 0;
                    for (int64_t x = nx, end = nx + L < count ? nx + L : count; x < end; ++x)
                        __builtin_prefetch(src + x * sx + np);
                    Transpose<Arch>::block(src + (x0 + xg) * sx + b * L, sx, g, panel + b * L * W + xg, W, inserts);
                }
            }
            for (int64_t x = 0; x < w; ++x)
                for (int64_t p = whole; p < kc; ++p) panel[p * W + x] = src[(x0 + x) * sx + p];
        }
    } else {
        for (int64_t x = 0; x < count; ++x)
            for (int64_t p = 0; p < kc; ++p) out[x / W * W * ld + p * W + x % W] = src[x * sx + p * sp];
    }
}

template <class Arch, int W>
void pack_panels(int64_t count, int64_t kc, const float *src, int64_t sx, int64_t sp, float *out, bool inserts) {
    pack_panels_into<Arch, W>(count, kc, src, sx, sp, out, kc, inserts);
}

// A's packing: rows in the microkernel's strips (see strip_start), strip q into panel q. Every
// strip before the last two is a whole panel (and the next to last too unless the two share
// their rows): those are packed in one pass.
template <class Arch, int MR>
void pack_strips(int64_t count, int64_t kc, const float *src, int64_t sx, int64_t sp, float *out, bool inserts) {
    const int64_t n = strip_count(count, MR);
    int64_t q = n > 0 ? strip_start(count, MR, n - 1) / MR : 0;
    if (q > 0) pack_panels<Arch, MR>(q * MR, kc, src, sx, sp, out, inserts);
    for (; q < n; ++q) {
        const int64_t r0 = strip_start(count, MR, q);
        pack_panels<Arch, MR>(strip_start(count, MR, q + 1) - r0, kc, src + r0 * sx, sx, sp, out + q * MR * kc, inserts);
    }
}

} // namespace
} // namespace mha::gemm
