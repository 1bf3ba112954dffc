// Packing for the GEMM, written once and compiled per ISA (include only from an ISA's translation
// unit). Packing lays an operand out in the order the microkernel reads it and absorbs transposes.
#pragma once

#include <cstdint>
#include <cstring>

namespace mha::gemm {
namespace {

// Packs a count x kc operand into panels of W along x: element (x, p) = src[x * sx + p * sp] goes
// to out[(x / W) * W * kc + p * W + x % W]; the last panel is zero-padded to W.
// A is packed with x = row (sx = rs_a, sp = cs_a), B with x = column (sx = cs_b, sp = rs_b).
template <int W>
void pack_panels(int64_t count, int64_t kc, const float *src, int64_t sx, int64_t sp, float *out) {
    for (int64_t x0 = 0; x0 < count; x0 += W, out += W * kc) {
        const int64_t w = count - x0 < W ? count - x0 : W;
        const float *panel = src + x0 * sx;
        if (w < W)
            for (int64_t p = 0; p < kc; ++p)
                for (int64_t x = w; x < W; ++x) out[p * W + x] = 0.0f;
        if (sx == 1) {
            // The W values of one depth step are contiguous (B, or A^T): a straight copy per step.
            if (w == W)
                for (int64_t p = 0; p < kc; ++p) std::memcpy(out + p * W, panel + p * sp, W * sizeof(float));
            else
                for (int64_t p = 0; p < kc; ++p) std::memcpy(out + p * W, panel + p * sp, static_cast<size_t>(w) * sizeof(float));
        } else if (sp == 1) {
            // Each x is contiguous along depth (A, or B^T): read one cache line of each in turn. Rows
            // a multiple of 1 KiB apart share an L1 set, so streaming all W at once would thrash it.
            for (int64_t p0 = 0; p0 < kc; p0 += 16) {
                const int64_t pn = kc - p0 < 16 ? kc - p0 : 16;
                for (int64_t x = 0; x < w; ++x) {
                    const float *s = panel + x * sx + p0;
                    float *d = out + p0 * W + x;
                    for (int64_t t = 0; t < pn; ++t) d[t * W] = s[t];
                }
            }
        } else {
            for (int64_t p = 0; p < kc; ++p)
                for (int64_t x = 0; x < w; ++x) out[p * W + x] = panel[x * sx + p * sp];
        }
    }
}

} // namespace
} // namespace mha::gemm
