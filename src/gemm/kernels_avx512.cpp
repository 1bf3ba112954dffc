// AVX-512 instantiations of the GEMM kernels (compiled with -mavx512f -mavx512vl -mavx512bw -mavx512dq -mfma).
#define MHA_ISA_TAG avx512
#define MHA_ISA_ARCH xsimd::avx512f
#include "gemm/sgemm_kernels_isa.hpp"

std::span<const mha::gemm::SgemmKernel> mha::gemm::sgemm_kernels_avx512() { return kKernels; }
