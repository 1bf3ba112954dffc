// AVX2+FMA instantiations of the fused attention.
#define MHA_ISA_TAG avx2
#define MHA_ISA_ARCH xsimd::fma3<xsimd::avx2>
#include "attention/kernels_isa.hpp"

std::span<const mha::attention_detail::AttentionKernel> mha::attention_detail::attention_kernels_avx2() {
    return kKernels;
}

// The scratch layout is the same for every ISA; it lives with the kernels that carve it up.
int64_t mha::attention_detail::item_scratch_floats(const Shape &s, int mr, int nr) {
    int64_t sizes[ItemScratch::kParts];
    return ItemScratch::sizes(s, mr, nr, sizes);
}
