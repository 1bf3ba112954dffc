// mha::EncoderLayer: the attention layer with its Add & Norm, then the feed-forward network with
// its own, row block by row block so the FFN's hidden activations stay in cache between the two
// GEMMs (linear1 adds its bias and applies the activation in its epilogue).
#include "mha/encoder.hpp"

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "gemm/prepacked.hpp"
#include "layer/norm.hpp"
#include "mha/error.hpp"
#include "runtime/runtime_state.hpp"
#include "runtime/validate.hpp"

namespace mha {

struct EncoderLayer::Impl {
    EncoderConfig cfg;
    std::unique_ptr<Layer> attention;
    gemm::PackedB w1, w2;
    std::vector<float> b1, b2, norm_weight, norm_bias;  // empty: none (norm: 1 and 0)
    const float *ptr(const std::vector<float> &v) const { return v.empty() ? nullptr : v.data(); }
    // y = attention_into(y), then the FFN with its Add & Norm from y into out, row block by row block.
    template <class Attention>
    void run(Runtime &rt, int64_t tokens, float *out, const Attention &attention_into) const;
};

namespace {

int64_t product(int64_t a, int64_t b, const char *what) {
    int64_t r;
    if (__builtin_mul_overflow(a, b, &r) || r > INT64_MAX / 16) invalid_argument(std::string(what) + ": the sizes overflow");
    return r;
}

// Rows of the FFN per block: its hidden activations (rows x ffn_dim) stay within about 1 MiB.
int64_t ffn_block_rows(int64_t ffn_dim) { return std::clamp<int64_t>((int64_t{1} << 18) / ffn_dim, 16, 512); }

} // namespace

EncoderLayer::EncoderLayer(Runtime &rt, const EncoderConfig &config, const EncoderWeights &w)
    : impl_(std::make_unique<Impl>()) {
    Impl &m = *impl_;
    EncoderConfig c = config;
    c.attention = config.attention.resolved();
    const int64_t E = c.attention.embed_dim;
    if (c.attention.norm == Norm::none)
        invalid_argument("attention.norm must be MHA_NORM_POST (norm_first=False) or MHA_NORM_PRE (norm_first=True) for "
                         "an encoder layer");
    if (c.attention.kdim != E || c.attention.vdim != E)
        invalid_argument("the encoder layer is self-attention: attention.kdim and vdim must be 0 or embed_dim = " +
                         std::to_string(E));
    if (c.ffn_dim <= 0) invalid_argument("ffn_dim = " + std::to_string(c.ffn_dim) + " must be positive");
    if (c.activation != Activation::relu && c.activation != Activation::gelu)
        invalid_argument("activation = " + std::to_string(static_cast<int>(c.activation)) +
                         " is not an mha_activation (MHA_ACT_RELU, MHA_ACT_GELU)");
    product(c.ffn_dim, E, "linear1_weight");
    detail::check_not_null("linear1_weight", w.linear1_weight);
    detail::check_not_null("linear2_weight", w.linear2_weight);
    m.cfg = c;
    m.attention = std::make_unique<Layer>(rt, c.attention, w.attention);
    m.cfg.attention.variant = m.attention->config().variant;  // the layer's copies, not the caller's arrays
    auto &st = rt.state();
    // A weight W [n, in] is B = W^T to the GEMM: element (p, j) = W[j * in + p].
    m.w1 = gemm::pack_b(st, E, c.ffn_dim, w.linear1_weight, 1, E);
    m.w2 = gemm::pack_b(st, c.ffn_dim, E, w.linear2_weight, 1, c.ffn_dim);
    if (w.linear1_bias) m.b1.assign(w.linear1_bias, w.linear1_bias + c.ffn_dim);
    if (w.linear2_bias) m.b2.assign(w.linear2_bias, w.linear2_bias + E);
    if (w.norm2_weight) m.norm_weight.assign(w.norm2_weight, w.norm2_weight + E);
    if (w.norm2_bias) m.norm_bias.assign(w.norm2_bias, w.norm2_bias + E);
}

EncoderLayer::~EncoderLayer() = default;

const EncoderConfig &EncoderLayer::config() const { return impl_->cfg; }

double EncoderLayer::flops(const LayerForward &p) const {
    const double tokens = static_cast<double>(p.batch) * static_cast<double>(p.q_len);
    const double E = static_cast<double>(impl_->cfg.attention.embed_dim), F = static_cast<double>(impl_->cfg.ffn_dim);
    LayerForward a = p;
    if (a.kv_len == 0) a.kv_len = a.q_len;
    return impl_->attention->flops(a) + 4.0 * tokens * E * F;
}

void EncoderLayer::forward(Runtime &rt, const LayerForward &p, const float *x, float *out) const {
    const Impl &m = *impl_;
    const int64_t E = m.cfg.attention.embed_dim;
    if (p.weights) invalid_argument("weights must be NULL: the encoder layer does not return attention weights");
    detail::check_size("batch", p.batch);
    detail::check_size("q_len", p.q_len);
    const int64_t tokens = product(p.batch, p.q_len, "x");
    if (tokens) {
        detail::check_matrix("x", "embed_dim", x, tokens, E, E);
        detail::check_matrix("out", "embed_dim", out, tokens, E, E);
    }
    m.run(rt, tokens, out, [&](float *y) { m.attention->forward(rt, p, x, nullptr, nullptr, y); });
}

void EncoderLayer::forward_varlen(Runtime &rt, const LayerVarlenForward &p, const float *x, float *out) const {
    const Impl &m = *impl_;
    const int64_t E = m.cfg.attention.embed_dim;
    const int64_t tokens = detail::check_offsets("offsets", p.offsets, p.num_seqs);
    if (tokens) {
        detail::check_matrix("x", "embed_dim", x, tokens, E, E);
        detail::check_matrix("out", "embed_dim", out, tokens, E, E);
    }
    m.run(rt, tokens, out, [&](float *y) { m.attention->forward_varlen(rt, p, x, y); });
}

template <class Attention>
void EncoderLayer::Impl::run(Runtime &rt, int64_t tokens, float *out, const Attention &attention_into) const {
    const Impl &m = *this;
    const int64_t E = m.cfg.attention.embed_dim, F = m.cfg.ffn_dim;
    auto &st = rt.state();
    const int64_t R = std::max<int64_t>(1, std::min(tokens, ffn_block_rows(F)));
    const int64_t y_floats = product(tokens, E, "x");
    // y, then per row block the normalized input (pre-norm), the hidden activations and linear2's
    // output; borrowed before anything is written.
    auto scratch = st.pool.borrow(static_cast<size_t>(y_floats + R * (2 * E + F) + 1));
    float *y = scratch.data(), *zn = y + y_floats, *h = zn + R * E, *f = h + R * F;
    attention_into(y);  // validates the rest; x is read only here, so out may be x
    if (tokens == 0) return;

    const bool post = m.cfg.attention.norm == Norm::post;
    const float eps = m.cfg.attention.norm_eps;
    const auto act = m.cfg.activation == Activation::gelu ? gemm::Epilogue::gelu : gemm::Epilogue::relu;
    for (int64_t r0 = 0; r0 < tokens; r0 += R) {
        const int64_t rows = std::min(R, tokens - r0);
        const float *yr = y + r0 * E;
        const float *in = yr;
        if (!post) {  // pre-norm: the FFN reads LayerNorm2(y)
            layer_detail::add_norm_rows(st, true, rows, E, yr, E, nullptr, 0, zn, E, m.ptr(m.norm_weight),
                                        m.ptr(m.norm_bias), eps);
            in = zn;
        }
        gemm::sgemm_prepacked(st, rows, F, in, E, m.w1, 0, m.ptr(m.b1), h, F, act);
        gemm::sgemm_prepacked(st, rows, E, h, F, m.w2, 0, m.ptr(m.b2), f, E);
        // out = LayerNorm2(y + f) (post) or y + f (pre)
        layer_detail::add_norm_rows(st, post, rows, E, yr, E, f, E, out + r0 * E, E, m.ptr(m.norm_weight),
                                    m.ptr(m.norm_bias), eps);
    }
}

} // namespace mha
