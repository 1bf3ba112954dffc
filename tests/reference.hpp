// Plain double-precision references that every kernel is tested against.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace mha::ref {

// C = alpha * op(A) * op(B) + beta * C in double; also returns, per element, the magnitude
// |alpha| * sum |a||b| + |beta c| that bounds the rounding error of any float evaluation. Each
// sum runs over p = 0, 1, ..., k - 1 as the definition writes it, on op(A)'s row and op(B)'s
// column first copied to contiguous doubles (so the loop reads neither with a stride).
inline void sgemm(char ta, char tb, int64_t m, int64_t n, int64_t k, double alpha, const float *a,
                  int64_t lda, const float *b, int64_t ldb, double beta, const float *c, int64_t ldc,
                  std::vector<double> &out, std::vector<double> &magnitude) {
    out.assign(static_cast<size_t>(m * n), 0.0);
    magnitude.assign(static_cast<size_t>(m * n), 0.0);
    std::vector<double> a_row(static_cast<size_t>(k)), b_cols(static_cast<size_t>(n * k));
    for (int64_t j = 0; j < n; ++j)
        for (int64_t p = 0; p < k; ++p)
            b_cols[static_cast<size_t>(j * k + p)] = tb == 'N' ? b[p * ldb + j] : b[j * ldb + p];
    for (int64_t i = 0; i < m; ++i) {
        for (int64_t p = 0; p < k; ++p) a_row[static_cast<size_t>(p)] = ta == 'N' ? a[i * lda + p] : a[p * lda + i];
        for (int64_t j = 0; j < n; ++j) {
            const double *y = b_cols.data() + j * k;
            double s = 0, mag = 0;
            for (int64_t p = 0; p < k; ++p) {
                const double xy = a_row[static_cast<size_t>(p)] * y[p];
                s += xy;
                mag += std::fabs(xy);
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

namespace mha::ref {

// Scaled-dot-product attention in double, straight from the definition: for each (b, h, i), the
// scores of the keys that pass every mask, their softmax, and the weighted sum of values.
// Rows with no visible key give zeros. weights (optional) gets [B, H, Lq, Lk].
struct AttentionCase {
    int64_t B, Lq, Lk, H, Hkv, D, Dv;
    double scale;
    bool causal = false;
    const int32_t *valid = nullptr;
    const uint8_t *mask = nullptr;
    int64_t mbs = 0, mrs = 0;
    // Score modifiers (mha_attention_variant), straight from their definitions: query i at position
    // p = i + Lk - Lq sees key j only if j > p - window; s = cap tanh(s / cap), then
    // s += slope[h] (j - p); a sink is one more logit in the softmax with no value row (gpt-oss).
    int64_t window = 0;
    double softcap = 0;
    const float *alibi = nullptr, *sinks = nullptr;
};

template <class T>  // float inputs, or double (the projections of the reference layer)
void attention(const AttentionCase &c, const T *q, const T *k, const T *v, std::vector<double> &out,
               std::vector<double> *weights = nullptr) {
    out.assign(static_cast<size_t>(c.B * c.Lq * c.H * c.Dv), 0.0);
    if (weights) weights->assign(static_cast<size_t>(c.B * c.H * c.Lq * c.Lk), 0.0);
    const int64_t G = c.H / c.Hkv;
    std::vector<double> s(static_cast<size_t>(c.Lk));
    std::vector<char> vis(static_cast<size_t>(c.Lk));
    for (int64_t b = 0; b < c.B; ++b)
        for (int64_t h = 0; h < c.H; ++h)
            for (int64_t i = 0; i < c.Lq; ++i) {
                const int64_t g = h / G;
                double m = -INFINITY;
                for (int64_t j = 0; j < c.Lk; ++j) {
                    bool ok = true;
                    if (c.causal && j > i + c.Lk - c.Lq) ok = false;
                    if (c.valid && j >= c.valid[b]) ok = false;
                    if (c.mask && !c.mask[b * c.mbs + i * c.mrs + j]) ok = false;
                    const int64_t pos = i + c.Lk - c.Lq;
                    if (c.window > 0 && pos - j >= c.window) ok = false;  // j <= pos - window, without overflow
                    vis[static_cast<size_t>(j)] = ok;
                    if (!ok) continue;
                    double d = 0;
                    for (int64_t x = 0; x < c.D; ++x)
                        d += static_cast<double>(q[((b * c.Lq + i) * c.H + h) * c.D + x]) *
                             k[((b * c.Lk + j) * c.Hkv + g) * c.D + x];
                    d *= c.scale;
                    if (c.softcap > 0) d = c.softcap * std::tanh(d / c.softcap);
                    if (c.alibi) d += static_cast<double>(c.alibi[h]) * static_cast<double>(j - pos);
                    s[static_cast<size_t>(j)] = d;
                    m = std::max(m, d);
                }
                if (m == -INFINITY) continue;
                double sum = 0;
                if (c.sinks) {  // softmax over [scores, sink], the sink's column dropped
                    m = std::max(m, static_cast<double>(c.sinks[h]));
                    sum += std::exp(static_cast<double>(c.sinks[h]) - m);
                }
                for (int64_t j = 0; j < c.Lk; ++j)
                    if (vis[static_cast<size_t>(j)]) sum += s[static_cast<size_t>(j)] = std::exp(s[static_cast<size_t>(j)] - m);
                for (int64_t j = 0; j < c.Lk; ++j) {
                    if (!vis[static_cast<size_t>(j)]) continue;
                    const double p = s[static_cast<size_t>(j)] / sum;
                    if (weights) (*weights)[static_cast<size_t>(((b * c.H + h) * c.Lq + i) * c.Lk + j)] = p;
                    for (int64_t x = 0; x < c.Dv; ++x)
                        out[static_cast<size_t>(((b * c.Lq + i) * c.H + h) * c.Dv + x)] +=
                            p * v[((b * c.Lk + j) * c.Hkv + g) * c.Dv + x];
                }
            }
}

} // namespace mha::ref

namespace mha::ref {

// y[t, o] = sum_i x[t, i] w[o, i] + b[o] in double (nn.Linear: w is [out, in]); b NULL = no bias.
template <class T>
std::vector<double> linear(const T *x, int64_t tokens, int64_t in, const float *w, const float *b, int64_t out) {
    std::vector<double> y(static_cast<size_t>(tokens * out));
    for (int64_t t = 0; t < tokens; ++t)
        for (int64_t o = 0; o < out; ++o) {
            double s = b ? b[o] : 0.0;
            for (int64_t i = 0; i < in; ++i) s += static_cast<double>(x[t * in + i]) * w[o * in + i];
            y[static_cast<size_t>(t * out + o)] = s;
        }
    return y;
}

// LayerNorm of each row of n values in double, as nn.LayerNorm: (x - mean) / sqrt(var + eps) * w + b
// with the biased variance; w and b NULL mean 1 and 0.
inline std::vector<double> layer_norm(const std::vector<double> &x, int64_t rows, int64_t n, const float *w,
                                      const float *b, double eps) {
    std::vector<double> y(x.size());
    for (int64_t r = 0; r < rows; ++r) {
        const double *row = x.data() + r * n;
        double mean = 0, var = 0;
        for (int64_t i = 0; i < n; ++i) mean += row[i];
        mean /= static_cast<double>(n);
        for (int64_t i = 0; i < n; ++i) var += (row[i] - mean) * (row[i] - mean);
        var /= static_cast<double>(n);
        const double rstd = 1.0 / std::sqrt(var + eps);
        for (int64_t i = 0; i < n; ++i)
            y[static_cast<size_t>(r * n + i)] = (row[i] - mean) * rstd * (w ? w[i] : 1.0) + (b ? b[i] : 0.0);
    }
    return y;
}

inline double relu(double x) { return x > 0 ? x : 0.0; }
inline double gelu(double x) { return 0.5 * x * (1.0 + std::erf(x / std::sqrt(2.0))); }  // PyTorch's "gelu" (erf form)

} // namespace mha::ref
