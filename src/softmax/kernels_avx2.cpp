// AVX2+FMA instantiations of the softmax kernels.
#define MHA_ISA_TAG avx2
#define MHA_ISA_ARCH xsimd::fma3<xsimd::avx2>
#include "softmax/kernels_isa.hpp"

const mha::softmax_detail::SoftmaxKernels &mha::softmax_detail::softmax_kernels_avx2() { return kTable; }
