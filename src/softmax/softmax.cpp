// The public softmax entry points: validation, then rows spread over the runtime's threads.
#include "mha/softmax.hpp"

#include <tbb/parallel_for.h>

#include <algorithm>

#include "runtime/runtime_state.hpp"
#include "runtime/validate.hpp"
#include "softmax/softmax_table.hpp"

namespace mha {
namespace softmax_detail {

const SoftmaxKernels &softmax_kernels(Isa isa) {
    return isa == Isa::avx512 ? softmax_kernels_avx512() : softmax_kernels_avx2();
}

} // namespace softmax_detail

namespace {

// True when the rows x cols windows of two matrices share any byte.
bool windows_overlap(const float *a, int64_t lda, const float *b, int64_t ldb, int64_t rows, int64_t cols) {
    const float *a_end = a + (rows - 1) * lda + cols, *b_end = b + (rows - 1) * ldb + cols;
    return a < b_end && b < a_end;
}

} // namespace

void softmax(Runtime &rt, int64_t rows, int64_t cols, const float *x, int64_t ldx, float *y, int64_t ldy) {
    detail::check_size("rows", rows);
    detail::check_size("cols", cols);
    detail::check_matrix("x", "ldx", x, rows, cols, ldx);
    detail::check_matrix("y", "ldy", y, rows, cols, ldy);
    if (rows == 0 || cols == 0) return;
    if (x == y && ldx != ldy)
        invalid_argument("in-place softmax (x == y) needs ldx == ldy, got " + std::to_string(ldx) + " and " +
                         std::to_string(ldy));
    if (x != y && windows_overlap(x, ldx, y, ldy, rows, cols)) invalid_argument("x and y overlap (and are not the same)");
    auto &s = rt.state();
    const auto rows_fn = s.softmax_kernels->rows;
    // About 16K elements per task: enough to hide the task overhead, small enough to balance.
    const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 14) / std::max<int64_t>(cols, 1));
    if (rows <= grain || s.threads_for(static_cast<double>(rows) * static_cast<double>(cols), s.tiles.parallel_min_elems) == 1)
        return rows_fn(rows, cols, x, ldx, y, ldy);
    s.arena->execute([&] {
        tbb::parallel_for(tbb::blocked_range<int64_t>(0, rows, grain), [&](const tbb::blocked_range<int64_t> &r) {
            rows_fn(static_cast<int64_t>(r.size()), cols, x + r.begin() * ldx, ldx, y + r.begin() * ldy, ldy);
        });
    });
}

void online_softmax_fold(Runtime &rt, int64_t rows, int64_t cols, float *s, int64_t lds, float *running_max,
                         float *running_sum, float *acc, int64_t ldacc, int64_t acc_cols) {
    detail::check_size("rows", rows);
    detail::check_size("cols", cols);
    detail::check_size("acc_cols", acc_cols);
    detail::check_matrix("s", "lds", s, rows, cols, lds);
    detail::check_matrix("acc", "ldacc", acc, rows, acc_cols, ldacc);
    if (rows == 0) return;
    detail::check_not_null("running_max", running_max);
    detail::check_not_null("running_sum", running_sum);
    rt.state().softmax_kernels->online_fold(rows, cols, s, lds, running_max, running_sum, acc, ldacc, acc_cols);
}

void online_softmax_finish(Runtime &rt, int64_t rows, const float *running_sum, float *acc, int64_t ldacc,
                           int64_t acc_cols) {
    detail::check_size("rows", rows);
    detail::check_size("acc_cols", acc_cols);
    detail::check_matrix("acc", "ldacc", acc, rows, acc_cols, ldacc);
    if (rows == 0) return;
    detail::check_not_null("running_sum", running_sum);
    rt.state().softmax_kernels->online_finish(rows, running_sum, acc, ldacc, acc_cols);
}

} // namespace mha
