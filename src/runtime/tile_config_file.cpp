// Tile config files: the JSON that mha-tune writes and the runtime reads back.
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "mha/error.hpp"
#include "mha/tile_config.hpp"

namespace mha {
namespace {

constexpr const char *kFormat = "mha-tile-config";
constexpr int kVersion = 1;

// The string fields of TileConfig, by name.
struct StringField {
    const char *name;
    std::string TileConfig::*member;
};
constexpr StringField kStringFields[] = {
    {"gemm_ukernel", &TileConfig::gemm_ukernel},
    {"transpose", &TileConfig::transpose},
};

// The integer fields of TileConfig, by name.
struct IntField {
    const char *name;
    int64_t TileConfig::*member;
};
constexpr IntField kIntFields[] = {
    {"mc", &TileConfig::mc},
    {"kc", &TileConfig::kc},
    {"nc", &TileConfig::nc},
    {"sup_max_n", &TileConfig::sup_max_n},
    {"sup_max_k", &TileConfig::sup_max_k},
    {"sup_chain_rows", &TileConfig::sup_chain_rows},
    {"attn_block_q", &TileConfig::attn_block_q},
    {"attn_block_k", &TileConfig::attn_block_k},
    {"attn_kv_chunk", &TileConfig::attn_kv_chunk},
    {"parallel_min_flops", &TileConfig::parallel_min_flops},
    {"parallel_min_elems", &TileConfig::parallel_min_elems},
};

} // namespace

std::string cpu_model_name() {
    std::ifstream f("/proc/cpuinfo");
    for (std::string line; std::getline(f, line);)
        if (line.rfind("model name", 0) == 0) {
            const size_t colon = line.find(':');
            if (colon != std::string::npos) return line.substr(line.find_first_not_of(' ', colon + 1));
        }
    return "unknown";
}

TileConfigFile parse_tile_config(const std::string &text, const std::string &name) {
    auto fail = [&](const std::string &what) { invalid_argument("tile config " + name + ": " + what); };
    nlohmann::json j;
    try {
        j = nlohmann::json::parse(text);
    } catch (const nlohmann::json::exception &e) {  // parse_error, or out_of_range for a number too large
        fail(std::string("not valid JSON (") + e.what() + ")");
    }
    if (!j.is_object()) fail("expected a JSON object at the top level");
    auto string_field = [&](const nlohmann::json &o, const char *key, bool required) -> std::string {
        if (!o.contains(key)) {
            if (required) fail(std::string("missing \"") + key + "\"");
            return {};
        }
        if (!o[key].is_string()) fail(std::string("\"") + key + "\" must be a string");
        return o[key].get<std::string>();
    };
    for (const auto &[key, value] : j.items())
        if (key != "format" && key != "version" && key != "isa" && key != "cpu" && key != "date" && key != "tiles")
            fail("unknown key \"" + key + "\" (expected format, version, isa, cpu, date, tiles)");
    if (string_field(j, "format", true) != kFormat) fail(std::string("\"format\" must be \"") + kFormat + "\"");
    if (!j.contains("version") || !j["version"].is_number_integer() || j["version"].get<int64_t>() != kVersion)
        fail("\"version\" must be " + std::to_string(kVersion));
    TileConfigFile f;
    const std::string isa = string_field(j, "isa", true);
    const auto parsed = parse_isa(isa);
    if (!parsed) fail("\"isa\" is \"" + isa + "\", not one of avx2, avx512");
    f.isa = *parsed;
    if (!cpu_supports(f.isa)) fail("it is for " + isa + ", which this CPU does not support");
    f.cpu = string_field(j, "cpu", false);
    f.date = string_field(j, "date", false);
    if (!j.contains("tiles") || !j["tiles"].is_object()) fail("missing the \"tiles\" object");
    f.tiles = default_tile_config(f.isa, detect_cache_sizes());
    for (const auto &[key, value] : j["tiles"].items()) {
        const StringField *text_field = nullptr;
        for (const auto &x : kStringFields)
            if (key == x.name) text_field = &x;
        if (text_field) {
            if (!value.is_string()) fail("tiles." + key + " must be a string");
            f.tiles.*(text_field->member) = value.get<std::string>();
            continue;
        }
        const IntField *field = nullptr;
        for (const auto &x : kIntFields)
            if (key == x.name) field = &x;
        if (!field) fail("unknown key \"tiles." + key + "\"");
        if (!value.is_number_integer()) fail("tiles." + key + " must be an integer");
        f.tiles.*(field->member) = value.get<int64_t>();
    }
    try {
        f.tiles.validate(f.isa);
    } catch (const Error &e) {
        std::string why = e.what();
        if (why.rfind("tile config: ", 0) == 0) why = why.substr(13);
        fail(why);
    }
    return f;
}

TileConfigFile load_tile_config(const std::string &path) {
    std::ifstream in(path, std::ios::binary);
    if (!in) invalid_argument("tile config " + path + ": cannot open the file");
    std::ostringstream text;
    text << in.rdbuf();
    return parse_tile_config(text.str(), path);
}

std::string tile_config_json(const TileConfigFile &f) {
    nlohmann::ordered_json j;
    j["format"] = kFormat;
    j["version"] = kVersion;
    j["isa"] = std::string(isa_name(f.isa));
    j["cpu"] = f.cpu;
    j["date"] = f.date;
    for (const auto &x : kStringFields) j["tiles"][x.name] = f.tiles.*(x.member);
    for (const auto &x : kIntFields) j["tiles"][x.name] = f.tiles.*(x.member);
    return j.dump(2) + "\n";
}

} // namespace mha
