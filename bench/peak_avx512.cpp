#include "bench/peak_kernel.hpp"

namespace mha::bench {
double fma_gflops_avx512(int64_t iters) { return fma_gflops_probe<xsimd::avx512f>(iters); }
float read_sum_avx512(const float *x, int64_t n) { return read_sum_probe<xsimd::avx512f>(x, n); }
} // namespace mha::bench
