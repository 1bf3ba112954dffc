// The table of GEMM microkernels: one entry per line of kernel_list.inc, each instantiated in the
// translation unit of its ISA.
#pragma once

#include <cstdint>
#include <span>
#include <string_view>

#include "mha/isa.hpp"

namespace mha::gemm {

using UkernelFn = void (*)(int64_t k, const float *a, int64_t rs_a, int64_t cs_a, const float *b,
                           int64_t rs_b, float *c, int64_t ldc, float alpha, float beta);
using PackFn = void (*)(int64_t valid, int64_t kc, const float *x, int64_t rs, int64_t cs, float *out);

struct SgemmKernel {
    const char *name;  // "<isa>_<MR>x<NR>"
    Isa isa;
    int mr, nr;
    UkernelFn packed;     // A and B packed
    UkernelFn strided_a;  // A read in place, B packed
    UkernelFn strided_ab; // A and B read in place (B's columns contiguous)
    PackFn pack_a;        // one MR-row micro-panel of op(A)
    PackFn pack_b;        // one NR-column micro-panel of op(B)
};

std::span<const SgemmKernel> sgemm_kernels_avx2();
std::span<const SgemmKernel> sgemm_kernels_avx512();

// Every kernel compiled in, in kernel_list.inc order.
std::span<const SgemmKernel> all_sgemm_kernels();
// The kernel of that name, or nullptr.
const SgemmKernel *find_sgemm_kernel(std::string_view name);
// The default kernel of an ISA.
const SgemmKernel &default_sgemm_kernel(Isa isa);

} // namespace mha::gemm
