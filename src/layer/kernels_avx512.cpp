// The Add & Norm row kernel for avx512 (compiled with its flags).
#include "layer/norm_kernels.hpp"

mha::layer_detail::NormRowFn mha::layer_detail::norm_row_avx512() { return &NormRows<xsimd::avx512f>::row; }
