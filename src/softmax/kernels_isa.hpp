// Builds one ISA's softmax table. Included once by each kernels_<isa>.cpp after it defines
// MHA_ISA_TAG and MHA_ISA_ARCH.
#include "softmax/softmax_kernels.hpp"
#include "softmax/softmax_table.hpp"

namespace mha::softmax_detail {
namespace {
using K = RowKernels<MHA_ISA_ARCH>;
const SoftmaxKernels kTable{Isa::MHA_ISA_TAG, &K::rows, &K::online_fold, &K::online_finish, &K::exp,
                          &K::exp_nonpositive, K::kBase2 ? &K::exp2_nonpositive : nullptr};
} // namespace
} // namespace mha::softmax_detail
