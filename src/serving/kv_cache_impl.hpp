// The paged KV cache's insides, shared by the cache itself, attention over it and the layer's
// incremental forward.
//
// Memory: one pool of num_blocks blocks, all allocated (and zeroed, so the pages are committed)
// when the cache is created; serving never calls the allocator. The pool is 2 MiB aligned and
// asks the kernel for transparent huge pages: a decode step streams the whole cache, and with
// 4 KiB pages it would take a TLB miss every 4 KiB. A block holds
// block_tokens tokens of every KV head: first each head's K as NR-key panels of head_dim depth
// (the packed B of Q K^T: keys across the vector lanes, so a score is a plain FMA chain), then each
// head's V as NR-column panels of block_tokens depth (the packed B of P V: every pass over V
// reads contiguous memory). Sequences own blocks through their block tables; blocks are reference-counted so
// a fork shares them, and a shared block is copied before an append writes into it.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "attention/attention_shape.hpp"
#include "mha/serving.hpp"
#include "runtime/runtime_state.hpp"

namespace mha {

struct KVCache::Impl {
    KVCacheConfig cfg;                    // resolved
    std::string ukernel;                  // the runtime's microkernel and attention tiles at creation
    int64_t nr = 0, block_k = 0, kv_chunk = 0;
    int64_t block_floats = 0, k_head = 0, v_start = 0, v_head = 0, v_panel = 0, num_blocks = 0;
    // int8 (cfg.dtype == i8): the panel offsets above count int8 values (bytes), and the scales
    // start at float `scales` of each block: K's [num_kv_heads][block_tokens], then V's.
    bool i8 = false;
    int64_t scales = 0;
    detail::AlignedPtr<float> pool;

    mutable std::shared_mutex mutex;  // guards everything below (block contents: see mha.h)
    std::vector<int32_t> refs;        // per block: how many sequences hold it
    std::vector<int32_t> free_blocks; // a stack; the lowest ids come out first
    struct Seq {
        int64_t len = 0;
        int64_t released = 0;  // cfg.window: positions [0, released) went back to the free blocks
        std::vector<int32_t> blocks;  // a released block reads as zero_block
    };
    // cfg.window > 0: one block of zeros past the others (never handed out, not reference-counted)
    // that released positions point to, so a table stays indexed by position.
    int32_t zero_block = -1;
    void unref(int32_t b) {  // free_blocks never grows past num_blocks: no reallocation
        if (b != zero_block && --refs[static_cast<size_t>(b)] == 0) free_blocks.push_back(b);
    }
    void ref(int32_t b) {
        if (b != zero_block) ++refs[static_cast<size_t>(b)];
    }
    std::unordered_map<int64_t, Seq> seqs;

    // One sequence's new tokens: k rows of Hkv * head_dim floats ldk apart, v rows ldv apart.
    struct Append {
        int64_t seq = 0, n = 0;
        const float *k = nullptr, *v = nullptr;
        int64_t ldk = 0, ldv = 0;
    };
    // What append_all changed, so that undo() can put it back exactly (the sequences' lengths and
    // block tables, the ids it created, and so the free blocks).
    struct AppendUndo {
        std::vector<int64_t> ids, old_lens, created;
        std::vector<std::vector<int32_t>> old_blocks;
    };
    // Appends to every sequence, or (not enough free blocks: Error(out_of_memory), or the memory
    // for its own bookkeeping missing: std::bad_alloc) to none. The sequences must be distinct.
    AppendUndo append_all(std::span<const Append> appends);
    // Takes back an append_all whose sequences nobody has written since (a caller that fails after
    // appending, such as the layer's forward_cached). Allocates nothing.
    void undo(AppendUndo &u) noexcept;

    // Throws unless rt runs the microkernel and attention tiles the cache was laid out for.
    void check_runtime(const detail::RuntimeState &st) const;

    // The block tables and lengths of some sequences, copied under the lock for one attention call.
    struct Snapshot {
        std::vector<int64_t> lens, released, table_off;
        std::vector<int32_t> blocks;
        attention_detail::CacheView view;
    };
    Snapshot snapshot(std::span<const int64_t> seq_ids) const;

    const Seq &find(int64_t seq_id, const char *what) const;  // throws naming `what` for an unknown id
    float *block(int32_t id) const { return pool.get() + id * block_floats; }
};

} // namespace mha
