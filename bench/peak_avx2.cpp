#include "bench/peak_kernel.hpp"

namespace mha::bench {
double fma_gflops_avx2(int64_t iters) { return fma_gflops_probe<xsimd::fma3<xsimd::avx2>>(iters); }
} // namespace mha::bench
