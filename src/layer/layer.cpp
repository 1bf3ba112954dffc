// mha::Layer: validation, the weights packed once, and the forward pass (projections with the bias
// in the GEMM epilogue, the fused attention on the projections where they lie, the output projection).
#include "mha/layer.hpp"

#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>

#include <algorithm>
#include <bit>
#include <mutex>
#include <shared_mutex>
#include <cmath>
#include <string>
#include <unordered_set>
#include <vector>

#include "gemm/prepacked.hpp"
#include "layer/layer_cached.hpp"
#include "layer/norm.hpp"
#include "mha/attention.hpp"
#include "mha/serving.hpp"
#include "runtime/runtime_state.hpp"
#include "serving/kv_cache_impl.hpp"
#include "runtime/validate.hpp"

namespace mha {
namespace {

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// The row stride (floats) of a scratch matrix of `width` columns that the attention reads and
// writes: 16 floats (a line) more where width is a multiple of 4 KiB, so that its rows do not all
// fall on the same L1 sets (E = 1024, 2048, 4096: Q, K, V and O rows 12, 24 or 48 KiB apart).
int64_t scratch_ld(int64_t width) { return width * static_cast<int64_t>(sizeof(float)) % 4096 == 0 ? width + 16 : width; }

// Whether rows x cols floats at a and at b (both dense) share memory.
bool overlaps(const float *a, const float *b, int64_t rows, int64_t cols) {
    const auto n = static_cast<size_t>(rows * cols);
    return a < b + n && b < a + n;
}

int64_t product(std::initializer_list<int64_t> dims, const std::string &what) {
    int64_t p = 1;
    for (int64_t d : dims)
        if (__builtin_mul_overflow(p, d, &p) || p > INT64_MAX / 16) invalid_argument(what + ": the sizes overflow");
    return p;
}

void positive(const char *name, int64_t x) {
    if (x <= 0) invalid_argument(std::string(name) + " = " + std::to_string(x) + " must be positive");
}

// One projection: columns [j0, j0 + n) of a packed weight matrix, and its bias (NULL if none).
struct Projection {
    const gemm::PackedB *packed = nullptr;
    int64_t j0 = 0, n = 0;
    const float *bias = nullptr;
};

// Not under ThreadSanitizer: a clone set is picked by an ifunc resolver that the dynamic loader
// runs while relocating libmha, before TSan's runtime is up, and an instrumented resolver crashes
// there (every test of tools/tsan died in the loader). The one baseline copy gives the same bits.
#if defined(__SANITIZE_THREAD__)
#define MHA_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define MHA_TSAN 1
#endif
#endif
#if defined(MHA_TSAN)
#define MHA_ROPE_TARGETS
#else
#define MHA_ROPE_TARGETS __attribute__((target_clones("avx512f", "avx2", "default")))
#endif
#if defined(__clang__)
#define MHA_ROPE_NO_CONTRACT
#else
#define MHA_ROPE_NO_CONTRACT __attribute__((optimize("fp-contract=off")))
#endif
#define MHA_ROPE_CLONES MHA_ROPE_TARGETS MHA_ROPE_NO_CONTRACT

// Rotary embeddings (RoFormer, Su et al. 2021) on rows of q and k heads. The angles come from a
// table built once per call for the positions the call has (every head, batch and token at one
// position share its row), so no sin or cos is taken per element; rotation is in fp32.
struct RopeTable {
    int64_t half = 0;
    std::vector<int64_t> positions;  // sorted, distinct
    std::vector<float> cs;           // per position: half cosines, then half sines

    RopeTable(const Rope &r, const std::vector<float> &inv_freq, std::vector<int64_t> pos) : half(r.dims / 2) {
        std::sort(pos.begin(), pos.end());
        pos.erase(std::unique(pos.begin(), pos.end()), pos.end());
        positions = std::move(pos);
        cs.resize(positions.size() * static_cast<size_t>(2 * half));
        for (size_t n = 0; n < positions.size(); ++n)
            angles(r, inv_freq, positions[n], cs.data() + n * static_cast<size_t>(2 * half));
    }
    const float *at(int64_t position) const {
        const auto it = std::lower_bound(positions.begin(), positions.end(), position);
        return cs.data() + static_cast<size_t>(it - positions.begin()) * static_cast<size_t>(2 * half);
    }
    void rotate(bool interleaved, int64_t position, float *x, int64_t heads, int64_t D) const {
        rope_rotate(interleaved, at(position), half, x, heads, D);
    }
    // The cosines then the sines of one position's row (as PyTorch's reference code: t, scaled,
    // times inv_freq in fp32, then cos and sin).
    static void angles(const Rope &r, const std::vector<float> &inv_freq, int64_t position, float *row) {
        const int64_t half = r.dims / 2;
        const float t = static_cast<float>(position) * r.position_scale;
        for (int64_t d = 0; d < half; ++d) {
            const float a = t * inv_freq[static_cast<size_t>(d)];
            row[d] = static_cast<float>(std::cos(static_cast<double>(a)));
            row[half + d] = static_cast<float>(std::sin(static_cast<double>(a)));
        }
    }
    // Rotates heads [0, heads) of D floats each in the row x, all at one position, whose
    // cosines are cs[0, half) and sines cs[half, 2 half). Each pair order has its own loop, with
    // its stride known, so the compiler vectorizes both (the same bits: one product each, then
    // one add or subtract, never contracted).
    // Cloned for AVX-512 and AVX2 (chosen at load time by the CPU; one copy under TSan, above);
    // products and sums are never contracted into FMAs (each product its own statement for clang,
    // whose contraction stays within one; GCC's is turned off), so every clone gives the same bits.
    MHA_ROPE_CLONES
    static void rope_rotate(bool interleaved, const float *cs, int64_t half, float *x, int64_t heads, int64_t D) {
        const float *c = cs, *s = cs + half;
        for (int64_t h = 0; h < heads; ++h) {
            float *y = x + h * D;
            if (interleaved) {  // pairs (y[2d], y[2d + 1])
                for (int64_t d = 0; d < half; ++d) {
                    const float x1 = y[2 * d], x2 = y[2 * d + 1];
                    const float x1c = x1 * c[d], x2s = x2 * s[d], x2c = x2 * c[d], x1s = x1 * s[d];
                    y[2 * d] = x1c - x2s;
                    y[2 * d + 1] = x2c + x1s;
                }
            } else {  // pairs (y[d], y[d + half])
                float *y2 = y + half;
                for (int64_t d = 0; d < half; ++d) {
                    const float x1 = y[d], x2 = y2[d];
                    const float x1c = x1 * c[d], x2s = x2 * s[d], x2c = x2 * c[d], x1s = x1 * s[d];
                    y[d] = x1c - x2s;
                    y2[d] = x2c + x1s;
                }
            }
        }
    }
};

} // namespace

struct Layer::Impl {
    LayerConfig cfg;
    int64_t nq = 0, nk = 0, nv = 0;  // output widths of the Q, K and V projections
    // With kdim = vdim = E the three input projections are one matrix, each starting on a panel
    // boundary (q at 0, k at k_off, v at v_off), so self-attention runs them as one GEMM and
    // cross-attention runs each on its own columns. Otherwise each has its own matrix, and the
    // offsets only place their biases in qkv_bias.
    bool fused = false;
    int64_t k_off = 0, v_off = 0, qkv_width = 0;
    int64_t qkv_ld = 0;  // the row stride of a [tokens, q | k | v] scratch: scratch_ld(qkv_width)
    gemm::PackedB qkv, k_alone, v_alone, out;
    std::vector<float> qkv_bias, out_bias;
    Projection q_proj, k_proj, v_proj, out_proj;
    std::vector<float> norm_weight, norm_bias;  // empty: 1 and 0
    std::vector<float> alibi, sinks;            // the variant's arrays, copied (cfg.variant points here)
    std::vector<float> inv_freq;                // RoPE: theta^(-2d/dims), d < dims/2

    // The angles of positions [0, rope_positions), built when a call first needs them and kept
    // (grown, never changed: a position's row is the same whenever it is computed), shared by
    // the calls of every host thread; positions from kRopeKept on get a table per call.
    static constexpr int64_t kRopeKept = int64_t{1} << 16;
    mutable std::shared_mutex rope_mutex;
    mutable std::vector<float> rope_cs;
    mutable int64_t rope_positions = 0;

    // Rotates q (rows q_ld apart, tokens nq) and k (rows k_ld apart, tokens nk) at their positions.
    void rope(int64_t nq_tokens, float *q, int64_t q_ld, const int64_t *q_pos, int64_t nk_tokens, float *k,
              int64_t k_ld, const int64_t *k_pos) const {
        if (cfg.rope.dims == 0 || (nq_tokens == 0 && nk_tokens == 0)) return;
        int64_t most = 0, least = 0;
        for (int64_t t = 0; t < nq_tokens; ++t) most = std::max(most, q_pos[t]), least = std::min(least, q_pos[t]);
        for (int64_t t = 0; t < nk_tokens; ++t) most = std::max(most, k_pos[t]), least = std::min(least, k_pos[t]);
        if (least >= 0 && most < kRopeKept) {
            const int64_t dims = cfg.rope.dims, half = dims / 2;
            auto rotate_all = [&] {
                for (int64_t t = 0; t < nq_tokens; ++t)
                    RopeTable::rope_rotate(cfg.rope.interleaved, rope_cs.data() + q_pos[t] * dims, half, q + t * q_ld,
                                           cfg.num_heads, cfg.head_dim);
                for (int64_t t = 0; t < nk_tokens; ++t)
                    RopeTable::rope_rotate(cfg.rope.interleaved, rope_cs.data() + k_pos[t] * dims, half, k + t * k_ld,
                                           cfg.num_kv_heads, cfg.head_dim);
            };
            {
                std::shared_lock read(rope_mutex);
                if (most < rope_positions) return rotate_all();
            }
            {
                std::unique_lock grow(rope_mutex);
                if (most >= rope_positions) {  // in powers of two, so a growing sequence rarely waits
                    const int64_t n =
                        std::min(kRopeKept, std::max<int64_t>(64, static_cast<int64_t>(std::bit_ceil(static_cast<uint64_t>(most + 1)))));
                    std::vector<float> grown(static_cast<size_t>(n * dims));  // a failed allocation changes nothing
                    std::copy(rope_cs.begin(), rope_cs.end(), grown.begin());
                    for (int64_t p = rope_positions; p < n; ++p) RopeTable::angles(cfg.rope, inv_freq, p, grown.data() + p * dims);
                    rope_cs.swap(grown);
                    rope_positions = n;
                }
            }
            std::shared_lock read(rope_mutex);
            return rotate_all();
        }
        std::vector<int64_t> all(q_pos, q_pos + nq_tokens);
        all.insert(all.end(), k_pos, k_pos + nk_tokens);
        const RopeTable table(cfg.rope, inv_freq, std::move(all));
        for (int64_t t = 0; t < nq_tokens; ++t)
            table.rotate(cfg.rope.interleaved, q_pos[t], q + t * q_ld, cfg.num_heads, cfg.head_dim);
        for (int64_t t = 0; t < nk_tokens; ++t)
            table.rotate(cfg.rope.interleaved, k_pos[t], k + t * k_ld, cfg.num_kv_heads, cfg.head_dim);
    }

    // Tokens per block of project_qkv with RoPE: 64 rows of q | k | v (E 512: 384 KiB) stay in L2
    // from the GEMM to the rotation. Zen 5, B8 L128 E512 H8, 1 thread: rotating after the whole
    // GEMM (6 MiB of rows, read back from L3) made RoPE 7% of the layer's time.
    static constexpr int64_t kRopeRows = 64;

    // The fused QKV projection of `tokens` rows of x (stride E) into rows (stride ld). With
    // positions (one per token, the same for its q and k), RoPE rotates each block of kRopeRows
    // tokens right after its GEMM, in the same pass. A row's projection has the same bits
    // however the rows are blocked (the GEMM's sums run over K in the packed weights' order).
    void project_qkv(detail::RuntimeState &st, int64_t tokens, const float *x, float *rows, int64_t ld,
                     const int64_t *positions) const {
        const float *bias = qkv_bias.empty() ? nullptr : qkv_bias.data();
        const int64_t E = cfg.embed_dim, block = positions ? kRopeRows : std::max<int64_t>(tokens, 1);
        const int64_t blocks = (tokens + block - 1) / block;
        auto run_block = [&](int64_t b, bool one_thread) {
            const int64_t t0 = b * block, n = std::min(block, tokens - t0);
            gemm::sgemm_prepacked(st, n, v_off + nv, x + t0 * E, E, qkv, 0, bias, rows + t0 * ld, ld, gemm::Epilogue::none,
                                  one_thread);
            if (positions) rope(n, rows + t0 * ld, ld, positions + t0, n, rows + t0 * ld + k_off, ld, positions + t0);
        };
        // With RoPE and several blocks, the threads take whole blocks (GEMM and rotation), so the
        // rotation is shared out too; each row's projection has the same bits either way.
        const int threads = blocks > 1 ? st.threads_for(2.0 * static_cast<double>(tokens) * static_cast<double>(v_off + nv) *
                                                            static_cast<double>(E),
                                                        st.tiles.parallel_min_flops)
                                       : 1;
        if (threads > 1) {
            st.arena->execute([&] {
                tbb::parallel_for(tbb::blocked_range<int64_t>(0, blocks, 1), [&](const tbb::blocked_range<int64_t> &r) {
                    for (int64_t b = r.begin(); b != r.end(); ++b) run_block(b, true);
                }, tbb::simple_partitioner());
            });
            return;
        }
        for (int64_t b = 0; b < blocks; ++b) run_block(b, false);
    }

    const float *norm_w() const { return norm_weight.empty() ? nullptr : norm_weight.data(); }
    const float *norm_b() const { return norm_bias.empty() ? nullptr : norm_bias.data(); }
    // Add & Norm after the output projection: out = LayerNorm(x + proj) (post) or x + proj (pre).
    void add_norm(detail::RuntimeState &st, int64_t rows, const float *x, const float *proj, float *out) const {
        layer_detail::add_norm_rows(st, cfg.norm == Norm::post, rows, cfg.embed_dim, x, cfg.embed_dim, proj,
                                    cfg.embed_dim, out, cfg.embed_dim, norm_w(), norm_b(), cfg.norm_eps);
    }
    // Whether the attention writes O over Q (in place, see attention.hpp): where each head's value
    // and query widths agree and no weights are asked for. O's rows then land where the attention
    // has just read Q, not in lines of their own that other work has pushed out of the caches by
    // the next call, and the scratch holds no O. Xeon, 1 thread, E512 H8, layer calls 25 ms apart,
    // the same bits: B8 L128 15.4 -> 14.8 ms, B4 L512 39.4 -> 37.4 ms.
    bool o_over_q(bool weights) const { return cfg.value_dim == cfg.head_dim && !weights; }

    // Self-attention over `tokens` rows of x (sequences as `attend` sees them): [pre-norm], the fused
    // QKV projection into [tokens, q | k | v], attend(qkv, o, ldo) writing O [tokens, H * Dv] (rows
    // ldo apart: over Q where Dv == Dqk, as in forward()), the output projection, [Add & Norm].
    // Scratch is borrowed before anything is written.
    // positions: each token's position for RoPE (NULL without it).
    template <class Attend>
    void self_rows(detail::RuntimeState &st, int64_t tokens, const float *x, float *y, const int64_t *positions,
                   const Attend &attend) const {
        const int64_t Hq = cfg.num_heads * cfg.value_dim, E = cfg.embed_dim;
        const bool over_q = o_over_q(false);
        const int64_t q_floats = product({tokens, qkv_ld}, "Q, K and V"),
                      o_floats = over_q ? 0 : product({tokens, Hq}, "O"), o_ld = over_q ? qkv_ld : Hq;
        const int64_t n_floats = cfg.norm != Norm::none ? product({tokens, E}, "out") : 0;  // as in forward()
        const int64_t xn_floats = cfg.norm == Norm::pre ? n_floats : 0;
        const bool own_proj = cfg.norm != Norm::none && overlaps(x, y, tokens, E);
        auto scratch = st.pool.borrow(static_cast<size_t>(q_floats + o_floats + (own_proj ? n_floats : 0) + xn_floats));
        float *rows = scratch.data(), *os = over_q ? rows : rows + q_floats, *xn = rows + q_floats + o_floats,
              *proj = own_proj ? xn + xn_floats : y;
        const float *residual = x;
        if (cfg.norm == Norm::pre && tokens) {
            pre_norm(st, tokens, x, xn);
            x = xn;
        }
        project_qkv(st, tokens, x, rows, qkv_ld, positions);
        attend(static_cast<const float *>(rows), os, o_ld);
        if (!tokens) return;
        if (cfg.norm == Norm::none) return gemm::sgemm_prepacked(st, tokens, E, os, o_ld, out, 0, out_proj.bias, y, E);
        gemm::sgemm_prepacked(st, tokens, E, os, o_ld, out, 0, out_proj.bias, proj, E);
        add_norm(st, tokens, residual, proj, y);
    }

    // Pre-norm's LayerNorm(x) into xn.
    void pre_norm(detail::RuntimeState &st, int64_t rows, const float *x, float *xn) const {
        layer_detail::add_norm_rows(st, true, rows, cfg.embed_dim, x, cfg.embed_dim, nullptr, 0, xn, cfg.embed_dim,
                                    norm_w(), norm_b(), cfg.norm_eps);
    }
};

LayerConfig LayerConfig::resolved() const {
    LayerConfig c = *this;
    positive("embed_dim", c.embed_dim);
    positive("num_heads", c.num_heads);
    for (auto [name, v] : {std::pair{"num_kv_heads", c.num_kv_heads}, {"head_dim", c.head_dim},
                           {"value_dim", c.value_dim}, {"kdim", c.kdim}, {"vdim", c.vdim}})
        if (v < 0) invalid_argument(std::string(name) + " = " + std::to_string(v) + " must be positive (or 0 for the default)");
    if (c.num_kv_heads == 0) c.num_kv_heads = c.num_heads;
    if (c.num_heads % c.num_kv_heads != 0)
        invalid_argument("num_heads = " + std::to_string(c.num_heads) + " is not a multiple of num_kv_heads = " +
                         std::to_string(c.num_kv_heads));
    if ((c.head_dim == 0 || c.value_dim == 0) && c.embed_dim % c.num_heads != 0)
        invalid_argument("embed_dim = " + std::to_string(c.embed_dim) + " is not a multiple of num_heads = " +
                         std::to_string(c.num_heads) + "; give head_dim and value_dim");
    if (c.head_dim == 0) c.head_dim = c.embed_dim / c.num_heads;
    if (c.value_dim == 0) c.value_dim = c.embed_dim / c.num_heads;
    if (c.weight_dtype == DType::bf16) throw Error(Status::unsupported, "weight_dtype MHA_BF16 is not supported yet");
    if (c.weight_dtype == DType::i8) throw Error(Status::unsupported, "weight_dtype MHA_I8 is for the kv cache only");
    if (c.weight_dtype != DType::f32)
        invalid_argument("weight_dtype = " + std::to_string(static_cast<int>(c.weight_dtype)) + " is not an mha_dtype");
    if (c.norm != Norm::none && c.norm != Norm::post && c.norm != Norm::pre)
        invalid_argument("norm = " + std::to_string(static_cast<int>(c.norm)) +
                         " is not an mha_norm (MHA_NORM_NONE, MHA_NORM_POST, MHA_NORM_PRE)");
    if (!std::isfinite(c.norm_eps) || c.norm_eps < 0.0f)
        invalid_argument("norm_eps = " + std::to_string(c.norm_eps) + " must be finite and >= 0 (0 = 1e-5)");
    if (c.norm_eps == 0.0f) c.norm_eps = 1e-5f;
    attention_variant_validate(c.variant, c.num_heads, "variant");
    if (c.rope.dims < 0 || c.rope.dims % 2 != 0 || c.rope.dims > c.head_dim)
        invalid_argument("rope.dims = " + std::to_string(c.rope.dims) + " must be even and in [0, head_dim = " +
                         std::to_string(c.head_dim) + "]");
    if (!std::isfinite(c.rope.theta) || c.rope.theta < 0.0f)
        invalid_argument("rope.theta = " + std::to_string(c.rope.theta) + " must be finite and > 0 (0 = 10000)");
    if (!std::isfinite(c.rope.position_scale) || c.rope.position_scale < 0.0f)
        invalid_argument("rope.position_scale = " + std::to_string(c.rope.position_scale) +
                         " must be finite and > 0 (0 = 1)");
    if (c.rope.theta == 0.0f) c.rope.theta = 10000.0f;
    if (c.rope.position_scale == 0.0f) c.rope.position_scale = 1.0f;
    if (c.kdim == 0) c.kdim = c.embed_dim;
    if (c.vdim == 0) c.vdim = c.embed_dim;
    product({c.num_heads, c.head_dim, c.embed_dim}, "q_weight");
    product({c.num_kv_heads, c.head_dim, c.kdim}, "k_weight");
    product({c.num_kv_heads, c.value_dim, c.vdim}, "v_weight");
    product({c.num_heads, c.value_dim, c.embed_dim}, "out_weight");
    product({c.num_heads + 2 * c.num_kv_heads, std::max(c.head_dim, c.value_dim) + 64, c.embed_dim}, "the fused QKV weights");
    return c;
}

LayerWeights LayerWeights::from_in_proj(const LayerConfig &config, const float *in_proj_weight,
                                        const float *in_proj_bias, const float *out_proj_weight,
                                        const float *out_proj_bias) {
    const LayerConfig c = config.resolved();
    const int64_t E = c.embed_dim;
    if (c.kdim != E || c.vdim != E || c.num_kv_heads != c.num_heads || c.head_dim * c.num_heads != E ||
        c.value_dim * c.num_heads != E)
        invalid_argument("in_proj_weight [3E, E] needs kdim = vdim = embed_dim, num_kv_heads = num_heads and "
                         "head_dim = value_dim = embed_dim / num_heads; pass q_weight, k_weight and v_weight instead");
    detail::check_not_null("in_proj_weight", in_proj_weight);
    LayerWeights w;
    w.q_weight = in_proj_weight;
    w.k_weight = in_proj_weight + E * E;
    w.v_weight = in_proj_weight + 2 * E * E;
    w.out_weight = out_proj_weight;
    if (in_proj_bias) {
        w.q_bias = in_proj_bias;
        w.k_bias = in_proj_bias + E;
        w.v_bias = in_proj_bias + 2 * E;
    }
    w.out_bias = out_proj_bias;
    return w;
}

Layer::Layer(Runtime &rt, const LayerConfig &config, const LayerWeights &w) : impl_(std::make_unique<Impl>()) {
    Impl &m = *impl_;
    m.cfg = config.resolved();
    const LayerConfig &c = m.cfg;
    detail::check_not_null("q_weight", w.q_weight);
    detail::check_not_null("k_weight", w.k_weight);
    detail::check_not_null("v_weight", w.v_weight);
    detail::check_not_null("out_weight", w.out_weight);
    auto &st = rt.state();
    const int64_t NR = st.sgemm->nr, E = c.embed_dim;
    m.nq = c.num_heads * c.head_dim;
    m.nk = c.num_kv_heads * c.head_dim;
    m.nv = c.num_kv_heads * c.value_dim;
    m.fused = c.kdim == E && c.vdim == E;

    // A weight W [n, in] is B = W^T to the GEMM: element (p, j) = W[j * in + p].
    auto pack = [&](const float *weight, int64_t n, int64_t in) { return gemm::pack_b(st, in, n, weight, 1, in); };
    // Where K's and V's columns start: on panel boundaries of the one fused matrix, or one after the
    // other in the bias vector when each projection has its own matrix.
    m.k_off = m.fused ? round_up(m.nq, NR) : m.nq;
    m.v_off = m.k_off + (m.fused ? round_up(m.nk, NR) : m.nk);
    m.qkv_width = m.v_off + (m.fused ? round_up(m.nv, NR) : m.nv);
    m.qkv_ld = scratch_ld(m.qkv_width);
    if (m.fused) {
        std::vector<float> stacked(static_cast<size_t>(m.qkv_width * E), 0.0f);  // zero rows between parts
        std::copy(w.q_weight, w.q_weight + m.nq * E, stacked.begin());
        std::copy(w.k_weight, w.k_weight + m.nk * E, stacked.begin() + m.k_off * E);
        std::copy(w.v_weight, w.v_weight + m.nv * E, stacked.begin() + m.v_off * E);
        m.qkv = pack(stacked.data(), m.qkv_width, E);
    } else {
        m.qkv = pack(w.q_weight, m.nq, E);
        m.k_alone = pack(w.k_weight, m.nk, c.kdim);
        m.v_alone = pack(w.v_weight, m.nv, c.vdim);
    }
    // One bias vector for the three, zero where a projection has none.
    if (w.q_bias || w.k_bias || w.v_bias) {
        m.qkv_bias.assign(static_cast<size_t>(m.qkv_width), 0.0f);
        if (w.q_bias) std::copy(w.q_bias, w.q_bias + m.nq, m.qkv_bias.begin());
        if (w.k_bias) std::copy(w.k_bias, w.k_bias + m.nk, m.qkv_bias.begin() + m.k_off);
        if (w.v_bias) std::copy(w.v_bias, w.v_bias + m.nv, m.qkv_bias.begin() + m.v_off);
    }
    const float *b = m.qkv_bias.data();
    m.q_proj = {&m.qkv, 0, m.nq, w.q_bias ? b : nullptr};
    m.k_proj = m.fused ? Projection{&m.qkv, m.k_off, m.nk, nullptr} : Projection{&m.k_alone, 0, m.nk, nullptr};
    m.v_proj = m.fused ? Projection{&m.qkv, m.v_off, m.nv, nullptr} : Projection{&m.v_alone, 0, m.nv, nullptr};
    if (w.k_bias) m.k_proj.bias = b + m.k_off;
    if (w.v_bias) m.v_proj.bias = b + m.v_off;
    m.out = pack(w.out_weight, E, c.num_heads * c.value_dim);
    if (w.out_bias) m.out_bias.assign(w.out_bias, w.out_bias + E);
    m.out_proj = {&m.out, 0, E, w.out_bias ? m.out_bias.data() : nullptr};
    if (w.norm_weight) m.norm_weight.assign(w.norm_weight, w.norm_weight + E);
    if (w.norm_bias) m.norm_bias.assign(w.norm_bias, w.norm_bias + E);
    if (c.variant.alibi_slopes) {
        m.alibi.assign(c.variant.alibi_slopes, c.variant.alibi_slopes + c.num_heads);
        m.cfg.variant.alibi_slopes = m.alibi.data();
    }
    if (c.variant.sink_logits) {
        m.sinks.assign(c.variant.sink_logits, c.variant.sink_logits + c.num_heads);
        m.cfg.variant.sink_logits = m.sinks.data();
    }
    for (int64_t d = 0; d < c.rope.dims / 2; ++d)  // as PyTorch: 1 / theta^(2d / dims) in fp32
        m.inv_freq.push_back(1.0f / std::pow(c.rope.theta, static_cast<float>(2 * d) / static_cast<float>(c.rope.dims)));
}

Layer::~Layer() = default;

const LayerConfig &Layer::config() const { return impl_->cfg; }

double Layer::flops(const LayerForward &p) const {
    const LayerConfig &c = impl_->cfg;
    const double B = static_cast<double>(p.batch), Lq = static_cast<double>(p.q_len),
                 Lk = static_cast<double>(p.kv_len);
    const double proj = 2.0 * B *
                        (Lq * static_cast<double>(impl_->nq * c.embed_dim) + Lk * static_cast<double>(impl_->nk * c.kdim) +
                         Lk * static_cast<double>(impl_->nv * c.vdim) +
                         Lq * static_cast<double>(c.embed_dim * c.num_heads * c.value_dim));
    const double attn = 2.0 * B * static_cast<double>(c.num_heads) * Lq * Lk * static_cast<double>(c.head_dim + c.value_dim);
    return proj + attn;
}

void Layer::forward(Runtime &rt, const LayerForward &p, const float *query, const float *key, const float *value,
                    float *out) const {
    const Impl &m = *impl_;
    const LayerConfig &c = m.cfg;
    detail::check_size("batch", p.batch);
    detail::check_size("q_len", p.q_len);
    detail::check_size("kv_len", p.kv_len);
    if (!key != !value) invalid_argument(std::string(key ? "value" : "key") + " is NULL but " + (key ? "key" : "value") +
                                         " is not (pass both, or neither for self-attention)");
    if (!key) key = value = query;
    const bool self = key == query && value == query;
    const int64_t kv_len = self && p.kv_len == 0 ? p.q_len : p.kv_len;
    if (self && kv_len != p.q_len)
        invalid_argument("kv_len = " + std::to_string(p.kv_len) + " but self-attention has q_len = " +
                         std::to_string(p.q_len) + " keys");
    if (self && (c.kdim != c.embed_dim || c.vdim != c.embed_dim))
        invalid_argument("self-attention needs kdim = vdim = embed_dim; pass key and value");
    const int64_t q_tokens = product({p.batch, p.q_len}, "query"), kv_tokens = product({p.batch, kv_len}, "key");
    const int64_t Hq = product({c.num_heads, c.value_dim}, "out");
    if (q_tokens) {
        detail::check_matrix("query", "embed_dim", query, q_tokens, c.embed_dim, c.embed_dim);
        detail::check_matrix("out", "embed_dim", out, q_tokens, c.embed_dim, c.embed_dim);
    }
    if (kv_tokens && !self) {
        detail::check_matrix("key", "kdim", key, kv_tokens, c.kdim, c.kdim);
        detail::check_matrix("value", "vdim", value, kv_tokens, c.vdim, c.vdim);
    }

    // Scratch: the projections (self-attention: one [tokens, q | k | v] matrix; otherwise Q, then
    // K and V) and, unless it goes over Q (see o_over_q), the attention's output O, all borrowed
    // before anything is written.
    auto &st = rt.state();
    const bool one_gemm = self && m.fused;
    const int64_t q_ld = one_gemm ? m.qkv_ld : scratch_ld(round_up(m.nq, 16));
    const int64_t kv_ld = one_gemm ? m.qkv_ld : scratch_ld(round_up(m.nk, 16) + round_up(m.nv, 16));
    const bool over_q = m.o_over_q(p.weights != nullptr);
    const int64_t q_floats = product({q_tokens, q_ld}, "Q"), kv_floats = one_gemm ? 0 : product({kv_tokens, kv_ld}, "K and V"),
                  o_floats = over_q ? 0 : product({q_tokens, Hq}, "O"), o_ld = over_q ? q_ld : Hq;
    AttentionParams ap;
    ap.batch = p.batch;
    ap.q_len = p.q_len;
    ap.kv_len = kv_len;
    ap.num_heads = c.num_heads;
    ap.num_kv_heads = c.num_kv_heads;
    ap.head_dim = c.head_dim;
    ap.value_dim = c.value_dim;
    ap.causal = p.causal;
    ap.kv_valid_lens = p.kv_valid_lens;
    ap.mask = p.mask;
    ap.mask_batch_stride = p.mask_batch_stride;
    ap.mask_row_stride = p.mask_row_stride;
    ap.weights = p.weights;
    ap.variant = c.variant;
    ap.q_stride = q_ld;
    ap.k_stride = ap.v_stride = kv_ld;
    ap.out_stride = o_ld;
    if (q_tokens == 0) {  // nothing to compute: check the masks and valid lengths all the same
        const float none = 0.0f;
        return attention_validate(ap, &none, &none, &none, &none);
    }

    // With Add & Norm: the output projection goes straight to out, which the row pass then turns
    // into LayerNorm(query + out), unless out shares memory with the query (then to a buffer of
    // its own); pre-norm adds LayerNorm(query), which self-attention also takes as key and value.
    const bool own_proj = c.norm != Norm::none && overlaps(out, query, q_tokens, c.embed_dim);
    const int64_t n_floats = c.norm != Norm::none ? product({q_tokens, c.embed_dim}, "out") : 0;
    const int64_t xn_floats = c.norm == Norm::pre ? n_floats : 0;
    auto scratch = st.pool.borrow(
        static_cast<size_t>(q_floats + kv_floats + o_floats + (own_proj ? n_floats : 0) + xn_floats));
    float *qs = scratch.data(), *ks = one_gemm ? qs + m.k_off : qs + q_floats, *vs = one_gemm ? qs + m.v_off
                                                                                            : ks + round_up(m.nk, 16);
    float *os = over_q ? qs : qs + q_floats + kv_floats, *xn = qs + q_floats + kv_floats + o_floats,
          *proj = own_proj ? xn + xn_floats : out;
    attention_validate(ap, qs, ks, vs, os);  // the masks and valid lengths, before anything is written
    const float *residual = query;
    if (c.norm == Norm::pre) {
        m.pre_norm(st, q_tokens, query, xn);
        query = xn;
        if (self) key = value = xn;
    }

    auto project = [&](const Projection &pr, int64_t tokens, const float *x, int64_t in, float *y, int64_t ldy) {
        gemm::sgemm_prepacked(st, tokens, pr.n, x, in, *pr.packed, pr.j0, pr.bias, y, ldy);
    };
    std::vector<int64_t> qp, kp;  // RoPE: query i at i + kv_len - q_len, key j at j, in every batch
    if (c.rope.dims) {
        qp.resize(static_cast<size_t>(q_tokens));
        kp.resize(static_cast<size_t>(kv_tokens));
        for (int64_t t = 0; t < q_tokens; ++t) qp[static_cast<size_t>(t)] = t % p.q_len + kv_len - p.q_len;
        for (int64_t t = 0; t < kv_tokens; ++t) kp[static_cast<size_t>(t)] = t % kv_len;
    }
    if (one_gemm) {
        // Q, K and V in one GEMM: every column of the fused matrix, the gaps between parts included.
        // Self-attention: a token's q and k share its position, so RoPE goes block by block with it.
        m.project_qkv(st, q_tokens, query, qs, q_ld, c.rope.dims ? qp.data() : nullptr);
    } else {
        project(m.q_proj, q_tokens, query, c.embed_dim, qs, q_ld);
        if (kv_tokens) {
            project(m.k_proj, kv_tokens, key, c.kdim, ks, kv_ld);
            project(m.v_proj, kv_tokens, value, c.vdim, vs, kv_ld);
        }
    }
    if (c.rope.dims && !one_gemm) m.rope(q_tokens, qs, q_ld, qp.data(), kv_tokens, ks, kv_ld, kp.data());
    attention(rt, ap, qs, ks, vs, os);
    if (c.norm == Norm::none) return project(m.out_proj, q_tokens, os, o_ld, out, c.embed_dim);
    project(m.out_proj, q_tokens, os, o_ld, proj, c.embed_dim);
    m.add_norm(st, q_tokens, residual, proj, out);
}

void Layer::forward_cached(Runtime &rt, KVCache &cache, const LayerCachedForward &p, const float *x,
                           float *out) const {
    KVCache::Impl::AppendUndo appended;
    layer_detail::forward_cached_undoable(*this, rt, cache, p, x, out, appended);
}

void layer_detail::forward_cached_undoable(const Layer &layer, Runtime &rt, KVCache &cache, const LayerCachedForward &p,
                                           const float *x, float *out, KVCache::Impl::AppendUndo &appended) {
    const Layer::Impl &m = layer.impl();
    const LayerConfig &c = m.cfg;
    KVCache::Impl &kc = cache.impl();
    const KVCacheConfig &cc = kc.cfg;
    auto &st = rt.state();
    if (!m.fused) invalid_argument("forward_cached needs a self-attention layer (kdim = vdim = embed_dim)");
    if (cc.num_kv_heads != c.num_kv_heads || cc.head_dim != c.head_dim || cc.value_dim != c.value_dim)
        invalid_argument("the kv cache holds num_kv_heads = " + std::to_string(cc.num_kv_heads) + ", head_dim = " +
                         std::to_string(cc.head_dim) + ", value_dim = " + std::to_string(cc.value_dim) +
                         " but the layer has " + std::to_string(c.num_kv_heads) + ", " + std::to_string(c.head_dim) +
                         ", " + std::to_string(c.value_dim));
    kc.check_runtime(st);
    const int64_t tokens = detail::check_offsets("q_offsets", p.q_offsets, p.num_seqs);
    if (p.num_seqs > 0) detail::check_not_null("seq_ids", p.seq_ids);
    std::unordered_set<int64_t> seen;
    for (int64_t s = 0; s < p.num_seqs; ++s) {
        if (p.seq_ids[s] < 0) invalid_argument("seq_ids[" + std::to_string(s) + "] = " + std::to_string(p.seq_ids[s]) + " is negative");
        if (!seen.insert(p.seq_ids[s]).second)
            invalid_argument("seq_ids[" + std::to_string(s) + "] = " + std::to_string(p.seq_ids[s]) + " appears twice");
    }
    if (tokens) {
        detail::check_matrix("x", "embed_dim", x, tokens, c.embed_dim, c.embed_dim);
        detail::check_matrix("out", "embed_dim", out, tokens, c.embed_dim, c.embed_dim);
    }
    // Whatever fails after the append (the memory for the attention or the output projection)
    // takes it back, so a failed call leaves the cache as it found it.
    // RoPE: a new token's position is its index in its sequence (the cached length before it).
    std::vector<int64_t> positions;
    if (c.rope.dims) {
        positions.resize(static_cast<size_t>(tokens));
        for (int64_t s = 0; s < p.num_seqs; ++s) {
            const int64_t base = cache.contains(p.seq_ids[s]) ? cache.seq_len(p.seq_ids[s]) : 0;
            for (int64_t t = p.q_offsets[s]; t < p.q_offsets[s + 1]; ++t)
                positions[static_cast<size_t>(t)] = base + t - p.q_offsets[s];
        }
    }
    auto append_and_attend = [&](const float *qkv, float *os, int64_t o_ld) {
        // Every sequence's K and V go in, or (not enough free blocks) none and nothing is written.
        std::vector<KVCache::Impl::Append> appends;
        for (int64_t s = 0; s < p.num_seqs; ++s) {
            // With no tokens in the call there is no qkv buffer (null): no pointer arithmetic on it.
            const float *row = qkv ? qkv + p.q_offsets[s] * m.qkv_ld : nullptr;
            appends.push_back({p.seq_ids[s], p.q_offsets[s + 1] - p.q_offsets[s], row ? row + m.k_off : nullptr,
                               row ? row + m.v_off : nullptr, m.qkv_ld, m.qkv_ld});
        }
        appended = kc.append_all(appends);
        if (!tokens) return;
        CachedParams ap;
        ap.num_seqs = p.num_seqs;
        ap.seq_ids = p.seq_ids;
        ap.q_offsets = p.q_offsets;
        ap.num_heads = c.num_heads;
        ap.causal = p.causal;
        ap.variant = c.variant;
        ap.q_stride = m.qkv_ld;
        ap.out_stride = o_ld;
        attention_cached(rt, cache, ap, qkv, os);
    };
    try {
        m.self_rows(st, tokens, x, out, c.rope.dims ? positions.data() : nullptr, append_and_attend);
    } catch (...) {
        kc.undo(appended);
        appended = KVCache::Impl::AppendUndo{};  // taken back: nothing left for the caller to undo
        throw;
    }
}

void Layer::forward_varlen(Runtime &rt, const LayerVarlenForward &p, const float *x, float *out) const {
    const Impl &m = *impl_;
    const LayerConfig &c = m.cfg;
    auto &st = rt.state();
    if (!m.fused) invalid_argument("forward_varlen needs a self-attention layer (kdim = vdim = embed_dim)");
    const int64_t tokens = detail::check_offsets("offsets", p.offsets, p.num_seqs);
    VarlenParams ap;
    ap.num_seqs = p.num_seqs;
    ap.q_offsets = ap.kv_offsets = p.offsets;
    ap.num_heads = c.num_heads;
    ap.num_kv_heads = c.num_kv_heads;
    ap.head_dim = c.head_dim;
    ap.value_dim = c.value_dim;
    ap.causal = p.causal;
    ap.variant = c.variant;
    ap.q_stride = ap.k_stride = ap.v_stride = m.qkv_ld;
    ap.out_stride = product({c.num_heads, c.value_dim}, "out");
    // The offsets and sizes, before anything is written (the tensors are checked below).
    const float none = 0.0f;
    float sink = 0.0f;
    attention_varlen_validate(ap, &none, &none, &none, &sink);
    if (tokens) {
        detail::check_matrix("x", "embed_dim", x, tokens, c.embed_dim, c.embed_dim);
        detail::check_matrix("out", "embed_dim", out, tokens, c.embed_dim, c.embed_dim);
    }
    std::vector<int64_t> positions;  // RoPE: a token's index in its sequence
    if (c.rope.dims) {
        positions.resize(static_cast<size_t>(tokens));
        for (int64_t s = 0; s < p.num_seqs; ++s)
            for (int64_t t = p.offsets[s]; t < p.offsets[s + 1]; ++t) positions[static_cast<size_t>(t)] = t - p.offsets[s];
    }
    m.self_rows(st, tokens, x, out, c.rope.dims ? positions.data() : nullptr, [&](const float *qkv, float *os, int64_t o_ld) {
        ap.out_stride = o_ld;
        if (tokens) attention_varlen(rt, ap, qkv, qkv + m.k_off, qkv + m.v_off, os);
    });
}

} // namespace mha
