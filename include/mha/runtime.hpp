// mha::Runtime: the threads, the tile config and the scratch space every kernel call runs with.
#pragma once

#include <memory>
#include <optional>
#include <string>

#include "mha/error.hpp"
#include "mha/isa.hpp"
#include "mha/tile_config.hpp"

namespace mha {

struct RuntimeOptions {
    int num_threads = 0;            // 0 = all hardware threads
    std::optional<Isa> isa;         // unset: MHA_ISA from the environment, else the best the CPU has
    std::optional<TileConfig> tiles; // unset: tile_config_path, else MHA_TILE_CONFIG, else the defaults
    // A tile config file (see tile_config.hpp) to read when `tiles` is unset; empty: the
    // environment variable MHA_TILE_CONFIG, if set. A broken config fails the constructor with
    // mha::Error(invalid_argument), naming the file and the problem; it is never ignored.
    std::string tile_config_path;
};

namespace detail { struct RuntimeState; }

class Runtime {
public:
    explicit Runtime(const RuntimeOptions &options = {});
    ~Runtime();
    Runtime(const Runtime &) = delete;
    Runtime &operator=(const Runtime &) = delete;

    int num_threads() const;
    Isa isa() const;
    const TileConfig &tiles() const;
    // Bytes of scratch the runtime holds between calls: each call borrows what it needs (the
    // buffers grow to the largest call so far and are kept for the next), so after a call this
    // is at least that call's scratch. It grows with the tiles and the threads, not with Lq x Lk.
    size_t scratch_bytes() const;

    detail::RuntimeState &state() const { return *state_; }

private:
    std::unique_ptr<detail::RuntimeState> state_;
};

} // namespace mha
