// libFuzzer target: the tile-config reader (mha::parse_tile_config, what mha_runtime_create_with_config
// and MHA_TILE_CONFIG read). Any text must either give a config that passes the kernels' checks, or
// throw mha::Error(invalid_argument) with a message naming the file; never crash or throw anything
// else. A parsed config must survive the round trip through tile_config_json.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <string>

#include "mha/error.hpp"
#include "mha/tile_config.hpp"

namespace {

[[noreturn]] void fail(const char *what) {
    std::fprintf(stderr, "mha-fuzz: tile config: %s\n", what);
    __builtin_trap();
}

bool same(const mha::TileConfigFile &a, const mha::TileConfigFile &b) {
    return a.isa == b.isa && a.cpu == b.cpu && a.date == b.date && a.tiles == b.tiles;
}

} // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    const std::string text(reinterpret_cast<const char *>(data), size);
    mha::TileConfigFile f;
    try {
        f = mha::parse_tile_config(text, "fuzz.json");
    } catch (const mha::Error &e) {
        if (e.status() != mha::Status::invalid_argument) fail("a status other than invalid_argument");
        if (std::string(e.what()).rfind("tile config fuzz.json: ", 0) != 0) fail("a message that does not name the file");
        return 0;
    }
    try {
        f.tiles.validate(f.isa);
    } catch (const mha::Error &) {
        fail("a parsed config fails validate()");
    }
    mha::TileConfigFile g;
    try {
        g = mha::parse_tile_config(mha::tile_config_json(f), "round-trip");
    } catch (const mha::Error &) {
        fail("the JSON of a parsed config does not parse");
    }
    if (!same(f, g)) fail("the round trip changed the config");
    return 0;
}
