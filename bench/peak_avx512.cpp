#include "bench/peak_kernel.hpp"

namespace mha::bench {
double fma_gflops_avx512(int64_t iters) { return fma_gflops_probe<xsimd::avx512f>(iters); }
} // namespace mha::bench
