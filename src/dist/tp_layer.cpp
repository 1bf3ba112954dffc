// mha::TpLayer: the layer's heads sharded across MPI ranks (Megatron-LM's tensor parallelism of
// attention: Shoeybi et al., 2019). Each rank holds an mha::Layer of its heads, without the output
// bias and the norm; a forward call is
//   1. local: this rank's P_r = O_r Wo_r^T [tokens, E] into the layer's own buffer (nothing of the
//      caller's is written), errors caught;
//   2. agree: one MPI_Allreduce of the status and the call's shape, so a failing rank makes every
//      rank fail, before any data moves;
//   3. reduce: an MPI_Alltoallv hands row block c of every P_r to rank c, which sums the N blocks in
//      rank order, adds the bias and applies Add & Norm to its rows; an MPI_Allgatherv gives every
//      rank the whole output.
// The sum is ours, in a fixed order, never MPI_Allreduce's (whose order depends on the algorithm
// and the rank count MPI picks), so the bits do not depend on MPI.
#include "mha/tp_layer.hpp"

#include <algorithm>
#include <array>
#include <bit>
#include <chrono>
#include <climits>
#include <cstring>
#include <new>
#include <optional>
#include <string>
#include <vector>

#include "dist/tp_internal.hpp"
#include "layer/layer_cached.hpp"
#include "layer/norm.hpp"
#include "runtime/runtime_state.hpp"
#include "runtime/validate.hpp"
#include "serving/kv_cache_impl.hpp"

namespace mha {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

[[noreturn]] void mpi_failed(const char *call, int rc) {
    char text[MPI_MAX_ERROR_STRING];
    int len = 0;
    if (MPI_Error_string(rc, text, &len) != MPI_SUCCESS) len = 0;
    throw Error(Status::internal, std::string(call) + " failed: " + std::string(text, static_cast<size_t>(len)));
}

void check_mpi(int rc, const char *call) {
    if (rc != MPI_SUCCESS) mpi_failed(call, rc);
}

std::string rank_name(int rank, int size) { return "rank " + std::to_string(rank) + " of " + std::to_string(size); }

int64_t product(int64_t a, int64_t b, const char *what) {
    int64_t p;
    if (__builtin_mul_overflow(a, b, &p) || p > INT64_MAX / 16) invalid_argument(std::string(what) + ": the sizes overflow");
    return p;
}

// FNV-1a over 64-bit values: a fingerprint of a call's sequences, compared across the ranks.
struct Fingerprint {
    uint64_t h = 1469598103934665603ull;
    void add(int64_t v) {
        for (int i = 0; i < 8; ++i) {
            h ^= static_cast<uint64_t>(v >> (8 * i)) & 0xffu;
            h *= 1099511628211ull;
        }
    }
    int64_t value() const { return static_cast<int64_t>(h >> 1); }
};

// Runs fn, turning what it throws into the Error every rank will agree on.
template <class Fn>
std::optional<Error> attempt(Fn &&fn) {
    try {
        fn();
        return std::nullopt;
    } catch (const Error &e) {
        return e;
    } catch (const std::bad_alloc &) {
        return Error(Status::out_of_memory, "out of memory");
    } catch (const std::exception &e) {
        return Error(Status::internal, std::string("internal error: ") + e.what());
    }
}

constexpr int kKeys = 8;  // what the ranks compare about a call, besides its status
using CallKey = std::array<int64_t, kKeys>;
using KeyNames = std::array<const char *, kKeys>;

// The duplicated communicator and the row type, freed when the layer goes (unless MPI has been
// finalized by then: freeing them would be erroneous, and the process is ending anyway).
struct CommHandle {
    MPI_Comm comm = MPI_COMM_NULL;
    MPI_Datatype row = MPI_DATATYPE_NULL;
    ~CommHandle() {
        int finalized = 0;
        MPI_Finalized(&finalized);
        if (finalized) return;
        if (row != MPI_DATATYPE_NULL) MPI_Type_free(&row);
        if (comm != MPI_COMM_NULL) MPI_Comm_free(&comm);
    }
};

// MPI must be running and comm usable before a rank can take part in anything.
void check_comm(MPI_Comm comm) {
    int up = 0, down = 0;
    MPI_Initialized(&up);
    MPI_Finalized(&down);
    if (!up) invalid_argument("MPI is not initialized: call MPI_Init (or MPI_Init_thread) before building a sharded layer");
    if (down) invalid_argument("MPI is finalized: a sharded layer cannot be built after MPI_Finalize");
    if (comm == MPI_COMM_NULL) invalid_argument("comm is MPI_COMM_NULL");
    int inter = 0;
    check_mpi(MPI_Comm_test_inter(comm, &inter), "MPI_Comm_test_inter");
    if (inter) invalid_argument("comm is an intercommunicator; the layer needs an intracommunicator");
}

// Step 2 of every collective call: one MPI_Allreduce (MAX over each value and its negation, so
// both the largest and the smallest) of [failing rank, key...]. Returns if every rank succeeded
// and every key agrees; otherwise throws the agreed error on every rank, the lowest failing rank's
// status and message broadcast from it.
void agree(MPI_Comm comm, int rank, int size, const std::optional<Error> &failed, const CallKey &key,
           const KeyNames &names) {
    std::array<int64_t, 2 * (kKeys + 1)> v{};
    v[0] = failed ? size - rank : 0;
    v[kKeys + 1] = -v[0];
    for (int i = 0; i < kKeys; ++i) {
        v[static_cast<size_t>(1 + i)] = key[static_cast<size_t>(i)];
        v[static_cast<size_t>(kKeys + 2 + i)] = key[static_cast<size_t>(i)] == INT64_MIN ? INT64_MAX : -key[static_cast<size_t>(i)];
    }
    check_mpi(MPI_Allreduce(MPI_IN_PLACE, v.data(), static_cast<int>(v.size()), MPI_INT64_T, MPI_MAX, comm),
              "MPI_Allreduce (the ranks' status)");
    if (v[0] > 0) {
        const int root = size - static_cast<int>(v[0]);
        std::string text = rank == root ? std::string(failed->what()).substr(0, 4096) : std::string();
        int64_t head[2] = {rank == root ? static_cast<int64_t>(failed->status()) : 0, static_cast<int64_t>(text.size())};
        check_mpi(MPI_Bcast(head, 2, MPI_INT64_T, root, comm), "MPI_Bcast (the failing rank's status)");
        text.resize(static_cast<size_t>(head[1]));
        if (head[1] > 0)
            check_mpi(MPI_Bcast(text.data(), static_cast<int>(head[1]), MPI_CHAR, root, comm),
                      "MPI_Bcast (the failing rank's message)");
        if (failed) throw Error(failed->status(), rank_name(rank, size) + ": " + failed->what());
        throw Error(static_cast<Status>(head[0]), rank_name(root, size) + ": " + text);
    }
    for (int i = 0; i < kKeys; ++i) {
        const int64_t hi = v[static_cast<size_t>(1 + i)], lo = -v[static_cast<size_t>(kKeys + 2 + i)];
        if (hi != lo)
            invalid_argument(std::string("the ranks' calls disagree on ") + names[static_cast<size_t>(i)] + " (from " +
                             std::to_string(lo) + " to " + std::to_string(hi) + " across the " + std::to_string(size) +
                             " ranks); every rank must make the same call");
    }
}

} // namespace

TpShard tp_shard_for(const LayerConfig &config, int rank, int size) {
    const LayerConfig c = config.resolved();
    if (size < 1) invalid_argument("size = " + std::to_string(size) + " must be positive");
    if (rank < 0 || rank >= size)
        invalid_argument("rank = " + std::to_string(rank) + " is not in [0, " + std::to_string(size) + ")");
    if (c.num_kv_heads % size != 0) {
        std::string fits;
        for (int64_t d = 1; d <= std::min<int64_t>(c.num_kv_heads, 4096); ++d)
            if (c.num_kv_heads % d == 0) fits += (fits.empty() ? "" : ", ") + std::to_string(d);
        invalid_argument("num_kv_heads = " + std::to_string(c.num_kv_heads) + " (num_heads = " + std::to_string(c.num_heads) +
                         ") cannot be split over " + std::to_string(size) +
                         " ranks: each rank holds whole KV head groups, the same number each, so the rank count must "
                         "divide num_kv_heads (run on " + fits + (c.num_kv_heads > 4096 ? ", ..." : "") + " ranks)");
    }
    TpShard s;
    s.rank = rank;
    s.size = size;
    const int64_t group = c.num_heads / c.num_kv_heads;
    s.num_kv_heads = c.num_kv_heads / size;
    s.kv_head_begin = rank * s.num_kv_heads;
    s.num_heads = s.num_kv_heads * group;
    s.head_begin = s.kv_head_begin * group;
    return s;
}

struct TpLayer::Impl {
    CommHandle h;
    int rank = 0, size = 1;
    LayerConfig cfg;  // the full layer's, resolved
    TpShard shard;
    std::unique_ptr<Layer> local;
    std::vector<float> out_bias, norm_weight, norm_bias;  // empty: none, 1 and 0

    // Calls are one at a time per layer (the contract of mha_tp.h), so their buffers and counters
    // live here and grow to the largest call.
    mutable detail::AlignedBuffer partial, received, xn, probs, probs_all;
    mutable std::vector<int> send_counts, send_displs, recv_counts, recv_displs, block_counts, block_displs;
    mutable TpTiming timing;
    mutable double comm_s = 0, wait_s = 0;

    int64_t row_begin(int64_t rows, int c) const { return rows * c / size; }

    template <class Fn>
    void timed(Fn &&fn) const {
        const auto t0 = Clock::now();
        fn();
        comm_s += seconds_since(t0);
    }

    // The agreement is the first MPI call after this rank's heads: its time is mostly the wait for
    // the slowest rank, counted apart (wait_s) as well as in the communication.
    void agree_call(const std::optional<Error> &failed, const CallKey &key, const KeyNames &names) const {
        const auto t0 = Clock::now();
        auto count = [&] {
            const double dt = seconds_since(t0);
            comm_s += dt;
            wait_s += dt;
        };
        try {
            agree(h.comm, rank, size, failed, key, names);
        } catch (...) {
            count();
            throw;
        }
        count();
    }

    // Step 1's buffers for `rows` output rows (and the probabilities), reserved before anything runs
    // so that running out of memory is a local failure the ranks agree on.
    void reserve(int64_t rows, int64_t prob_floats) const {
        const int64_t E = cfg.embed_dim;
        if (rows > INT_MAX)
            throw Error(Status::unsupported, std::to_string(rows) + " rows are more than one MPI message counts (" +
                                                 std::to_string(INT_MAX) + "); split the call");
        partial.reserve(static_cast<size_t>(product(rows, E, "out")));
        const int64_t mine = row_begin(rows, rank + 1) - row_begin(rows, rank);
        if (size > 1) received.reserve(static_cast<size_t>(product(product(mine, E, "out"), size, "out")));
        if (prob_floats) {
            probs.reserve(static_cast<size_t>(prob_floats));
            if (size > 1) probs_all.reserve(static_cast<size_t>(product(prob_floats, size, "weights")));
        }
    }

    // Pre-norm: LayerNorm(x) as the unsharded layer computes it, the shard's input.
    const float *normed_input(detail::RuntimeState &st, int64_t rows, const float *x) const {
        if (cfg.norm != Norm::pre || rows == 0) return x;
        detail::check_matrix("query", "embed_dim", x, rows, cfg.embed_dim, cfg.embed_dim);
        xn.reserve(static_cast<size_t>(product(rows, cfg.embed_dim, "query")));
        layer_detail::add_norm_rows(st, true, rows, cfg.embed_dim, x, cfg.embed_dim, nullptr, 0, xn.data(), cfg.embed_dim,
                                    norm_weight.empty() ? nullptr : norm_weight.data(),
                                    norm_bias.empty() ? nullptr : norm_bias.data(), cfg.norm_eps);
        return xn.data();
    }

    // Step 3: out[rows, E] = Add & Norm(x, sum of every rank's partial in rank order + bias).
    void reduce(detail::RuntimeState &st, int64_t rows, const float *x, float *out) const {
        if (rows == 0) return;
        const int64_t E = cfg.embed_dim, r0 = row_begin(rows, rank), mine = row_begin(rows, rank + 1) - r0;
        const float *parts = partial.data() + r0 * E;  // block p of rank p's partial, blocks mine * E apart
        int64_t part_stride = 0;
        if (size > 1) {
            for (int c = 0; c < size; ++c) {
                const int64_t c0 = row_begin(rows, c), c1 = row_begin(rows, c + 1);
                send_counts[static_cast<size_t>(c)] = static_cast<int>(c1 - c0);
                send_displs[static_cast<size_t>(c)] = static_cast<int>(c0);
                recv_counts[static_cast<size_t>(c)] = static_cast<int>(mine);
                recv_displs[static_cast<size_t>(c)] = static_cast<int>(mine * c);
            }
            timed([&] {
                check_mpi(MPI_Alltoallv(partial.data(), send_counts.data(), send_displs.data(), h.row, received.data(),
                                        recv_counts.data(), recv_displs.data(), h.row, h.comm),
                          "MPI_Alltoallv (the partial output projections)");
            });
            parts = received.data();
            part_stride = mine * E;
        }
        // (((P_0 + P_1) + ...) + P_{N-1}) + bo, row by row; with a norm into a buffer (the first
        // block), then Add & Norm with the rows of x as the unsharded layer does it.
        const float *bias = out_bias.empty() ? nullptr : out_bias.data();
        float *sum = cfg.norm == Norm::none ? out + r0 * E : const_cast<float *>(parts);
        for (int64_t i = 0; i < mine; ++i) {
            float *s = sum + i * E;
            const float *p0 = parts + i * E;
            if (s != p0) std::copy(p0, p0 + E, s);
            for (int c = 1; c < size; ++c) {
                const float *pc = parts + c * part_stride + i * E;
                for (int64_t j = 0; j < E; ++j) s[j] += pc[j];
            }
            if (bias)
                for (int64_t j = 0; j < E; ++j) s[j] += bias[j];
        }
        if (cfg.norm != Norm::none && mine)
            layer_detail::add_norm_rows(st, cfg.norm == Norm::post, mine, E, x + r0 * E, E, sum, E, out + r0 * E, E,
                                        norm_weight.empty() ? nullptr : norm_weight.data(),
                                        norm_bias.empty() ? nullptr : norm_bias.data(), cfg.norm_eps);
        if (size > 1)
            timed([&] {
                for (int c = 0; c < size; ++c) {
                    block_counts[static_cast<size_t>(c)] = send_counts[static_cast<size_t>(c)];
                    block_displs[static_cast<size_t>(c)] = send_displs[static_cast<size_t>(c)];
                }
                check_mpi(MPI_Allgatherv(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, out, block_counts.data(), block_displs.data(),
                                         h.row, h.comm),
                          "MPI_Allgatherv (the output)");
            });
    }

    // Every rank's head probabilities [batch, Hr, Lq, Lk] into weights [batch, H, Lq, Lk].
    void gather_probs(int64_t batch, int64_t q_len, int64_t kv_len, float *weights) const {
        const int64_t Hr = shard.num_heads, per_b = Hr * q_len * kv_len, n = batch * per_b;
        if (n == 0) return;
        if (size == 1) {
            std::copy(probs.data(), probs.data() + n, weights);
            return;
        }
        timed([&] {
            // Rows of kv_len floats: counts stay in an int for any single-rank share that fits memory.
            MPI_Datatype key_row;
            check_mpi(MPI_Type_contiguous(static_cast<int>(kv_len), MPI_FLOAT, &key_row), "MPI_Type_contiguous");
            check_mpi(MPI_Type_commit(&key_row), "MPI_Type_commit");
            const int rc = MPI_Allgather(probs.data(), static_cast<int>(batch * Hr * q_len), key_row, probs_all.data(),
                                         static_cast<int>(batch * Hr * q_len), key_row, h.comm);
            MPI_Type_free(&key_row);
            check_mpi(rc, "MPI_Allgather (the attention weights)");
        });
        for (int c = 0; c < size; ++c)
            for (int64_t b = 0; b < batch; ++b) {
                const float *from = probs_all.data() + (c * batch + b) * per_b;
                std::copy(from, from + per_b, weights + (b * cfg.num_heads + c * Hr) * q_len * kv_len);
            }
    }

    // One forward call's timing, kept when it ends (by an error too).
    struct Call {
        const Impl &m;
        Clock::time_point t0 = Clock::now();
        explicit Call(const Impl &impl) : m(impl) { m.comm_s = m.wait_s = 0; }
        ~Call() {
            m.timing.calls += 1;
            m.timing.seconds += seconds_since(t0);
            m.timing.comm_seconds += m.comm_s;
            m.timing.wait_seconds += m.wait_s;
        }
    };
};

namespace tp_detail {

[[noreturn]] void create_failed(MPI_Comm comm, const Error &e) {
    check_comm(comm);
    CommHandle h;
    check_mpi(MPI_Comm_dup(comm, &h.comm), "MPI_Comm_dup");
    check_mpi(MPI_Comm_set_errhandler(h.comm, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
    int rank = 0, size = 1;
    MPI_Comm_rank(h.comm, &rank);
    MPI_Comm_size(h.comm, &size);
    agree(h.comm, rank, size, e, CallKey{}, KeyNames{});
    throw e;  // not reached: agree() throws for a failed rank
}

} // namespace tp_detail

TpLayer::TpLayer(Runtime &rt, MPI_Comm comm, const LayerConfig &config, const LayerWeights &w, Weights from)
    : impl_(std::make_unique<Impl>()) {
    Impl &m = *impl_;
    check_comm(comm);
    check_mpi(MPI_Comm_dup(comm, &m.h.comm), "MPI_Comm_dup");
    check_mpi(MPI_Comm_set_errhandler(m.h.comm, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
    MPI_Comm_rank(m.h.comm, &m.rank);
    MPI_Comm_size(m.h.comm, &m.size);

    CallKey key{};
    const std::optional<Error> failed = attempt([&] {
        m.cfg = config.resolved();
        const LayerConfig &c = m.cfg;
        key = {c.embed_dim, c.num_heads, c.num_kv_heads, c.head_dim, c.value_dim, c.kdim, c.vdim,
               (static_cast<int64_t>(c.norm) << 32) | std::bit_cast<uint32_t>(c.norm_eps)};
        m.shard = tp_shard_for(c, m.rank, m.size);
        const TpShard &s = m.shard;
        const int64_t E = c.embed_dim, Hv = c.num_heads * c.value_dim, Hr_v = s.num_heads * c.value_dim;
        for (auto [name, p] : {std::pair{"q_weight", w.q_weight}, {"k_weight", w.k_weight}, {"v_weight", w.v_weight},
                               {"out_weight", w.out_weight}})
            detail::check_not_null(name, p);

        LayerConfig lc = c;
        lc.num_heads = s.num_heads;
        lc.num_kv_heads = s.num_kv_heads;
        lc.norm = Norm::none;
        // The per-head modifiers (always the full layer's [num_heads]) follow the rank's heads; the
        // rank's layer copies them when it is built.
        if (c.variant.alibi_slopes) lc.variant.alibi_slopes = c.variant.alibi_slopes + s.head_begin;
        if (c.variant.sink_logits) lc.variant.sink_logits = c.variant.sink_logits + s.head_begin;
        LayerWeights lw;
        std::vector<float> out_cols;
        if (from == Weights::shard) {
            lw = w;
        } else {
            // Rank r's heads are contiguous rows of W_q, W_k, W_v (and their biases) and columns of W_o.
            const int64_t q0 = s.head_begin * c.head_dim, k0 = s.kv_head_begin * c.head_dim,
                          v0 = s.kv_head_begin * c.value_dim;
            lw.q_weight = w.q_weight + q0 * E;
            lw.k_weight = w.k_weight + k0 * c.kdim;
            lw.v_weight = w.v_weight + v0 * c.vdim;
            if (w.q_bias) lw.q_bias = w.q_bias + q0;
            if (w.k_bias) lw.k_bias = w.k_bias + k0;
            if (w.v_bias) lw.v_bias = w.v_bias + v0;
            out_cols.resize(static_cast<size_t>(E * Hr_v));
            for (int64_t e = 0; e < E; ++e)
                std::copy_n(w.out_weight + e * Hv + s.head_begin * c.value_dim, Hr_v, out_cols.begin() + e * Hr_v);
            lw.out_weight = out_cols.data();
        }
        lw.out_bias = lw.norm_weight = lw.norm_bias = nullptr;
        m.local = std::make_unique<Layer>(rt, lc, lw);
        if (w.out_bias) m.out_bias.assign(w.out_bias, w.out_bias + E);
        if (c.norm != Norm::none) {
            if (w.norm_weight) m.norm_weight.assign(w.norm_weight, w.norm_weight + E);
            if (w.norm_bias) m.norm_bias.assign(w.norm_bias, w.norm_bias + E);
        }
        for (auto *v : {&m.send_counts, &m.send_displs, &m.recv_counts, &m.recv_displs, &m.block_counts, &m.block_displs})
            v->assign(static_cast<size_t>(m.size), 0);
        if (E > INT_MAX) throw Error(Status::unsupported, "embed_dim is more than an MPI datatype counts");
        check_mpi(MPI_Type_contiguous(static_cast<int>(E), MPI_FLOAT, &m.h.row), "MPI_Type_contiguous");
        check_mpi(MPI_Type_commit(&m.h.row), "MPI_Type_commit");
    });
    agree(m.h.comm, m.rank, m.size, failed, key,
          {"embed_dim", "num_heads", "num_kv_heads", "head_dim", "value_dim", "kdim", "vdim", "norm and norm_eps"});
}

TpLayer::~TpLayer() = default;

const LayerConfig &TpLayer::config() const { return impl_->cfg; }
const TpShard &TpLayer::shard() const { return impl_->shard; }
const Layer &TpLayer::local() const { return *impl_->local; }
double TpLayer::flops(const LayerForward &p) const { return impl_->local->flops(p) * impl_->size; }
TpTiming TpLayer::timing() const { return impl_->timing; }
void TpLayer::reset_timing() { impl_->timing = TpTiming{}; }

void TpLayer::fail_call(const Error &e) const {
    const Impl &m = *impl_;
    const Impl::Call call(m);
    m.agree_call(e, CallKey{}, KeyNames{});
    throw e;  // not reached
}

void TpLayer::forward(Runtime &rt, const LayerForward &p, const float *query, const float *key, const float *value,
                      float *out) const {
    const Impl &m = *impl_;
    const Impl::Call call(m);
    const bool self = (!key && !value) || (key == query && value == query);
    int64_t rows = 0;
    const int64_t kv_len = self && p.kv_len == 0 ? p.q_len : p.kv_len;
    const CallKey k{1, p.batch, p.q_len, kv_len, p.causal, self, p.weights != nullptr,
                    (p.mask ? 1 : 0) | (p.kv_valid_lens ? 2 : 0)};
    const std::optional<Error> failed = attempt([&] {
        auto &st = rt.state();
        detail::check_size("batch", p.batch);
        detail::check_size("q_len", p.q_len);
        detail::check_size("kv_len", p.kv_len);
        rows = product(p.batch, p.q_len, "query");
        if (kv_len > INT_MAX) throw Error(Status::unsupported, "kv_len is more than one MPI message counts");
        const int64_t prob_rows = p.weights ? product(rows, m.shard.num_heads, "weights") : 0;
        if (prob_rows > INT_MAX) throw Error(Status::unsupported, "the weights' rows are more than one MPI message counts");
        const int64_t probs = product(prob_rows, kv_len, "weights");
        m.reserve(rows, probs);
        if (rows) detail::check_matrix("out", "embed_dim", out, rows, m.cfg.embed_dim, m.cfg.embed_dim);
        const float *x = m.normed_input(st, rows, query);
        LayerForward lp = p;
        lp.weights = p.weights ? m.probs.data() : nullptr;
        m.local->forward(rt, lp, x, self ? nullptr : key, self ? nullptr : value, m.partial.data());
    });
    m.agree_call(failed, k, {"the call", "batch", "q_len", "kv_len", "causal", "self-attention", "weights", "masks"});
    m.reduce(rt.state(), rows, query, out);
    if (p.weights) m.gather_probs(p.batch, p.q_len, kv_len, p.weights);
}

void TpLayer::forward_cached(Runtime &rt, KVCache &cache, const LayerCachedForward &p, const float *x, float *out) const {
    const Impl &m = *impl_;
    const Impl::Call call(m);
    int64_t rows = 0;
    CallKey k{2, p.num_seqs, 0, p.causal, 0, 0, 0, 0};
    KVCache::Impl::AppendUndo appended;
    const std::optional<Error> failed = attempt([&] {
        auto &st = rt.state();
        const KVCacheConfig &cc = cache.config();
        if (cc.num_kv_heads != m.shard.num_kv_heads)
            invalid_argument("this rank's kv cache holds num_kv_heads = " + std::to_string(cc.num_kv_heads) + ", but " +
                             rank_name(m.rank, m.size) + " holds " + std::to_string(m.shard.num_kv_heads) +
                             " KV heads of the layer (from " + std::to_string(m.shard.kv_head_begin) +
                             "): create each rank's cache with its shard's num_kv_heads");
        rows = detail::check_offsets("q_offsets", p.q_offsets, p.num_seqs);
        if (p.num_seqs > 0) detail::check_not_null("seq_ids", p.seq_ids);
        // The sequences and their cached lengths before the call, which every rank's cache must share.
        Fingerprint ids, lens;
        for (int64_t s = 0; s < p.num_seqs; ++s) {
            ids.add(p.seq_ids[s]);
            ids.add(p.q_offsets[s + 1]);
            lens.add(p.seq_ids[s] >= 0 && cache.contains(p.seq_ids[s]) ? cache.seq_len(p.seq_ids[s]) : -1);
        }
        k[2] = rows;
        k[4] = ids.value();
        k[5] = lens.value();
        m.reserve(rows, 0);
        if (rows) detail::check_matrix("out", "embed_dim", out, rows, m.cfg.embed_dim, m.cfg.embed_dim);
        const float *xin = m.normed_input(st, rows, x);
        layer_detail::forward_cached_undoable(*m.local, rt, cache, p, xin, m.partial.data(), appended);
    });
    try {
        m.agree_call(failed, k,
                     {"the call", "num_seqs", "the token count", "causal", "the sequence ids and lengths",
                      "the cached lengths of the sequences", "-", "-"});
        m.reduce(rt.state(), rows, x, out);
    } catch (...) {
        if (!failed) cache.impl().undo(appended);  // another rank failed: this rank's cache goes back too
        throw;
    }
}

void TpLayer::forward_varlen(Runtime &rt, const LayerVarlenForward &p, const float *x, float *out) const {
    const Impl &m = *impl_;
    const Impl::Call call(m);
    int64_t rows = 0;
    CallKey k{3, p.num_seqs, 0, p.causal, 0, 0, 0, 0};
    const std::optional<Error> failed = attempt([&] {
        auto &st = rt.state();
        rows = detail::check_offsets("offsets", p.offsets, p.num_seqs);
        Fingerprint offs;
        for (int64_t s = 0; s <= p.num_seqs && p.offsets; ++s) offs.add(p.offsets[s]);
        k[2] = rows;
        k[4] = offs.value();
        m.reserve(rows, 0);
        if (rows) detail::check_matrix("out", "embed_dim", out, rows, m.cfg.embed_dim, m.cfg.embed_dim);
        const float *xin = m.normed_input(st, rows, x);
        m.local->forward_varlen(rt, p, xin, m.partial.data());
    });
    m.agree_call(failed, k, {"the call", "num_seqs", "the token count", "causal", "offsets", "-", "-", "-"});
    m.reduce(rt.state(), rows, x, out);
}

} // namespace mha
