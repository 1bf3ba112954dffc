// mha::attention: validation, then the scheduler that spreads (batch, head group, query block)
// work items over the runtime's threads, costliest first.
#include "mha/attention.hpp"

#include <tbb/parallel_for.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <string>
#include <vector>

#include "attention/attention_shape.hpp"
#include "runtime/runtime_state.hpp"
#include "runtime/validate.hpp"
#include "simd/flush_denormals.hpp"

namespace mha {
namespace attention_detail {

// In place (out == q): every query row's output is written after the call's last read of that
// row, which holds only where each head's output lands on its own query (the kernels rely on it;
// see attention_kernel.hpp).
void check_in_place(const float *q, const float *out, int64_t head_dim, int64_t value_dim, int64_t ldq, int64_t ldo,
                    bool weights) {
    if (out != q) return;
    if (value_dim != head_dim || ldq != ldo || weights)
        invalid_argument("in-place attention (out == q) needs value_dim == head_dim (got " + std::to_string(value_dim) +
                         " and " + std::to_string(head_dim) + "), the same row stride for q and out (got " +
                         std::to_string(ldq) + " and " + std::to_string(ldo) + ") and no weights" +
                         (weights ? " (weights is not NULL)" : ""));
}

const AttentionKernel &find_attention_kernel(std::string_view gemm_ukernel) {
    for (auto list : {attention_kernels_avx512(), attention_kernels_avx2()})
        for (const auto &k : list)
            if (gemm_ukernel == k.name) return k;
    throw Error(Status::internal, "no attention kernel for microkernel " + std::string(gemm_ukernel));
}

} // namespace attention_detail

namespace {

using attention_detail::Item;
using attention_detail::Shape;

int64_t checked_product(std::initializer_list<int64_t> dims, const char *what) {
    int64_t p = 1;
    for (int64_t d : dims)
        if (__builtin_mul_overflow(p, d, &p) || p > INT64_MAX / 8)
            invalid_argument(std::string(what) + ": the sizes overflow");
    return p;
}

} // namespace

void attention_variant_validate(const AttentionVariant &v, int64_t num_heads, const char *prefix) {
    const std::string f(prefix);
    if (v.window < 0) invalid_argument(f + ".window = " + std::to_string(v.window) + " must be >= 0 (0 = no window)");
    if (!std::isfinite(v.softcap) || v.softcap < 0.0f)
        invalid_argument(f + ".softcap = " + std::to_string(v.softcap) + " must be finite and >= 0 (0 = no cap)");
    for (int64_t h = 0; v.alibi_slopes && h < num_heads; ++h)
        if (!std::isfinite(v.alibi_slopes[h]))
            invalid_argument(f + ".alibi_slopes[" + std::to_string(h) + "] = " + std::to_string(v.alibi_slopes[h]) +
                             " must be finite");
    for (int64_t h = 0; v.sink_logits && h < num_heads; ++h)
        if (std::isnan(v.sink_logits[h]) || v.sink_logits[h] == INFINITY)
            invalid_argument(f + ".sink_logits[" + std::to_string(h) + "] = " + std::to_string(v.sink_logits[h]) +
                             " must not be NaN or +inf");
}

void attention_validate(const AttentionParams &p, const float *q, const float *k, const float *v, const float *out) {
    using detail::check_size;
    check_size("batch", p.batch);
    check_size("q_len", p.q_len);
    check_size("kv_len", p.kv_len);
    auto positive = [](const char *name, int64_t x) {
        if (x <= 0) invalid_argument(std::string(name) + " = " + std::to_string(x) + " must be positive");
    };
    positive("num_heads", p.num_heads);
    positive("num_kv_heads", p.num_kv_heads);
    positive("head_dim", p.head_dim);
    positive("value_dim", p.value_dim);
    if (p.num_heads % p.num_kv_heads != 0)
        invalid_argument("num_heads = " + std::to_string(p.num_heads) + " is not a multiple of num_kv_heads = " +
                         std::to_string(p.num_kv_heads));
    if (!std::isfinite(p.scale)) invalid_argument("scale must be finite");
    attention_variant_validate(p.variant, p.num_heads);
    // Each tensor is tokens rows of `width` floats, `stride` apart (0 = width).
    auto extent = [](const char *name, const char *stride_name, int64_t tokens, int64_t width, int64_t stride) {
        check_size(stride_name, stride);
        if (stride != 0 && stride < width)
            invalid_argument(std::string(stride_name) + " = " + std::to_string(stride) + " is too small: it must be 0 (dense) or >= " +
                             std::to_string(width));
        const int64_t rows = checked_product({tokens, stride ? stride : width}, name);
        return tokens == 0 || width == 0 ? 0 : rows;
    };
    const int64_t nq = extent("q", "q_stride", checked_product({p.batch, p.q_len}, "q"),
                              checked_product({p.num_heads, p.head_dim}, "q"), p.q_stride);
    const int64_t nk = extent("k", "k_stride", checked_product({p.batch, p.kv_len}, "k"),
                              checked_product({p.num_kv_heads, p.head_dim}, "k"), p.k_stride);
    const int64_t nv = extent("v", "v_stride", checked_product({p.batch, p.kv_len}, "v"),
                              checked_product({p.num_kv_heads, p.value_dim}, "v"), p.v_stride);
    const int64_t no = extent("out", "out_stride", checked_product({p.batch, p.q_len}, "out"),
                              checked_product({p.num_heads, p.value_dim}, "out"), p.out_stride);
    checked_product({p.batch, p.num_heads, p.q_len, p.kv_len}, "weights");
    if (nq && !q) invalid_argument("q is NULL");
    if (nk && !k) invalid_argument("k is NULL");
    if (nv && !v) invalid_argument("v is NULL");
    if (no && !out) invalid_argument("out is NULL");
    if (no)
        attention_detail::check_in_place(q, out, p.head_dim, p.value_dim, p.q_stride ? p.q_stride : p.num_heads * p.head_dim,
                                         p.out_stride ? p.out_stride : p.num_heads * p.value_dim, p.weights);
    if (p.kv_valid_lens)
        for (int64_t b = 0; b < p.batch; ++b)
            if (p.kv_valid_lens[b] < 0 || p.kv_valid_lens[b] > p.kv_len)
                invalid_argument("kv_valid_lens[" + std::to_string(b) + "] = " + std::to_string(p.kv_valid_lens[b]) +
                                 " is outside [0, kv_len = " + std::to_string(p.kv_len) + "]");
    if (p.mask) {
        check_size("mask_batch_stride", p.mask_batch_stride);
        check_size("mask_row_stride", p.mask_row_stride);
        if (p.mask_row_stride != 0 && p.mask_row_stride < p.kv_len)
            invalid_argument("mask_row_stride = " + std::to_string(p.mask_row_stride) +
                             " is too small: it must be 0 (broadcast) or >= kv_len = " + std::to_string(p.kv_len));
        int64_t extent = 0, t = 0;
        if (p.batch > 0 && p.q_len > 0 &&
            (__builtin_mul_overflow(p.batch - 1, p.mask_batch_stride, &extent) ||
             __builtin_mul_overflow(p.q_len - 1, p.mask_row_stride, &t) || __builtin_add_overflow(extent, t, &extent) ||
             __builtin_add_overflow(extent, p.kv_len, &extent) || extent > INT64_MAX / 8))
            invalid_argument("mask: the strides overflow");  // (the tensors' limit too: no such array exists)
    }
}

void attention(Runtime &rt, const AttentionParams &p, const float *q, const float *k, const float *v, float *out) {
    attention_validate(p, q, k, v, out);
    if (p.batch == 0 || p.q_len == 0) return;
    auto &st = rt.state();
    const auto &ak = attention_detail::find_attention_kernel(st.tiles.gemm_ukernel);
    Shape s{p.batch, p.q_len, p.kv_len, p.num_heads, p.num_kv_heads, p.head_dim, p.value_dim,
            p.scale != 0.0f ? p.scale : 1.0f / std::sqrt(static_cast<float>(p.head_dim)), p.causal, p.kv_valid_lens,
            p.mask, p.mask_batch_stride, p.mask_row_stride, p.weights,
            std::min(st.tiles.attn_block_q, p.q_len), st.tiles.attn_block_k, st.tiles.attn_kv_chunk};
    attention_detail::run_dense(st, ak, s, p, q, k, v, out);
}

namespace attention_detail {

void run_attention(detail::RuntimeState &st, const AttentionKernel &ak, Shape &s, const float *q, const float *k,
                   const float *v, float *out) {
    // Work items, costliest first (rows x keys they can see), so the threads finish together.
    // A sequence whose KV heads have few query rows each (decode) is one direct item holding every
    // KV head (see DirectTiles), or a group of them (below). Otherwise, with at least two (sequence, KV head) strips per
    // thread, an item is a whole strip, which packs each K and V tile once for all its query
    // blocks (if the strip's packed K and V fit in 8 MiB, and K and V are not in a paged cache);
    // otherwise an item is one query block. Each row is computed the same way in all of them.
    s.inserts = st.inserts;
    const int64_t T = st.num_threads, bk = s.block_k;
    auto is_direct = [&](int64_t b) { return s.group() * s.qlen(b) <= kDirectRows; };
    int64_t packed_strips = 0;
    for (int64_t b = 0; b < s.batch; ++b)
        if (s.qlen(b) > 0 && !is_direct(b)) packed_strips += s.kv_heads;
    // With a window each query block sees the tiles from its first row's window start to its last
    // row's keys: a strip then keeps only the most tiles any block spans, in a ring (KVTiles), so a
    // long sequence keeps its tiles too (L16384 with window 1024: 6 tiles of 256 keys, not 64).
    int64_t ring = 0;
    if (s.window > 0) {
        int64_t span = 0;
        for (int64_t b = 0; b < s.batch; ++b)
            if (!is_direct(b))
                for (int64_t t = 0; t < s.block_count(b); ++t)
                    span = std::max(span, s.key_tiles(b, s.block_start(b, t), s.block_start(b, t + 1)));
        if (span < (s.kv_len + bk - 1) / bk) ring = std::max<int64_t>(span, 1);
    }
    const int64_t cache_bytes = (ring ? ring * bk : s.kv_len + bk) * (s.head_dim + s.value_dim + 2 * ak.nr) * 4;
    // (A strip of one query block has nothing to reuse: packing into one small buffer then keeps
    // the tiles in cache.)
    s.cache_kv = !s.kv_cache && s.q_len > s.block_q && packed_strips >= 2 * T && cache_bytes <= (int64_t{8} << 20);
    s.kv_ring = s.cache_kv ? ring : 0;
    std::vector<Item> items;
    std::vector<int64_t> cost;
    auto add = [&](const Item &it) {
        int64_t c = 0;
        for (int64_t i = it.i0; i < it.i1; ++i) c += std::max<int64_t>(0, s.key_limit(it.b, i) - s.key_start(it.b, i)) + 1;
        items.push_back(it);
        cost.push_back(c * it.kv_heads);
    };
    for (int64_t b = 0; b < s.batch; ++b) {
        const int64_t n = s.qlen(b);
        if (n == 0) continue;
        if (is_direct(b)) {
            add(Item{b, 0, 0, n, s.kv_heads, true});
            continue;
        }
        for (int64_t g = 0; g < s.kv_heads; ++g) {
            if (s.cache_kv) {  // the whole strip
                add(Item{b, g, 0, n, 1, false});
                continue;
            }
            for (int64_t t = 0; t < s.block_count(b); ++t)
                add(Item{b, g, s.block_start(b, t), s.block_start(b, t + 1), 1, false});
        }
    }
    if (items.empty()) return;

    // Threads only where they pay: an item's cost counts (query position, key) pairs of one KV
    // head, each 2 (D + Dv) FLOPs for each of the group's query heads. A direct item (decode) also
    // reads each of its keys' K and V rows once for its few rows, a stream that a second core
    // doubles (RuntimeState::work_with_stream): its cost over its query positions is the keys it
    // reads (the average over its positions, plus one, which a causal item of several rows
    // undercounts a little), for all its KV heads, D + Dv values each. An int8 value is a quarter
    // of a float's bytes but takes half its time or more, widened as it is read (Xeon, H8 D64,
    // one thread: Lk1024 50 us against 137 us in fp32), so it counts half a float: 2 threads
    // against 1 (every call on both) read Lk1024 0.8-1.09x, Lk2048 1.19x, Lk4096 1.35-1.37x; with
    // half a float, Lk2048 takes the second thread (1.05-1.19x), Lk1024 does not.
    double flops = 0, stream = 0;
    for (size_t n = 0; n < items.size(); ++n) {
        flops += static_cast<double>(cost[n]);
        if (items[n].direct)
            stream += static_cast<double>(cost[n]) / static_cast<double>(items[n].i1 - items[n].i0) *
                      static_cast<double>(s.head_dim + s.value_dim) * (s.kv_cache && s.kv_cache->i8 ? 0.5 : 1.0);
    }
    flops *= 2.0 * static_cast<double>(s.group() * (s.head_dim + s.value_dim));
    const int64_t useful = st.threads_for(st.work_with_stream(flops, stream), st.tiles.parallel_min_flops);

    // An item's keys end at `end`, and its key chunks are [first, first + count) (chunks before
    // the window of every row of the item would give empty states: skipped).
    struct Chunks {
        int64_t end, first, count;
    };
    auto chunks_of = [&](const Item &it) {
        const int64_t end = s.key_end(it.b, it.i0, it.i1);
        const int64_t first = std::min(s.key_begin(it.b, it.i0, it.i1), end) / s.kv_chunk;
        return Chunks{end, first, std::max<int64_t>(0, (end + s.kv_chunk - 1) / s.kv_chunk - first)};
    };

    // How evenly `useful` threads share an item out: by its key chunks (the last one may be
    // short), or by groups of its KV heads; the share of the work against the slowest thread's.
    auto chunks_balance = [&](const Item &it) {
        const Chunks c = chunks_of(it);
        if (c.count == 0) return 1.0;  // no keys: nothing to share out
        const int64_t rounds = (c.count + useful - 1) / useful;
        return static_cast<double>(c.end - c.first * s.kv_chunk) / static_cast<double>(useful * rounds * s.kv_chunk);
    };
    auto heads_balance = [&](const Item &it) {
        const int64_t rounds = (it.kv_heads + useful - 1) / useful;
        return static_cast<double>(it.kv_heads) / static_cast<double>(useful * rounds);
    };

    // A direct item holds every KV head of its sequence, and the threads share out its key chunks
    // (below). Where there are fewer items than the threads that pay and its KV heads share out
    // more evenly than its chunks (a decode of at most attn_kv_chunk keys has one chunk; one of
    // 1536 keys on 2 threads 1024 + 512), it is cut into groups of KV heads instead, as many as
    // make an item a thread: a KV head's rows are computed alone whatever else the item holds, so
    // the bits stay. Where the chunks share out as evenly, they stay: in dense K and V a group of
    // heads is a part of every token's row, a chunk whole rows (B1 Lk4096 H32/8 D128, 2 threads:
    // by chunks 1.48-1.82x one thread, by heads 1.56-1.65x). Chunks that share out unevenly lost
    // most of the second thread (2 threads against 1, H32/8 D128, chunks -> heads: dense Lk1536
    // 1.42x -> 1.65x, Lk3072 1.47x -> 1.74x; the paged cache Lk1536 1.41x -> 1.74x, Lk3072 1.43x
    // -> 1.74x; dense Lk1100, 1024 + 76 keys, 1.04x -> 1.59x).
    // Xeon (model 207), one sequence's decode through the paged cache, 2 threads against 1,
    // before -> after (the FLOPs alone, and the group counted twice for split items): H8 D64
    // Lk1024 1.00x -> 1.37-1.50x, H32/8 D128 Lk1024 1.00x -> 1.48-1.57x, H8 D64 Lk4096 1.00x ->
    // 1.58-1.61x (its 8 MFLOP fell just short of two threads); Lk512 stays on one thread. The
    // layer's decode step (mha_layer_forward_cached, one token over 1024 cached), with the GEMM's
    // few rows on two threads too (gemm::product_threads), 2 threads against 1: E512 H8
    // 0.95-1.06x -> 1.35-1.46x, E1024 H16 1.0x -> 1.78-1.83x, E2048 H32/8 1.0x -> 1.83-1.86x.
    int64_t direct_items = 0;
    for (const Item &it : items) direct_items += it.direct;
    if (direct_items > 0 && static_cast<int64_t>(items.size()) < useful) {
        const int64_t parts = std::min(s.kv_heads, (useful + direct_items - 1) / direct_items);
        std::vector<Item> cut;
        std::vector<int64_t> cut_cost;
        for (size_t n = 0; n < items.size(); ++n) {
            const Item &it = items[n];
            const bool by_heads = it.direct && heads_balance(it) > chunks_balance(it);
            for (int64_t p = 0, pieces = by_heads ? parts : 1; p < pieces; ++p) {
                Item piece = it;
                piece.g = it.g + it.kv_heads * p / pieces;
                piece.kv_heads = it.g + it.kv_heads * (p + 1) / pieces - piece.g;
                cut.push_back(piece);
                cut_cost.push_back(cost[n] / it.kv_heads * piece.kv_heads);
            }
        }
        items = std::move(cut);
        cost = std::move(cut_cost);
    }

    // Direct items split their keys into the fixed chunks: with all of a sequence's KV heads in one
    // item (or a few groups) there are few of them, too few to balance the threads unless each is cut. So do all
    // items when there are fewer than threads. A split item's chunks run as tasks of their own on
    // any thread, and a second pass merges each item's chunk states in order.
    const bool split_all = static_cast<int64_t>(items.size()) < T;
    struct Task {
        size_t item;
        int64_t chunk;   // -1: the whole item
        int64_t state;   // offset of a chunk's state in the states buffer
        int64_t cost;
    };
    std::vector<Task> tasks;
    std::vector<size_t> split;  // the items that are split, and their first state and chunk count
    std::vector<int64_t> first_state, chunks;
    int64_t state_floats = 0;
    for (size_t n = 0; n < items.size(); ++n) {
        const Item &it = items[n];
        if (!it.direct && !split_all) {
            tasks.push_back({n, -1, 0, cost[n]});
            continue;
        }
        const int64_t per_state = it.rows(s) * (2 + s.value_dim);
        const auto [end, c_first, count] = chunks_of(it);
        split.push_back(n);
        first_state.push_back(state_floats);
        chunks.push_back(count);
        for (int64_t c = 0; c < count; ++c)
            tasks.push_back({n, c_first + c, state_floats + c * per_state,
                             it.rows(s) * std::min(s.kv_chunk, end - (c_first + c) * s.kv_chunk)});
        state_floats += count * per_state;
    }
    std::stable_sort(tasks.begin(), tasks.end(), [](const Task &a, const Task &b) { return a.cost > b.cost; });

    const int64_t per_item = item_scratch_floats(s, ak.mr, ak.nr);
    auto scratch = st.pool.borrow(static_cast<size_t>(per_item * T + state_floats));
    float *states = scratch.data() + per_item * T;
    // Runs fn(task, scratch) for task in [0, count) on up to `useful` threads, each taking the next
    // task in order (so the costliest start first) with its own scratch.
    auto run_tasks = [&](int64_t count, const auto &fn) {
        const int64_t workers = std::min<int64_t>(useful, count);
        std::atomic<int64_t> next{0};
        auto work = [&](int64_t w) {
            const simd::FlushDenormals ftz;  // on whichever thread runs the tasks (see flush_denormals.hpp)
            for (int64_t n; (n = next.fetch_add(1)) < count;) fn(n, scratch.data() + w * per_item);
        };
        if (workers <= 1) return work(0);
        st.arena->execute([&] {
            tbb::parallel_for(tbb::blocked_range<int64_t>(0, workers, 1),
                              [&](const tbb::blocked_range<int64_t> &r) {
                                  for (int64_t w = r.begin(); w != r.end(); ++w) work(w);
                              },
                              tbb::simple_partitioner());
        });
    };
    run_tasks(static_cast<int64_t>(tasks.size()), [&](int64_t n, float *w) {
        const Task &t = tasks[static_cast<size_t>(n)];
        if (t.chunk < 0)
            ak.item(s, q, k, v, out, items[t.item], w);
        else
            ak.chunk(s, q, k, v, items[t.item], t.chunk, states + t.state, w);
    });
    run_tasks(static_cast<int64_t>(split.size()), [&](int64_t n, float *w) {
        const size_t i = static_cast<size_t>(n);
        ak.merge(s, q, k, out, items[split[i]], chunks[i], states + first_state[i], w);
    });
}

} // namespace attention_detail
} // namespace mha
