// Expands kernel_list.inc into the table of one ISA. Included once by each kernels_<isa>.cpp after
// it defines MHA_ISA_TAG (avx2 or avx512) and MHA_ISA_ARCH (the xsimd architecture).
#include <array>

#include "gemm/sgemm_kernels.hpp"
#include "gemm/sgemm_macro.hpp"

namespace mha::gemm {
namespace {

template <int MR, int NV>
constexpr SgemmKernel make_kernel(const char *name) {
    using A = MHA_ISA_ARCH;
    constexpr int NR = NV * static_cast<int>(xsimd::batch<float, A>::size);
    return SgemmKernel{name, Isa::MHA_ISA_TAG, MR, NR, &pack_panels<A, MR>, &pack_panels<A, NR>,
                       &sgemm_macro_packed<A, MR, NV>, &sgemm_macro_sup<A, MR, NV>};
}

#define MHA_STR2(x) #x
#define MHA_STR(x) MHA_STR2(x)
#define MHA_KERNEL_avx2(isa, mr, nv) make_kernel<mr, nv>(#isa "_" #mr "x" MHA_STR(MHA_NR_##isa(nv))),
#define MHA_KERNEL_avx512(isa, mr, nv) MHA_KERNEL_avx2(isa, mr, nv)
#define MHA_NR_avx2(nv) MHA_NR_avx2_##nv
#define MHA_NR_avx512(nv) MHA_NR_avx512_##nv
#define MHA_NR_avx2_1 8
#define MHA_NR_avx2_2 16
#define MHA_NR_avx2_3 24
#define MHA_NR_avx512_1 16
#define MHA_NR_avx512_2 32
#define MHA_NR_avx512_3 48
#define MHA_NR_avx512_4 64
#define MHA_SKIP(isa, mr, nv)

// Keep only this ISA's lines of the list.
#define MHA_SELECT_avx2_avx2 MHA_KERNEL_avx2
#define MHA_SELECT_avx512_avx512 MHA_KERNEL_avx512
#define MHA_SELECT_avx2_avx512 MHA_SKIP
#define MHA_SELECT_avx512_avx2 MHA_SKIP
#define MHA_SELECT3(tag, isa) MHA_SELECT_##tag##_##isa
#define MHA_SELECT2(tag, isa) MHA_SELECT3(tag, isa)
#define MHA_SGEMM_UKERNEL(isa, mr, nv) MHA_SELECT2(MHA_ISA_TAG, isa)(isa, mr, nv)

const SgemmKernel kKernels[] = {
#include "gemm/kernel_list.inc"
};

} // namespace
} // namespace mha::gemm
