#include "bench/peak_kernel.hpp"

namespace mha::bench {
double fma_gflops_avx2(int64_t iters) { return fma_gflops_probe<xsimd::fma3<xsimd::avx2>>(iters); }
float read_sum_avx2(const float *x, int64_t n) { return read_sum_probe<xsimd::fma3<xsimd::avx2>>(x, n); }
} // namespace mha::bench
