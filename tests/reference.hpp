// Plain double-precision references that every kernel is tested against.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace mha::ref {

// C = alpha * op(A) * op(B) + beta * C in double; also returns, per element, the magnitude
// |alpha| * sum |a||b| + |beta c| that bounds the rounding error of any float evaluation.
inline void sgemm(char ta, char tb, int64_t m, int64_t n, int64_t k, double alpha, const float *a,
                  int64_t lda, const float *b, int64_t ldb, double beta, const float *c, int64_t ldc,
                  std::vector<double> &out, std::vector<double> &magnitude) {
    out.assign(static_cast<size_t>(m * n), 0.0);
    magnitude.assign(static_cast<size_t>(m * n), 0.0);
    for (int64_t i = 0; i < m; ++i)
        for (int64_t j = 0; j < n; ++j) {
            double s = 0, mag = 0;
            for (int64_t p = 0; p < k; ++p) {
                const double x = ta == 'N' ? a[i * lda + p] : a[p * lda + i];
                const double y = tb == 'N' ? b[p * ldb + j] : b[j * ldb + p];
                s += x * y;
                mag += std::fabs(x * y);
            }
            double r = alpha * s, rm = std::fabs(alpha) * mag;
            if (beta != 0.0) {
                r += beta * c[i * ldc + j];
                rm += std::fabs(beta * c[i * ldc + j]);
            }
            out[static_cast<size_t>(i * n + j)] = r;
            magnitude[static_cast<size_t>(i * n + j)] = rm;
        }
}

} // namespace mha::ref

namespace mha::ref {

// Softmax of one row in double: -inf entries give 0, a row of only -inf gives zeros.
inline std::vector<double> softmax_row(const float *x, int64_t n) {
    std::vector<double> y(static_cast<size_t>(n), 0.0);
    double m = -INFINITY;
    for (int64_t i = 0; i < n; ++i) m = std::max(m, static_cast<double>(x[i]));
    if (m == -INFINITY) return y;
    double s = 0;
    for (int64_t i = 0; i < n; ++i) s += y[static_cast<size_t>(i)] = std::exp(static_cast<double>(x[i]) - m);
    for (auto &v : y) v /= s;
    return y;
}

} // namespace mha::ref
