// AVX-512 instantiations of the fused attention.
#define MHA_ISA_TAG avx512
#define MHA_ISA_ARCH xsimd::avx512f
#include "attention/kernels_isa.hpp"

std::span<const mha::attention_detail::AttentionKernel> mha::attention_detail::attention_kernels_avx512() {
    return kKernels;
}
