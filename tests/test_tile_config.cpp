// Tile config files: round trip, the three ways a runtime reads one (C++ option, MHA_TILE_CONFIG,
// the C ABI), and every kind of broken config, each refused with a message naming file and problem.
#include <doctest/doctest.h>

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "mha/mha.h"
#include "mha/runtime.hpp"
#include "mha/tile_config.hpp"
#include "runtime/runtime_state.hpp"

using namespace mha;

namespace {

std::string temp_path(const std::string &name) {
    return (std::filesystem::temp_directory_path() / ("mha_test_" + std::to_string(getpid()) + "_" + name)).string();
}

std::string write(const std::string &name, const std::string &text) {
    const std::string p = temp_path(name);
    std::ofstream(p) << text;
    return p;
}

TileConfigFile tuned() {
    TileConfigFile f;
    f.isa = best_isa();
    f.cpu = cpu_model_name();
    f.date = "2026-11-22T00:00:00Z";
    f.tiles = default_tile_config(f.isa, detect_cache_sizes());
    f.tiles.kc = 200;  // not the default, so reading it back shows
    f.tiles.attn_block_k = 128;
    f.tiles.attn_kv_chunk = 512;
    f.tiles.parallel_min_flops = 12345;
    f.tiles.parallel_min_elems = 678;
    f.tiles.sup_chain_rows = 5;
    f.tiles.transpose = f.tiles.transpose == "inserts" ? "shuffles" : "inserts";  // the other one
    return f;
}

} // namespace

TEST_CASE("a tile config round-trips through its JSON and reaches the runtime") {
    const TileConfigFile f = tuned();
    const std::string text = tile_config_json(f);
    const TileConfigFile g = parse_tile_config(text, "mem");
    CHECK(g.isa == f.isa);
    CHECK(g.cpu == f.cpu);
    CHECK(g.date == f.date);
    CHECK(g.tiles.gemm_ukernel == f.tiles.gemm_ukernel);
    CHECK(g.tiles.mc == f.tiles.mc);
    CHECK(g.tiles.kc == 200);
    CHECK(g.tiles.nc == f.tiles.nc);
    CHECK(g.tiles.sup_max_n == f.tiles.sup_max_n);
    CHECK(g.tiles.sup_max_k == f.tiles.sup_max_k);
    CHECK(g.tiles.attn_block_q == f.tiles.attn_block_q);
    CHECK(g.tiles.attn_block_k == 128);
    CHECK(g.tiles.attn_kv_chunk == 512);
    CHECK(g.tiles.parallel_min_flops == 12345);
    CHECK(g.tiles.parallel_min_elems == 678);
    CHECK(g.tiles.sup_chain_rows == 5);
    CHECK(g.tiles.transpose == f.tiles.transpose);
    CHECK(g.tiles.transpose != default_tile_config(f.isa, detect_cache_sizes()).transpose);
    CHECK(tile_config_json(g) == text);

    const std::string path = write("good.json", text);
    SUBCASE("C++ option") {
        RuntimeOptions o;
        o.tile_config_path = path;
        Runtime rt(o);
        CHECK(rt.tiles().kc == 200);
        if (!std::getenv("MHA_TRANSPOSE")) CHECK(rt.tiles().transpose == f.tiles.transpose);
    }
    SUBCASE("MHA_TILE_CONFIG") {
        setenv("MHA_TILE_CONFIG", path.c_str(), 1);
        Runtime rt;
        unsetenv("MHA_TILE_CONFIG");
        CHECK(rt.tiles().kc == 200);
        CHECK(Runtime().tiles().kc != 200);
    }
    SUBCASE("C ABI") {
        mha_runtime *rt = nullptr;
        REQUIRE(mha_runtime_create_with_config(1, path.c_str(), &rt) == MHA_OK);
        const float a[2] = {1, 2}, b[2] = {3, 4};
        float c = 0;
        CHECK(mha_sgemm(rt, 'N', 'N', 1, 1, 2, 1.0f, a, 2, b, 1, 0.0f, &c, 1) == MHA_OK);
        CHECK(c == 11.0f);
        mha_runtime_destroy(rt);
        REQUIRE(mha_runtime_create_with_config(1, nullptr, &rt) == MHA_OK);  // NULL: the defaults
        mha_runtime_destroy(rt);
    }
    SUBCASE("a partial config takes the defaults for the rest") {
        const std::string p = write("partial.json", R"({"format": "mha-tile-config", "version": 1, "isa": ")" +
                                                        std::string(isa_name(best_isa())) + R"(", "tiles": {"kc": 128}})");
        RuntimeOptions o;
        o.tile_config_path = p;
        Runtime rt(o);
        CHECK(rt.tiles().kc == 128);
        CHECK(rt.tiles().mc == Runtime().tiles().mc);
        std::remove(p.c_str());
    }
    std::remove(path.c_str());
}

TEST_CASE("a broken tile config fails runtime creation, naming the file and the problem") {
    const TileConfigFile f = tuned();
    const std::string isa(isa_name(f.isa));
    const std::string head = R"({"format": "mha-tile-config", "version": 1, "isa": ")" + isa + R"(", )";
    struct Bad {
        const char *what;
        std::string text;
        const char *message;
    };
    std::vector<Bad> bad = {
        {"not JSON", "{\"format\": ", "not valid JSON"},
        {"empty file", "", "not valid JSON"},
        {"an array", "[1, 2]", "JSON object"},
        {"unknown top-level key", head + R"("tiles": {}, "speed": 3})", "unknown key \"speed\""},
        {"unknown tile key", head + R"("tiles": {"kcc": 3}})", "unknown key \"tiles.kcc\""},
        {"wrong type", head + R"("tiles": {"kc": "big"}})", "tiles.kc must be an integer"},
        {"float value", head + R"("tiles": {"kc": 12.5}})", "tiles.kc must be an integer"},
        {"kc zero", head + R"("tiles": {"kc": 0}})", "kc must be in"},
        {"mc not a multiple of MR", head + R"("tiles": {"mc": 7}})", "mc must be a multiple of MR"},
        {"nc too small", head + R"("tiles": {"nc": 1}})", "nc must be a multiple of NR"},
        {"chunk not a multiple", head + R"("tiles": {"attn_kv_chunk": 1000}})", "attn_kv_chunk"},
        {"negative parallel_min_flops", head + R"("tiles": {"parallel_min_flops": -1}})", "parallel_min_flops must be in"},
        {"negative parallel_min_elems", head + R"("tiles": {"parallel_min_elems": -5}})", "parallel_min_elems must be in"},
        {"sup_chain_rows too large", head + R"("tiles": {"sup_chain_rows": 65}})", "sup_chain_rows must be in"},
        {"negative sup_chain_rows", head + R"("tiles": {"sup_chain_rows": -1}})", "sup_chain_rows must be in"},
        {"unknown microkernel", head + R"("tiles": {"gemm_ukernel": "avx512_99x99"}})", "not a known microkernel"},
        {"unknown transpose", head + R"("tiles": {"transpose": "rotate"}})", "transpose must be \"shuffles\" or \"inserts\""},
        {"empty transpose", head + R"("tiles": {"transpose": ""}})", "transpose must be"},
        {"transpose not a string", head + R"("tiles": {"transpose": 1}})", "tiles.transpose must be a string"},
        {"wrong format", R"({"format": "other", "version": 1, "isa": "avx2", "tiles": {}})", "\"format\" must be"},
        {"wrong version", R"({"format": "mha-tile-config", "version": 7, "isa": "avx2", "tiles": {}})", "\"version\" must be 1"},
        {"unknown isa", R"({"format": "mha-tile-config", "version": 1, "isa": "sse2", "tiles": {}})", "not one of avx2"},
        {"missing tiles", head.substr(0, head.size() - 2) + "}", "missing the \"tiles\""},
    };
    // A microkernel of another ISA than the file says, and a file for another ISA than the runtime.
    if (cpu_supports(Isa::avx512) && cpu_supports(Isa::avx2)) {
        bad.push_back({"kernel of the other ISA", head + R"("tiles": {"gemm_ukernel": "avx2_6x16"}})", "is for avx2"});
        if (f.isa == Isa::avx512)
            bad.push_back({"config for another ISA",
                           R"({"format": "mha-tile-config", "version": 1, "isa": "avx2", "tiles": {}})",
                           "it is for avx2, but this runtime uses avx512"});
    }
    for (const auto &b : bad) {
        CAPTURE(b.what);
        const std::string path = write("bad.json", b.text);
        RuntimeOptions o;
        o.tile_config_path = path;
        CHECK_THROWS_WITH_AS(Runtime{o}, doctest::Contains(path.c_str()), Error);
        CHECK_THROWS_WITH_AS(Runtime{o}, doctest::Contains(b.message), Error);
        mha_runtime *rt = reinterpret_cast<mha_runtime *>(0x1);
        CHECK(mha_runtime_create_with_config(1, path.c_str(), &rt) == MHA_INVALID_ARGUMENT);
        CHECK(rt == nullptr);
        CHECK(std::string(mha_last_error()).find(b.message) != std::string::npos);
        setenv("MHA_TILE_CONFIG", path.c_str(), 1);
        CHECK(mha_runtime_create(1, &rt) == MHA_INVALID_ARGUMENT);
        CHECK(std::string(mha_last_error()).find(path) != std::string::npos);
        unsetenv("MHA_TILE_CONFIG");
        std::remove(path.c_str());
    }
    const std::string missing = temp_path("does_not_exist.json");
    mha_runtime *rt = nullptr;
    CHECK(mha_runtime_create_with_config(1, missing.c_str(), &rt) == MHA_INVALID_ARGUMENT);
    CHECK(std::string(mha_last_error()).find(missing + ": cannot open") != std::string::npos);
    CHECK(mha_runtime_create_with_config(1, "", nullptr) == MHA_INVALID_ARGUMENT);
}

TEST_CASE("threads only where they pay: the defaults, and MHA_PARALLEL_ALWAYS=1 turning them off") {
    const char *saved = std::getenv("MHA_PARALLEL_ALWAYS");
    const std::string keep = saved ? saved : "";
    unsetenv("MHA_PARALLEL_ALWAYS");
    const TileConfig d = default_tile_config(best_isa(), detect_cache_sizes());
    CHECK(d.parallel_min_flops > 0);
    CHECK(d.parallel_min_elems > 0);
    {
        Runtime rt(RuntimeOptions{2, {}, {}, {}});
        CHECK(rt.tiles().parallel_min_flops == d.parallel_min_flops);
        CHECK(rt.tiles().parallel_min_elems == d.parallel_min_elems);
    }
    setenv("MHA_PARALLEL_ALWAYS", "1", 1);
    {
        Runtime rt(RuntimeOptions{2, {}, {}, {}});
        CHECK(rt.tiles().parallel_min_flops == 0);
        CHECK(rt.tiles().parallel_min_elems == 0);
    }
    if (saved) setenv("MHA_PARALLEL_ALWAYS", keep.c_str(), 1);
    else unsetenv("MHA_PARALLEL_ALWAYS");
}

TEST_CASE("a call that reads more than it computes counts its stream toward the threads") {
    // RuntimeState::work_with_stream: data past the packed GEMM's KC x NC block (half of L2), read
    // once, counts 24 FLOPs a float, or the call's FLOPs where they are more; data under it (in L2
    // from call to call) counts nothing. With the default thresholds, a row against 1536 x 512
    // floats (the decode step's QKV projection at E512) takes two threads, against 512 x 512 one.
    const char *saved = std::getenv("MHA_PARALLEL_ALWAYS");
    const std::string keep = saved ? saved : "";
    unsetenv("MHA_PARALLEL_ALWAYS");
    {
        Runtime rt(RuntimeOptions{2, {}, {}, {}});
        const auto &st = rt.state();
        const double block = static_cast<double>(st.tiles.kc) * static_cast<double>(st.tiles.nc);
        CHECK(st.work_with_stream(1e6, block - 1) == 1e6);
        CHECK(st.work_with_stream(1e6, block) == 24.0 * block);
        CHECK(st.work_with_stream(1e12, block) == 1e12);
        auto threads = [&](double m, double n, double k) {
            return st.threads_for(st.work_with_stream(2.0 * m * n * k, n * k), st.tiles.parallel_min_flops);
        };
        if (1536.0 * 512.0 >= block) CHECK(threads(1, 1536, 512) == 2);  // (every L2 of up to 6 MiB)
        CHECK(threads(1, 512, 512) == 1);
        CHECK(threads(1024, 1536, 512) == 2);
    }
    if (saved) setenv("MHA_PARALLEL_ALWAYS", keep.c_str(), 1);
    else unsetenv("MHA_PARALLEL_ALWAYS");
}

// The per-CPU GEMM blocking rules of default_tile_config, on the caches of the machines they were
// measured on (src/runtime/tile_config.cpp). Only the numbers are computed: no kernel runs, so
// every rule is checked on any host.
TEST_CASE("default GEMM blocking: AVX-512 KC from the A micro-panel (512 at 48 KiB of L1d, 336 at 32 KiB), the formulas on AVX2; the chain's rows and the transpose by vendor") {
    auto caches = [](int64_t l1d, int64_t l2, int64_t l3, bool amd, int family) {
        CacheSizes c;
        c.l1d = l1d; c.l2 = l2; c.l3 = l3; c.amd = amd; c.family = family;
        return c;
    };
    constexpr int64_t KiB = 1024, MiB = 1024 * KiB;
    // Intel Xeon (48 KiB L1d, 2 MiB L2): KC 512, NC = L2 / 2 / (4 KC) = 512, MC = L3 / 4 capped at 4088.
    const TileConfig xeon = default_tile_config(Isa::avx512, caches(48 * KiB, 2 * MiB, 480 * MiB, false, 6));
    CHECK(xeon.kc == 512);
    CHECK(xeon.nc == 512);
    CHECK(xeon.mc == 4088);
    CHECK(xeon.sup_max_k == 512);
    CHECK(xeon.parallel_min_flops == int64_t{8} << 20);
    // AMD Zen 5 (48 KiB L1d, 1 MiB L2): KC 512, NC 256, MC = 4 L2 / (4 KC) = 2044, and its own
    // threshold for a second thread.
    const TileConfig zen5 = default_tile_config(Isa::avx512, caches(48 * KiB, 1 * MiB, 32 * MiB, true, 0x1a));
    CHECK(zen5.kc == 512);
    CHECK(zen5.nc == 256);
    CHECK(zen5.mc == 2044);
    CHECK(zen5.parallel_min_flops == int64_t{9} << 19);
    // A 32 KiB L1d (Zen 4, Skylake-X): the A micro-panel in 7/12 of it, 32 KiB x 7/12 / (14 x 4)
    // = 341 -> 336; NC = 1 MiB / 2 / (4 KC) = 390 -> 384.
    const TileConfig zen4 = default_tile_config(Isa::avx512, caches(32 * KiB, 1 * MiB, 32 * MiB, true, 0x19));
    CHECK(zen4.kc == 336);
    CHECK(zen4.nc == 384);
    CHECK(zen4.sup_max_k == 336);
    // The rule stops at KC 512 (a 64 KiB L1d would give 682).
    CHECK(default_tile_config(Isa::avx512, caches(64 * KiB, 2 * MiB, 32 * MiB, false, 6)).kc == 512);
    // AVX2 (6x16) keeps the formula on any cache: 48 KiB / (22 x 4) = 558 -> 552.
    const TileConfig avx2 = default_tile_config(Isa::avx2, caches(48 * KiB, 2 * MiB, 480 * MiB, false, 6));
    CHECK(avx2.kc == 552);
    CHECK(avx2.gemm_ukernel == "avx2_6x16");
    // Strips against a B past L2 take the chain at any stride on Intel (2 rows; AVX2 4), only at
    // 4 KiB multiples on AMD.
    CHECK(xeon.sup_chain_rows == 2);
    CHECK(avx2.sup_chain_rows == 4);
    CHECK(zen5.sup_chain_rows == 0);
    CHECK(zen4.sup_chain_rows == 0);
    // The register transpose: the shuffles on AMD's cores, the inserts on the others.
    CHECK(xeon.transpose == "inserts");
    CHECK(avx2.transpose == "inserts");
    CHECK(zen5.transpose == "shuffles");
    CHECK(zen4.transpose == "shuffles");
    for (const TileConfig &t : {xeon, zen5, zen4}) CHECK_NOTHROW(t.validate(Isa::avx512));
    CHECK_NOTHROW(avx2.validate(Isa::avx2));
}

// Found by fuzz/fuzz_tile_config: a number too large for JSON's double ("6e3333") made the parser
// throw out_of_range, not parse_error; it escaped parse_tile_config as a non-mha::Error (MHA_INTERNAL
// through the C ABI). Now it is a broken config like any other.
TEST_CASE("a tile config with a number out of range is refused as broken JSON") {
    for (const char *text : {R"({"format": 6e3333333333333})", R"({"tiles": {"mc": -1e999}})", R"([1e400])"}) {
        try {
            parse_tile_config(text, "big.json");
            FAIL("parsed " << text);
        } catch (const Error &e) {
            CHECK(e.status() == Status::invalid_argument);
            CHECK(std::string(e.what()).find("tile config big.json: not valid JSON") == 0);
        }
    }
}
