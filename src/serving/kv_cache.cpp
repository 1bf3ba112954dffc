// The paged KV cache: creation, the block allocator (reference counts, copy-on-write), appends
// into the packed layout, and the snapshots attention reads.
#include <sys/mman.h>

#include <algorithm>
#include <cmath>
#include <vector>
#include <cstdlib>
#include <cstring>
#include <string>

#include "gemm/sgemm_kernels.hpp"
#include "mha/error.hpp"
#include "serving/kv_cache_impl.hpp"

namespace mha {
namespace {

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

std::string str(int64_t x) { return std::to_string(x); }

// Whether blocks of bt tokens keep every key tile of block_k keys on whole K panels of nr keys:
// either a block divides the tile (and holds whole panels, or is the tile) or a tile divides a
// block and holds whole panels.
bool block_fits(int64_t bt, int64_t block_k, int64_t nr) {
    return (block_k % bt == 0 && (bt % nr == 0 || bt == block_k)) || (bt % block_k == 0 && block_k % nr == 0);
}

// The runtime's choice: the smallest multiple of NR of at least 64 tokens that divides the tile
// (64 tokens of H8 D128 are 256 KiB of K and V: long contiguous reads, a small unit of waste per
// sequence), else the tile itself.
int64_t default_block_tokens(int64_t block_k, int64_t nr) {
    for (int64_t bt = round_up(64, nr); bt < block_k; bt += nr)
        if (block_k % bt == 0) return bt;
    return block_k;
}

// Symmetric int8 of n values x into at(0) .. at(n - 1), returning the one scale (see MHA_I8 in mha.h).
template <class At>
float quantize_i8(const float *x, int64_t n, const At &at) {
    float m = 0.0f;
    for (int64_t i = 0; i < n; ++i) m = std::max(m, std::fabs(x[i]));
    if (m == 0.0f) {
        for (int64_t i = 0; i < n; ++i) at(i) = 0;
        return 0.0f;
    }
    float scale = m / 127.0f;
    // Nudge the scale (a few ulp at most) so that 127 * scale gives max |x| back where a float can.
    for (float c : {scale, std::nextafter(scale, 0.0f), std::nextafter(scale, INFINITY)})
        if (127.0f * c == m) {
            scale = c;
            break;
        }
    for (int64_t i = 0; i < n; ++i) {
        const float r = std::nearbyint(x[i] / scale);
        at(i) = static_cast<int8_t>(std::clamp(r, -127.0f, 127.0f));
    }
    return scale;
}

bool all_finite(const float *x, int64_t n) {
    for (int64_t i = 0; i < n; ++i)
        if (!std::isfinite(x[i])) return false;
    return true;
}

} // namespace

KVCache::KVCache(Runtime &rt, const KVCacheConfig &config) : impl_(std::make_unique<Impl>()) {
    Impl &c = *impl_;
    const auto &st = rt.state();
    KVCacheConfig cfg = config;
    auto positive = [](const char *name, int64_t v) {
        if (v <= 0) invalid_argument(std::string("kv cache config: ") + name + " = " + str(v) + " must be positive");
    };
    positive("num_kv_heads", cfg.num_kv_heads);
    positive("head_dim", cfg.head_dim);
    positive("value_dim", cfg.value_dim);
    positive("max_tokens", cfg.max_tokens);
    if (cfg.dtype == DType::bf16) throw Error(Status::unsupported, "kv cache config: dtype MHA_BF16 is not supported yet");
    if (cfg.dtype != DType::f32 && cfg.dtype != DType::i8)
        invalid_argument("kv cache config: dtype = " + str(static_cast<int64_t>(cfg.dtype)) + " is not a known mha_dtype");
    for (int64_t v : {cfg.num_kv_heads, cfg.head_dim, cfg.value_dim})
        if (v > (int64_t{1} << 20)) invalid_argument("kv cache config: num_kv_heads, head_dim and value_dim must be at most 2^20");
    c.ukernel = st.tiles.gemm_ukernel;
    c.nr = st.sgemm->nr;
    c.block_k = st.tiles.attn_block_k;
    c.kv_chunk = st.tiles.attn_kv_chunk;
    if (cfg.window < 0) invalid_argument("kv cache config: window = " + str(cfg.window) + " is negative (0 = keep every token)");
    if (cfg.block_tokens < 0) invalid_argument("kv cache config: block_tokens = " + str(cfg.block_tokens) + " is negative");
    if (cfg.block_tokens == 0) cfg.block_tokens = default_block_tokens(c.block_k, c.nr);
    if (!block_fits(cfg.block_tokens, c.block_k, c.nr))
        invalid_argument("kv cache config: block_tokens = " + str(cfg.block_tokens) + " must divide the runtime's attn_block_k = " +
                         str(c.block_k) + " and be a multiple of its microkernel's NR = " + str(c.nr) +
                         " (or equal attn_block_k); 0 picks " + str(default_block_tokens(c.block_k, c.nr)));
    const int64_t bt = cfg.block_tokens, H = cfg.num_kv_heads;
    c.k_head = round_up(bt, c.nr) * cfg.head_dim;
    c.v_start = H * c.k_head;
    c.v_panel = bt * c.nr;
    c.v_head = (cfg.value_dim + c.nr - 1) / c.nr * c.v_panel;
    c.i8 = cfg.dtype == DType::i8;
    if (c.i8) {  // int8 panels (bytes), then the fp32 scales
        c.scales = round_up(c.v_start + H * c.v_head, 64) / 4;
        c.block_floats = round_up(c.scales + 2 * H * bt, 16);
    } else {
        c.block_floats = round_up(c.v_start + H * c.v_head, 16);
    }
    c.num_blocks = cfg.max_tokens / bt + (cfg.max_tokens % bt != 0);  // (max_tokens + bt - 1 may overflow)
    int64_t floats;
    const int64_t pool_blocks = c.num_blocks + (cfg.window > 0);  // and the zero block
    if (c.num_blocks >= INT32_MAX || __builtin_mul_overflow(pool_blocks, c.block_floats, &floats) ||
        floats > INT64_MAX / 8)
        invalid_argument("kv cache config: max_tokens = " + str(cfg.max_tokens) + " overflows the cache's size");
    c.cfg = cfg;
    // Whole 2 MiB pages, advised as huge pages, for a cache of at least one; a smaller cache is not
    // padded to one (nor zeroed past its blocks).
    constexpr size_t kHuge = size_t{2} << 20;
    const size_t raw = static_cast<size_t>(floats) * sizeof(float), align = raw >= kHuge ? kHuge : 64;
    const size_t bytes = (raw + align - 1) / align * align;
    c.pool = detail::make_aligned<float>(bytes / sizeof(float), align, "kv cache blocks");
    if (align == kHuge) madvise(c.pool.get(), bytes, MADV_HUGEPAGE);  // a hint: without huge pages the cache works the same
    std::memset(c.pool.get(), 0, bytes);
    c.refs.assign(static_cast<size_t>(c.num_blocks), 0);
    if (cfg.window > 0) c.zero_block = static_cast<int32_t>(c.num_blocks);
    c.free_blocks.resize(static_cast<size_t>(c.num_blocks));
    for (int64_t i = 0; i < c.num_blocks; ++i) c.free_blocks[static_cast<size_t>(i)] = static_cast<int32_t>(c.num_blocks - 1 - i);
}

KVCache::~KVCache() = default;

const KVCacheConfig &KVCache::config() const { return impl_->cfg; }

size_t KVCache::bytes() const {
    return static_cast<size_t>((impl_->num_blocks + (impl_->zero_block >= 0)) * impl_->block_floats) * sizeof(float);
}

void KVCache::Impl::check_runtime(const detail::RuntimeState &st) const {
    if (st.tiles.gemm_ukernel != ukernel || st.tiles.attn_block_k != block_k || st.tiles.attn_kv_chunk != kv_chunk)
        invalid_argument("the kv cache was laid out for microkernel " + ukernel + ", attn_block_k = " + str(block_k) +
                         ", attn_kv_chunk = " + str(kv_chunk) + ", but the runtime has " + st.tiles.gemm_ukernel + ", " +
                         str(st.tiles.attn_block_k) + ", " + str(st.tiles.attn_kv_chunk) +
                         "; use a runtime with the cache's ISA and tile config");
}

const KVCache::Impl::Seq &KVCache::Impl::find(int64_t seq_id, const char *what) const {
    const auto it = seqs.find(seq_id);
    if (it == seqs.end()) invalid_argument(std::string(what) + " = " + str(seq_id) + " is not a sequence of the kv cache");
    return it->second;
}

KVCache::Impl::AppendUndo KVCache::Impl::append_all(std::span<const Append> appends) {
    const int64_t bt = cfg.block_tokens, D = cfg.head_dim, Dv = cfg.value_dim, H = cfg.num_kv_heads;
    if (i8)  // int8 holds finite values only: checked before anything changes
        for (const Append &a : appends)
            for (int64_t t = 0; t < a.n; ++t)
                if (!all_finite(a.k + t * a.ldk, H * D) || !all_finite(a.v + t * a.ldv, H * Dv))
                    invalid_argument("kv cache: k or v of sequence " + str(a.seq) + " has a non-finite value at token " +
                                     str(t) + "; an MHA_I8 cache stores finite values only; nothing was appended");
    std::unique_lock lock(mutex);
    // Count every block first: appending to some sequences and not others is never an outcome.
    int64_t need = 0;
    for (const Append &a : appends) {
        if (a.n == 0) continue;
        const auto it = seqs.find(a.seq);
        const int64_t len = it == seqs.end() ? 0 : it->second.len;
        const int64_t have = it == seqs.end() ? 0 : static_cast<int64_t>(it->second.blocks.size());
        need += (len + a.n + bt - 1) / bt - have;
        if (len % bt != 0 && refs[static_cast<size_t>(it->second.blocks.back())] > 1) ++need;  // copy-on-write
    }
    if (need > static_cast<int64_t>(free_blocks.size()))
        throw Error(Status::out_of_memory, "kv cache: the append needs " + str(need) + " free blocks of " + str(bt) +
                                               " tokens but " + str(static_cast<int64_t>(free_blocks.size())) +
                                               " are free; nothing was appended");
    // Everything that allocates happens first, with nothing visible changed: the new ids' entries
    // (in a map of their own) and each sequence's new block table, sized for its final length.
    std::unordered_map<int64_t, Seq> fresh;
    AppendUndo u;
    std::vector<std::vector<int32_t>> &tables = u.old_blocks;  // the new tables, then (swapped) the old
    tables.resize(appends.size());
    u.ids.reserve(appends.size());
    u.old_lens.reserve(appends.size());
    for (size_t i = 0; i < appends.size(); ++i) {
        const Append &a = appends[i];
        const auto it = seqs.find(a.seq);
        u.ids.push_back(a.seq);
        u.old_lens.push_back(it == seqs.end() ? 0 : it->second.len);
        if (it == seqs.end()) {  // a new id starts an empty sequence
            fresh.try_emplace(a.seq);
            u.created.push_back(a.seq);
        }
        if (a.n == 0) continue;
        const int64_t len = it == seqs.end() ? 0 : it->second.len;
        tables[i].reserve(static_cast<size_t>((len + a.n + bt - 1) / bt));
        if (it != seqs.end()) tables[i].assign(it->second.blocks.begin(), it->second.blocks.end());
    }
    seqs.reserve(seqs.size() + fresh.size());
    // From here on nothing allocates or throws: the new entries move in as nodes, without a rehash.
    while (!fresh.empty()) seqs.insert(fresh.extract(fresh.begin()));
    auto take = [&] {
        const int32_t id = free_blocks.back();
        free_blocks.pop_back();
        refs[static_cast<size_t>(id)] = 1;
        return id;
    };
    for (size_t i = 0; i < appends.size(); ++i) {
        const Append &a = appends[i];
        if (a.n == 0) continue;
        Seq &s = seqs.find(a.seq)->second;
        std::vector<int32_t> &blocks = tables[i];
        if (s.len % bt != 0 && refs[static_cast<size_t>(blocks.back())] > 1) {
            const int32_t old = blocks.back(), copy = take();
            std::memcpy(block(copy), block(old), static_cast<size_t>(block_floats) * sizeof(float));
            --refs[static_cast<size_t>(old)];
            blocks.back() = copy;
        }
        for (int64_t t = 0; t < a.n; ++t) {
            const int64_t pos = s.len + t, o = pos % bt;
            if (o == 0) blocks.push_back(take());  // within the capacity reserved above
            float *blk = block(blocks.back());
            if (i8) {
                int8_t *blk8 = reinterpret_cast<int8_t *>(blk);
                for (int64_t h = 0; h < H; ++h) {
                    // K: lane o % NR of panel o / NR; V: row o of each NR-column panel. One scale each.
                    int8_t *kd = blk8 + h * k_head + o / nr * nr * D + o % nr, *vd = blk8 + v_start + h * v_head + o * nr;
                    blk[scales + h * bt + o] =
                        quantize_i8(a.k + t * a.ldk + h * D, D, [&](int64_t d) -> int8_t & { return kd[d * nr]; });
                    blk[scales + (H + h) * bt + o] = quantize_i8(
                        a.v + t * a.ldv + h * Dv, Dv, [&](int64_t c) -> int8_t & { return vd[c / nr * v_panel + c % nr]; });
                }
                continue;
            }
            for (int64_t h = 0; h < H; ++h) {
                // K: token o is lane o % NR of panel o / NR, one value per depth step.
                float *kd = blk + h * k_head + o / nr * nr * D + o % nr;
                const float *ks = a.k + t * a.ldk + h * D;
                for (int64_t d = 0; d < D; ++d) kd[d * nr] = ks[d];
                // V: its values split over the panels, NR at a time, row o of each.
                float *vd = blk + v_start + h * v_head + o * nr;
                const float *vs = a.v + t * a.ldv + h * Dv;
                for (int64_t c0 = 0; c0 < Dv; c0 += nr)
                    std::memcpy(vd + c0 / nr * v_panel, vs + c0, static_cast<size_t>(std::min(nr, Dv - c0)) * sizeof(float));
            }
        }
        s.blocks.swap(blocks);
        // The window: blocks that hold only positions before the first one the new tokens' windows
        // reach go back (for good: undo() keeps them released).
        const int64_t keep_from = cfg.window > 0 ? s.len - cfg.window + 1 : 0;
        for (int64_t b = s.released / bt; cfg.window > 0 && (b + 1) * bt <= keep_from; ++b) {
            unref(s.blocks[static_cast<size_t>(b)]);
            s.blocks[static_cast<size_t>(b)] = zero_block;
            s.released = (b + 1) * bt;
        }
        s.len += a.n;
    }
    if (cfg.window > 0) std::sort(free_blocks.begin(), free_blocks.end(), std::greater<>());  // as release keeps them
    return u;
}

void KVCache::Impl::undo(AppendUndo &u) noexcept {
    std::unique_lock lock(mutex);
    auto drop = [&](int32_t b) { unref(b); };
    for (size_t i = 0; i < u.ids.size(); ++i) {
        const auto it = seqs.find(u.ids[i]);
        if (it == seqs.end() || it->second.len == u.old_lens[i]) continue;  // nothing appended to it
        std::vector<int32_t> &now = it->second.blocks, &old = u.old_blocks[i];
        for (size_t j = 0; j < now.size(); ++j) {
            if (j < old.size() && now[j] == old[j]) continue;
            if (now[j] == zero_block) {  // released by that append: it stays released
                if (j < old.size()) old[j] = zero_block;
                continue;
            }
            drop(now[j]);                                      // a new block, or the private copy of a shared one
            if (j < old.size()) ref(old[j]);  // which it shares again
        }
        now.swap(old);
        it->second.len = u.old_lens[i];
    }
    for (int64_t id : u.created) seqs.erase(id);
    std::sort(free_blocks.begin(), free_blocks.end(), std::greater<>());  // as release keeps them
    u = AppendUndo{};
}

void KVCache::append(int64_t seq_id, int64_t n_tokens, const float *k, const float *v) {
    const KVCacheConfig &c = impl_->cfg;
    if (seq_id < 0) invalid_argument("seq_id = " + str(seq_id) + " is negative");
    if (n_tokens < 0) invalid_argument("n_tokens = " + str(n_tokens) + " is negative");
    if (n_tokens > impl_->num_blocks * c.block_tokens)
        throw Error(Status::out_of_memory, "kv cache: n_tokens = " + str(n_tokens) + " is more than the cache holds (" +
                                               str(impl_->num_blocks * c.block_tokens) + "); nothing was appended");
    if (n_tokens > 0 && !k) invalid_argument("k is NULL");
    if (n_tokens > 0 && !v) invalid_argument("v is NULL");
    const Impl::Append a{seq_id, n_tokens, k, v, c.num_kv_heads * c.head_dim, c.num_kv_heads * c.value_dim};
    impl_->append_all(std::span<const Impl::Append>(&a, 1));
}

void KVCache::fork(int64_t src_seq, int64_t dst_seq) {
    Impl &c = *impl_;
    std::unique_lock lock(c.mutex);
    const Impl::Seq &src = c.find(src_seq, "src_seq");
    if (dst_seq < 0) invalid_argument("dst_seq = " + str(dst_seq) + " is negative");
    if (c.seqs.count(dst_seq)) invalid_argument("dst_seq = " + str(dst_seq) + " is already a sequence of the kv cache");
    Impl::Seq copy = src;  // may throw, and then nothing has changed
    const auto &dst = c.seqs.emplace(dst_seq, std::move(copy)).first->second;
    for (int32_t b : dst.blocks) c.ref(b);
}

void KVCache::release(int64_t seq_id) {
    Impl &c = *impl_;
    std::unique_lock lock(c.mutex);
    const Impl::Seq &s = c.find(seq_id, "seq_id");
    for (int32_t b : s.blocks) c.unref(b);
    // Keep the lowest ids on top, so allocation stays in address order however blocks come back.
    std::sort(c.free_blocks.begin(), c.free_blocks.end(), std::greater<>());
    c.seqs.erase(seq_id);
}

int64_t KVCache::seq_len(int64_t seq_id) const {
    std::shared_lock lock(impl_->mutex);
    return impl_->find(seq_id, "seq_id").len;
}

bool KVCache::contains(int64_t seq_id) const {
    std::shared_lock lock(impl_->mutex);
    return impl_->seqs.count(seq_id) != 0;
}

int64_t KVCache::free_tokens() const {
    std::shared_lock lock(impl_->mutex);
    return static_cast<int64_t>(impl_->free_blocks.size()) * impl_->cfg.block_tokens;
}

void KVCache::read(int64_t seq_id, int64_t start, int64_t n, float *k, float *v) const {
    const Impl &c = *impl_;
    const int64_t bt = c.cfg.block_tokens, D = c.cfg.head_dim, Dv = c.cfg.value_dim, H = c.cfg.num_kv_heads;
    std::shared_lock lock(c.mutex);
    const Impl::Seq &s = c.find(seq_id, "seq_id");
    if (start < 0 || start > s.len) invalid_argument("start = " + str(start) + " is outside [0, " + str(s.len) + "], sequence " + str(seq_id) + "'s length");
    if (n < 0 || n > s.len - start)
        invalid_argument("n_tokens = " + str(n) + " is outside [0, " + str(s.len - start) + "]: sequence " + str(seq_id) +
                         " holds " + str(s.len) + " tokens and start = " + str(start));
    if (n > 0 && start < s.released)
        invalid_argument("start = " + str(start) + ": positions [0, " + str(s.released) + ") of sequence " + str(seq_id) +
                         " were released (they are outside the cache's window = " + str(c.cfg.window) + ")");
    for (int64_t t = 0; t < n; ++t) {
        const int64_t pos = start + t, o = pos % bt;
        const float *blk = c.block(s.blocks[static_cast<size_t>(pos / bt)]);
        if (c.i8) {  // widened: value times its token's scale
            const int8_t *blk8 = reinterpret_cast<const int8_t *>(blk);
            for (int64_t h = 0; h < H; ++h) {
                if (k) {
                    const float f = blk[c.scales + h * bt + o];
                    const int8_t *ks = blk8 + h * c.k_head + o / c.nr * c.nr * D + o % c.nr;
                    for (int64_t d = 0; d < D; ++d) k[(t * H + h) * D + d] = static_cast<float>(ks[d * c.nr]) * f;
                }
                if (v) {
                    const float f = blk[c.scales + (H + h) * bt + o];
                    for (int64_t d = 0; d < Dv; ++d)
                        v[(t * H + h) * Dv + d] =
                            static_cast<float>(blk8[c.v_start + h * c.v_head + d / c.nr * c.v_panel + o * c.nr + d % c.nr]) * f;
                }
            }
            continue;
        }
        for (int64_t h = 0; h < H; ++h) {
            if (k) {
                const float *ks = blk + h * c.k_head + o / c.nr * c.nr * D + o % c.nr;
                for (int64_t d = 0; d < D; ++d) k[(t * H + h) * D + d] = ks[d * c.nr];
            }
            if (v)
                for (int64_t c0 = 0; c0 < Dv; c0 += c.nr)
                    std::memcpy(v + (t * H + h) * Dv + c0, blk + c.v_start + h * c.v_head + c0 / c.nr * c.v_panel + o * c.nr,
                                static_cast<size_t>(std::min(c.nr, Dv - c0)) * sizeof(float));
        }
    }
}

KVCache::Impl::Snapshot KVCache::Impl::snapshot(std::span<const int64_t> seq_ids) const {
    Snapshot s;
    std::shared_lock lock(mutex);
    s.table_off.push_back(0);
    for (size_t i = 0; i < seq_ids.size(); ++i) {
        const Seq &q = find(seq_ids[i], ("seq_ids[" + std::to_string(i) + "]").c_str());
        s.lens.push_back(q.len);
        s.released.push_back(q.released);
        s.blocks.insert(s.blocks.end(), q.blocks.begin(), q.blocks.end());
        s.table_off.push_back(static_cast<int64_t>(s.blocks.size()));
    }
    s.view = attention_detail::CacheView{pool.get(), block_floats, cfg.block_tokens, nr, k_head, v_start, v_head, v_panel,
                                         s.table_off.data(), s.blocks.data()};
    s.view.i8 = i8;
    s.view.scales = scales;
    s.view.kv_heads = cfg.num_kv_heads;
    return s;
}

} // namespace mha
