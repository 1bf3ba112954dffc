#include "layer/norm.hpp"

#include <tbb/parallel_for.h>

#include <cmath>
#include <vector>

#include "runtime/runtime_state.hpp"

namespace mha::layer_detail {
namespace {

// Sums with 8 running partial sums, combined in one fixed order (the compiler keeps them in a
// vector register).
constexpr int kLanes = 8;

float sum(const float *x, int64_t n) {
    float acc[kLanes] = {};
    int64_t j = 0;
    for (; j + kLanes <= n; j += kLanes)
        for (int l = 0; l < kLanes; ++l) acc[l] += x[j + l];
    for (int l = 0; j < n; ++j, ++l) acc[l] += x[j];
    return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

float sum_sq_dev(const float *x, int64_t n, float mean) {
    float acc[kLanes] = {};
    int64_t j = 0;
    for (; j + kLanes <= n; j += kLanes)
        for (int l = 0; l < kLanes; ++l) {
            const float d = x[j + l] - mean;
            acc[l] += d * d;
        }
    for (int l = 0; j < n; ++j, ++l) {
        const float d = x[j] - mean;
        acc[l] += d * d;
    }
    return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

// out = LayerNorm(v), v a row of n values (out == v allowed).
void norm_row(const float *v, int64_t n, float *out, const float *weight, const float *bias, float eps) {
    const float mean = sum(v, n) / static_cast<float>(n);
    const float var = sum_sq_dev(v, n, mean) / static_cast<float>(n);
    const float rstd = 1.0f / std::sqrt(var + eps);
    for (int64_t j = 0; j < n; ++j) {
        const float y = (v[j] - mean) * rstd;
        out[j] = (weight ? y * weight[j] : y) + (bias ? bias[j] : 0.0f);
    }
}

} // namespace

void add_norm_rows(detail::RuntimeState &st, bool norm, int64_t rows, int64_t n, const float *x, int64_t ldx,
                   const float *add, int64_t ld_add, float *out, int64_t ldo, const float *weight, const float *bias,
                   float eps) {
    constexpr int64_t kBlock = 16;  // rows per task
    auto block = [&](int64_t r0, int64_t r1, std::vector<float> &tmp) {
        for (int64_t r = r0; r < r1; ++r) {
            const float *xr = x + r * ldx;
            float *o = out + r * ldo;
            if (!add) {
                if (norm) norm_row(xr, n, o, weight, bias, eps);
                continue;
            }
            const float *ar = add + r * ld_add;
            float *v = norm ? tmp.data() : o;  // x + add, rounded to float first (as PyTorch adds)
            for (int64_t j = 0; j < n; ++j) v[j] = xr[j] + ar[j];
            if (norm) norm_row(v, n, o, weight, bias, eps);
        }
    };
    const int64_t blocks = (rows + kBlock - 1) / kBlock;
    if (blocks <= 1 || st.num_threads <= 1) {
        std::vector<float> tmp(static_cast<size_t>(n));
        return block(0, rows, tmp);
    }
    st.arena.execute([&] {
        tbb::parallel_for(tbb::blocked_range<int64_t>(0, blocks, 1), [&](const tbb::blocked_range<int64_t> &r) {
            std::vector<float> tmp(static_cast<size_t>(n));
            for (int64_t b = r.begin(); b != r.end(); ++b) block(b * kBlock, std::min(rows, (b + 1) * kBlock), tmp);
        });
    });
}

} // namespace mha::layer_detail
