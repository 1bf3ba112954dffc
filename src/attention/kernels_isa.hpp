// Builds one ISA's table of fused-attention kernels, one per GEMM microkernel in kernel_list.inc.
// Included by each kernels_<isa>*.cpp after it defines MHA_ISA_TAG and MHA_ISA_ARCH, and, where
// an ISA's kernels are compiled in several files, MHA_ATTN_PARTS and MHA_ATTN_PART: that file then
// builds the kernels whose place i in the ISA's list has i % MHA_ATTN_PARTS == MHA_ATTN_PART, and
// the table's other entries are empty (name NULL). Each kernel is a few minutes of the sanitizer
// build's compile; one file a kernel lets two cores share them.
#include "attention/attention_kernel.hpp"

#ifndef MHA_ATTN_PARTS
#define MHA_ATTN_PARTS 1
#define MHA_ATTN_PART 0
#endif

namespace mha::attention_detail {
namespace {

template <int MR, int NV>
constexpr AttentionKernel make_attention_kernel(const char *name) {
    using K = FusedAttention<MHA_ISA_ARCH, MR, NV>;
    return AttentionKernel{name, Isa::MHA_ISA_TAG, MR, K::NR, &K::run, &K::run_chunk, &K::run_merge};
}

// The kernel at place I of the list, if it is this file's; else an empty entry.
template <int MR, int NV, int I>
constexpr AttentionKernel part_kernel(const char *name) {
    if constexpr (I % MHA_ATTN_PARTS == MHA_ATTN_PART)
        return make_attention_kernel<MR, NV>(name);
    else
        return AttentionKernel{nullptr, Isa::MHA_ISA_TAG, 0, 0, nullptr, nullptr, nullptr};
}

constexpr int kFirstPlace = __COUNTER__;
#define MHA_EMIT_KERNEL(name, mr, nv) part_kernel<mr, nv, __COUNTER__ - kFirstPlace - 1>(name),
const AttentionKernel kKernels[] = {
#include "gemm/kernel_list_select.hpp"
};
#undef MHA_EMIT_KERNEL

} // namespace
} // namespace mha::attention_detail
