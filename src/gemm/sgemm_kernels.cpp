#include "gemm/sgemm_kernels.hpp"

#include <vector>

#include "mha/error.hpp"

namespace mha::gemm {

std::span<const SgemmKernel> all_sgemm_kernels() {
    static const std::vector<SgemmKernel> all = [] {
        std::vector<SgemmKernel> v;
        for (const auto &k : sgemm_kernels_avx512()) v.push_back(k);
        for (const auto &k : sgemm_kernels_avx2()) v.push_back(k);
        return v;
    }();
    return all;
}

const SgemmKernel *find_sgemm_kernel(std::string_view name) {
    for (const auto &k : all_sgemm_kernels())
        if (name == k.name) return &k;
    return nullptr;
}

const SgemmKernel &default_sgemm_kernel(Isa isa) {
    for (const auto &k : all_sgemm_kernels())
        if (k.isa == isa) return k;
    throw Error(Status::internal, "no GEMM microkernel compiled for " + std::string(isa_name(isa)));
}

} // namespace mha::gemm
