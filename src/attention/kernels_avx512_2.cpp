// AVX-512 instantiations of the fused attention: part 2 of kernels_avx512.cpp's three.
#define MHA_ISA_TAG avx512
#define MHA_ISA_ARCH xsimd::avx512f
#define MHA_ATTN_PARTS 3
#define MHA_ATTN_PART 2
#include "attention/kernels_isa.hpp"

std::span<const mha::attention_detail::AttentionKernel> mha::attention_detail::attention_kernels_avx512_2() {
    return kKernels;
}
