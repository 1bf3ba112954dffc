// AVX-512 instantiations of the softmax kernels.
#define MHA_ISA_TAG avx512
#define MHA_ISA_ARCH xsimd::avx512f
#include "softmax/kernels_isa.hpp"

const mha::softmax_detail::SoftmaxKernels &mha::softmax_detail::softmax_kernels_avx512() { return kTable; }
