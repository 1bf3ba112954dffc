// The Add & Norm row kernel for avx2 (compiled with its flags).
#include "layer/norm_kernels.hpp"

mha::layer_detail::NormRowFn mha::layer_detail::norm_row_avx2() { return &NormRows<xsimd::fma3<xsimd::avx2>>::row; }
