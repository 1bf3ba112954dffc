// AVX-512 instantiations of the fused attention: the first of three files, each building a third
// of the ISA's kernels (see kernels_isa.hpp).
#define MHA_ISA_TAG avx512
#define MHA_ISA_ARCH xsimd::avx512f
#define MHA_ATTN_PARTS 3
#define MHA_ATTN_PART 0
#include "attention/kernels_isa.hpp"

std::span<const mha::attention_detail::AttentionKernel> mha::attention_detail::attention_kernels_avx512_0() {
    return kKernels;
}
