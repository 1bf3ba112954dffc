#include "bench/peak_kernel.hpp"

#include <cstring>

namespace mha::bench {
double fma_gflops_avx2(int64_t iters) { return fma_gflops_probe<xsimd::fma3<xsimd::avx2>>(iters); }
float read_sum_avx2(const float *x, int64_t n) { return read_sum_probe<xsimd::fma3<xsimd::avx2>>(x, n); }
// k_loop_gflops_probe for the microkernel of this ISA named `kernel` ("avx512_14x32"), every one of
// kernel_list.inc; 0 for a name that is not one of them.
double k_loop_gflops_avx2(const char *kernel, int64_t reps, int64_t kc, const float *a, const float *b) {
#define MHA_ISA_TAG avx2
#define MHA_EMIT_KERNEL(name, mr, nv) \
    if (std::strcmp(kernel, name) == 0) return k_loop_gflops_probe<xsimd::fma3<xsimd::avx2>, mr, nv>(reps, kc, a, b);
#include "gemm/kernel_list_select.hpp"
#undef MHA_EMIT_KERNEL
#undef MHA_ISA_TAG
    return 0.0;
}
} // namespace mha::bench
