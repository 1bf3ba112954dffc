// Builds one ISA's table of fused-attention kernels, one per GEMM microkernel in kernel_list.inc.
// Included once by each kernels_<isa>.cpp after it defines MHA_ISA_TAG and MHA_ISA_ARCH.
#include "attention/attention_kernel.hpp"

namespace mha::attention_detail {
namespace {

template <int MR, int NV>
constexpr AttentionKernel make_attention_kernel(const char *name) {
    using K = FusedAttention<MHA_ISA_ARCH, MR, NV>;
    return AttentionKernel{name, Isa::MHA_ISA_TAG, MR, K::NR, &K::run, &K::run_chunk, &K::run_merge};
}

#define MHA_EMIT_KERNEL(name, mr, nv) make_attention_kernel<mr, nv>(name),
const AttentionKernel kKernels[] = {
#include "gemm/kernel_list_select.hpp"
};
#undef MHA_EMIT_KERNEL

} // namespace
} // namespace mha::attention_detail
