// Tile sizes for every kernel, resolved once per runtime. Defaults come from the detected cache
// sizes (see tile_config.cpp for the reasoning); the tuner writes its own.
#pragma once

#include <cstdint>
#include <string>

#include "mha/isa.hpp"

namespace mha {

struct CacheSizes {
    int64_t l1d = 48 * 1024;   // bytes, per core
    int64_t l2 = 2048 * 1024;  // bytes, per core
    int64_t l3 = 32 << 20;     // bytes, shared
    // The CPU, for the defaults that differ by microarchitecture (unknown: false and 0).
    bool amd = false;
    int family = 0;  // cpuid's family (base + extended): AMD Zen 3 and 4 0x19, Zen 5 0x1A
};

struct TileConfig {
    // GEMM microkernel variant, by name from the kernel list ("avx512_14x32", "avx2_6x16", ...).
    std::string gemm_ukernel;
    int64_t mc = 0;  // rows of the packed A block, shared by the threads (multiple of MR)
    int64_t kc = 0;  // depth of a packed block
    int64_t nc = 0;  // columns of a packed B block, one per thread (multiple of NR)
    // Small-problem ("sup") path: A read in place (a transposed A's strips copied once per depth
    // block: see sgemm_sup) when op(B) has at most sup_max_n columns, or when the depth is at most
    // sup_max_k.
    int64_t sup_max_n = 0;
    int64_t sup_max_k = 0;
    // A strip of at most this many rows against a B read in place that does not fit in L2 (k x n
    // at least 2 KC x NC) walks B's depth 8 rows at a time across its columns, whatever B's stride
    // (0: only where B's rows lie a multiple of 4 KiB apart, as they always do). The bits never
    // depend on it.
    int64_t sup_chain_rows = 0;
    // Fused attention: query rows per head in one work item, and keys per score tile. (The
    // direct path for items of at most 12 rows per KV head, as in decode, always takes 16 keys
    // per tile; see src/attention/attention_shape.hpp.)
    int64_t attn_block_q = 0;
    int64_t attn_block_k = 0;
    // Keys per chunk (a multiple of attn_block_k). Each chunk's softmax state is computed on its
    // own and the chunks merged in order; when there are fewer work items than threads, and on the
    // direct path, the chunks of one item run on different threads with the same result.
    int64_t attn_kv_chunk = 0;
    // Threads only where they pay: a call uses a thread for each full share of this much work
    // (so a second thread only from twice it), else it runs on the calling thread alone. Waking
    // the arena's sleeping threads and joining them costs tens of microseconds, which a small call
    // does not win back. FLOPs for the GEMM and the attention (2 per multiply-add), elements for
    // softmax and Add & Norm. 0: every call uses every thread. The bits never depend on it.
    int64_t parallel_min_flops = 0;
    int64_t parallel_min_elems = 0;
    // The register transpose of the transposing packs (B^T's panels, A^T's strips, the
    // attention's K^T) and of the few-rows products against B^T: "shuffles" or "inserts" (see
    // src/gemm/transpose_variant.hpp). The default is the CPU's: shuffles on AMD's cores, inserts
    // on the others. MHA_TRANSPOSE overrides it for every runtime. The bits never depend on it.
    std::string transpose;

    // Threads mha::Error(invalid_argument) naming the field when a value breaks a kernel constraint.
    void validate(Isa isa) const;

    // Every field equal (so a new field joins the comparison by itself).
    bool operator==(const TileConfig &) const = default;
};

// A tile config file, as mha-tune writes it and the runtime reads it (MHA_TILE_CONFIG=path, or
// RuntimeOptions::tile_config_path, or mha_runtime_create_with_config):
//   {"format": "mha-tile-config", "version": 1, "isa": "avx512", "cpu": "<model name>",
//    "date": "2026-11-22T04:40:00Z", "tiles": {"gemm_ukernel": "avx512_14x32", "mc": 4088, ...}}
// "tiles" holds TileConfig's fields by name; a field it leaves out takes this machine's default.
// "cpu" and "date" are informational. The runtime refuses a config for another ISA than its own.
struct TileConfigFile {
    Isa isa = Isa::avx2;
    std::string cpu, date;
    TileConfig tiles;
};

// Parses and validates a config (`name` is used in messages). Throws mha::Error(invalid_argument)
// with "tile config <name>: <problem>" for bad JSON, unknown keys, wrong types, values that break a
// kernel constraint, or an ISA this CPU lacks.
TileConfigFile parse_tile_config(const std::string &text, const std::string &name);
// Reads the file at path and parses it (an unreadable file is an invalid argument too).
TileConfigFile load_tile_config(const std::string &path);
// The JSON text of a config (what load_tile_config reads back).
std::string tile_config_json(const TileConfigFile &config);
// This CPU's model name (from /proc/cpuinfo), or "unknown".
std::string cpu_model_name();

// The CPU's cache sizes, from sysconf (falling back to the defaults above).
CacheSizes detect_cache_sizes();

// The default tiles for an ISA on a machine with these caches.
TileConfig default_tile_config(Isa isa, const CacheSizes &caches);

} // namespace mha
