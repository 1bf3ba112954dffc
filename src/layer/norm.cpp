#include "layer/norm.hpp"

#include <tbb/parallel_for.h>

#include <algorithm>

#include "layer/norm_table.hpp"
#include "runtime/runtime_state.hpp"

namespace mha::layer_detail {

void add_norm_rows(detail::RuntimeState &st, bool norm, int64_t rows, int64_t n, const float *x, int64_t ldx,
                   const float *add, int64_t ld_add, float *out, int64_t ldo, const float *weight, const float *bias,
                   float eps) {
    const NormRowFn row = st.isa == Isa::avx512 ? norm_row_avx512() : norm_row_avx2();
    auto block = [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r)
            row(norm, n, x + r * ldx, add ? add + r * ld_add : nullptr, out + r * ldo, weight, bias, eps);
    };
    constexpr int64_t kBlock = 16;  // rows per task
    const int64_t blocks = (rows + kBlock - 1) / kBlock;
    if (blocks <= 1 || st.threads_for(static_cast<double>(rows) * static_cast<double>(n), st.tiles.parallel_min_elems) == 1)
        return block(0, rows);
    st.arena->execute([&] {
        tbb::parallel_for(tbb::blocked_range<int64_t>(0, blocks, 1), [&](const tbb::blocked_range<int64_t> &r) {
            for (int64_t b = r.begin(); b != r.end(); ++b) block(b * kBlock, std::min(rows, (b + 1) * kBlock));
        });
    });
}

} // namespace mha::layer_detail
