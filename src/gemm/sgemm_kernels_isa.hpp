// Expands kernel_list.inc into the table of one ISA. Included once by each kernels_<isa>.cpp after
// it defines MHA_ISA_TAG (avx2 or avx512) and MHA_ISA_ARCH (the xsimd architecture).
#include "gemm/sgemm_kernels.hpp"
#include "gemm/activation.hpp"
#include "gemm/sgemm_bt_rows.hpp"
#include "gemm/sgemm_macro.hpp"

namespace mha::gemm {
namespace {

template <int MR, int NV>
constexpr SgemmKernel make_kernel(const char *name) {
    using A = MHA_ISA_ARCH;
    constexpr int NR = NV * static_cast<int>(xsimd::batch<float, A>::size);
    return SgemmKernel{name, Isa::MHA_ISA_TAG, MR, NR, &pack_strips<A, MR>, &pack_panels<A, NR>,
                       &sgemm_macro_packed<A, MR, NV>, &sgemm_macro_sup<A, MR, NV>,
                       &sgemm_macro_bt<A, MR>, static_cast<int>(xsimd::batch<float, A>::size),
                       &sgemm_macro_bt_rows<A>, &activate<A>, kChainRows<MR, NV>,
                       &sgemm_macro_in_place<A, MR, NV>, &sgemm_macro_bt<A, MR, NV>,
                       &pack_panels<A, static_cast<int>(xsimd::batch<float, A>::size)>};
}

#define MHA_EMIT_KERNEL(name, mr, nv) make_kernel<mr, nv>(name),
const SgemmKernel kKernels[] = {
#include "gemm/kernel_list_select.hpp"
};
#undef MHA_EMIT_KERNEL

} // namespace
} // namespace mha::gemm
