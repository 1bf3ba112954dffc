// mha::Runtime: the threads, the tile config and the scratch space every kernel call runs with.
#pragma once

#include <memory>
#include <optional>

#include "mha/error.hpp"
#include "mha/isa.hpp"
#include "mha/tile_config.hpp"

namespace mha {

struct RuntimeOptions {
    int num_threads = 0;            // 0 = all hardware threads
    std::optional<Isa> isa;         // unset: MHA_ISA from the environment, else the best the CPU has
    std::optional<TileConfig> tiles; // unset: the defaults for the ISA and this machine's caches
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

    detail::RuntimeState &state() const { return *state_; }

private:
    std::unique_ptr<detail::RuntimeState> state_;
};

} // namespace mha
