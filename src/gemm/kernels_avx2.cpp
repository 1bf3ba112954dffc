// AVX2+FMA instantiations of the GEMM kernels (compiled with -mavx2 -mfma).
#define MHA_ISA_TAG avx2
#define MHA_ISA_ARCH xsimd::fma3<xsimd::avx2>
#include "gemm/sgemm_kernels_isa.hpp"

std::span<const mha::gemm::SgemmKernel> mha::gemm::sgemm_kernels_avx2() { return kKernels; }
