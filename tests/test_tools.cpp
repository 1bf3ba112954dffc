// mha-tune and mha-bench end to end: a short tuning run writes a config that reads back and that
// mha-run then runs with; broken configs stop the tools with the file and the problem; mha-bench
// --quick --json prints one object with every suite, and its serving and encoder rows carry what
// they claim.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "mha/tile_config.hpp"
#include "run_tool.hpp"

using namespace mha;
using mha::test::shell_quote;
using mha::test::run_tool;
using mha::test::TempDir;
namespace fs = std::filesystem;

namespace {

const fs::path kSelf = fs::path(MHA_TEST_DATA) / "layer" / "self";

std::string run_args() {
    return "--weights " + shell_quote(kSelf / "weights") + " --num-heads 4 --query " + shell_quote(kSelf / "query.npy");
}

} // namespace

namespace {

// mha-tune's CSV: each phase with the shapes it measured its candidates on.
std::map<std::string, std::set<std::string>> csv_phases(const std::string &path) {
    std::ifstream csv(path);
    std::string header, line;
    std::getline(csv, header);
    CHECK(header.rfind("phase,gemm_ukernel,mc,kc,nc,attn_block_q,attn_block_k,attn_kv_chunk,sup_chain_rows,"
                       "parallel_min_flops,parallel_min_elems,transpose,shape,", 0) == 0);
    std::map<std::string, std::set<std::string>> phases;
    while (std::getline(csv, line)) {
        const auto q0 = line.find('"'), q1 = line.find('"', q0 + 1);
        REQUIRE(q1 != std::string::npos);
        phases[line.substr(0, line.find(','))].insert(line.substr(q0 + 1, q1 - q0 - 1));
    }
    return phases;
}

// mha-tune --quick --max-candidates 1 and `args`, writing t.json and t.csv into tmp: it must succeed.
mha::test::ToolResult tune_quick(const TempDir &tmp, const std::string &args) {
    // (MHA_TRANSPOSE would override the transpose the tuner searches.)
    auto r = run_tool("MHA_TUNE", "--quick --max-candidates 1 " + args + " --out " + tmp / "t.json" + " --csv " + tmp / "t.csv",
                      true, "MHA_TRANSPOSE=");
    INFO(r.output);
    REQUIRE(r.code == 0);
    return r;
}

} // namespace

TEST_CASE("mha-tune writes a tile config and a CSV that read back; the runtime and mha-run use it") {
    TempDir tmp;
    const auto r = tune_quick(tmp, "");
    INFO(r.output);
    CHECK(r.output.find("speedup") != std::string::npos);
    CHECK(r.output.find("all shapes (geometric mean)") != std::string::npos);
    const TileConfigFile f = load_tile_config(tmp / "t.json");
    CHECK(f.isa == best_isa());
    CHECK(f.cpu == cpu_model_name());
    CHECK(f.date.size() == 20);
    // One thread: no threads phase. The GEMM candidates are scored on the attention too (their
    // microkernel runs it), the attention tiles on a decode step too, the rows phase on few-row
    // products, the transpose on the calls that transpose.
    const auto phases = csv_phases(tmp / "t.csv");
    REQUIRE(phases.size() == 4);
    CHECK(phases.count("gemm"));
    CHECK(phases.count("attention"));
    REQUIRE(phases.count("rows"));
    REQUIRE(phases.count("transpose"));
    CHECK(phases.at("transpose").count("gemm 8x1536x512 NT"));
    CHECK(phases.at("transpose").count("attention L1024 H8 D64"));
    CHECK_FALSE(phases.at("transpose").count("gemm 1x2000x2000 NN"));  // nothing transposes there
    CHECK(phases.at("gemm").count("attention L1024 H8 D64"));
    CHECK(phases.at("gemm").count("gemm 1024x512x512 NT"));
    REQUIRE(phases.count("attention"));
    CHECK(phases.at("attention").count("decode Lk4096 H32/8 D128"));  // the key block serves decode too
    CHECK(phases.at("rows").count("gemm 1x2000x2000 NN"));

    const auto ok = run_tool("MHA_RUN", run_args(), true, "MHA_TILE_CONFIG=" + shell_quote(tmp / "t.json"));
    INFO(ok.output);
    CHECK(ok.code == 0);
}

TEST_CASE("mha-tune --threads 2 also searches the work from which a call takes a second thread, flops and elements") {
    TempDir tmp;
    const auto r = tune_quick(tmp, "--threads 2");
    INFO(r.output);
    CHECK(r.output.find("parallel_min_flops=") != std::string::npos);
    const auto phases = csv_phases(tmp / "t.csv");
    REQUIRE(phases.count("threads"));
    CHECK(phases.at("threads").count("gemm 128^3 NN"));
    CHECK(phases.at("threads").count("attention L64 H8 D64"));
    CHECK(phases.at("threads").count("gemm 1x1536x512 NT"));  // a call that reads more than it computes
    REQUIRE(phases.count("elems"));
    CHECK(phases.at("elems").count("softmax 1024x128"));
    CHECK(r.output.find("parallel_min_elems=") != std::string::npos);
    const TileConfigFile f = load_tile_config(tmp / "t.json");
    CHECK(f.tiles.parallel_min_flops >= int64_t{2} << 20);
    CHECK(f.tiles.parallel_min_flops <= int64_t{32} << 20);
    CHECK(f.tiles.parallel_min_elems >= int64_t{64} << 10);
    CHECK(f.tiles.parallel_min_elems <= int64_t{1} << 20);
}

TEST_CASE("mha-tune --list prints each search's candidates once each and the shapes that score them, measuring none") {
    const auto r = run_tool("MHA_TUNE", "--list --threads 2", false, "MHA_PARALLEL_ALWAYS= MHA_ISA= MHA_TRANSPOSE=");
    INFO(r.output);
    REQUIRE(r.code == 0);
    CHECK(r.output.find("speedup") == std::string::npos);  // nothing timed
    CHECK(r.output.find(" of measuring\n") != std::string::npos);
    // "<phase>: <n> candidate(s), each timed on <shape>, <shape>..." and then n lines of two spaces and one candidate.
    std::map<std::string, std::vector<std::string>> listed;
    std::map<std::string, size_t> announced;
    std::istringstream in(r.output);
    std::string line, phase;
    while (std::getline(in, line)) {
        if (line.rfind("  ", 0) == 0) {
            REQUIRE_FALSE(phase.empty());
            listed[phase].push_back(line.substr(2));
        } else if (const auto colon = line.find(": "); colon != std::string::npos && line.find(", each timed on ") != std::string::npos) {
            phase = line.substr(0, colon);
            announced[phase] = std::stoul(line.substr(colon + 2));
        }
    }
    CHECK(announced.size() == 6);
    for (const char *p : {"gemm", "attention", "rows", "transpose", "threads", "elems"}) {
        CAPTURE(p);
        REQUIRE(listed.count(p));
        const auto &c = listed.at(p);
        CHECK(c.size() == announced[p]);
        // No candidate twice (sizes taken as shares of a large cache can clamp to one value).
        CHECK(std::set<std::string>(c.begin(), c.end()).size() == c.size());
    }
    const TileConfig def = default_tile_config(best_isa(), detect_cache_sizes());
    const auto &gemm = listed.at("gemm");
    CHECK(std::any_of(gemm.begin(), gemm.end(), [&](const std::string &c) { return c.rfind(def.gemm_ukernel + " ", 0) == 0; }));
    CHECK(r.output.find("gemm: " + std::to_string(gemm.size()) + " candidates, each timed on gemm 2048x1536x512 NT") != std::string::npos);
    CHECK(r.output.find("threads: ") != std::string::npos);
    // The transpose: the one the defaults do not take, timed on the calls that transpose (NT
    // products, the attention's K^T, few rows against B^T) and on no other.
    REQUIRE(listed.at("transpose").size() == 1);
    CHECK(listed.at("transpose")[0] == std::string("transpose=") + (def.transpose == "inserts" ? "shuffles" : "inserts"));
    const auto at = r.output.find("transpose: 1 candidate, each timed on gemm 2048x1536x512 NT");
    REQUIRE(at != std::string::npos);
    const std::string transpose_line = r.output.substr(at, r.output.find('\n', at) - at);
    CHECK(transpose_line.find("gemm 8x1536x512 NT") != std::string::npos);
    CHECK(transpose_line.find("attention L1024 H8 D64") != std::string::npos);
    CHECK(transpose_line.find("NN") == std::string::npos);  // nothing transposes there

    // MHA_TRANSPOSE overrides every runtime's transpose: no step for it, and its own shapes go.
    const auto forced = run_tool("MHA_TUNE", "--list --threads 2", true, "MHA_PARALLEL_ALWAYS= MHA_ISA= MHA_TRANSPOSE=shuffles");
    INFO(forced.output);
    REQUIRE(forced.code == 0);
    CHECK(forced.output.find("MHA_TRANSPOSE=shuffles overrides") != std::string::npos);
    CHECK(forced.output.find("\ntranspose: ") == std::string::npos);
    CHECK(forced.output.find("gemm 8x1536x512 NT") == std::string::npos);
    CHECK(forced.output.find("\nrows: ") != std::string::npos);
}

TEST_CASE("a broken MHA_TILE_CONFIG stops mha-run, mha-tune and mha-bench with the file and the problem") {
    TempDir tmp;
    std::ofstream(tmp / "bad.json") << R"({"format": "mha-tile-config", "version": 1, "isa": "avx2", "tiles": {"kc": -4}})";
    std::ofstream(tmp / "junk.json") << "{ not json";
    for (const char *file : {"bad.json", "junk.json", "missing.json"}) {
        CAPTURE(file);
        const std::string env = "MHA_TILE_CONFIG=" + shell_quote(tmp / file);
        const auto r = run_tool("MHA_RUN", run_args() + " --out " + tmp / "o.npy", true, env);
        CHECK(r.code == 2);
        CHECK(r.output.find(tmp / file) != std::string::npos);
        CHECK_FALSE(fs::exists(tmp / "o.npy"));
        const auto t = run_tool("MHA_TUNE", "--quick --max-candidates 1", true, env);
        CHECK(t.code != 0);
        CHECK(t.output.find(tmp / file) != std::string::npos);
        const auto b = run_tool("MHA_BENCH", "--quick --threads 1 --filter 'threads/softmax/32x128'", true, env);
        CHECK(b.code == 2);
        CHECK(b.output.find(tmp / file) != std::string::npos);
        CHECK(b.output.find("measuring the FMA peak") == std::string::npos);  // at start, before any work
    }
}

namespace {

// One `mha-bench --quick --json --threads 1` run (half of this test's time), parsed: the cases
// below read their suites' rows from it.
const nlohmann::json &quick_run() {
    static const nlohmann::json j = [] {
        const auto r = run_tool("MHA_BENCH", "--quick --json --threads 1", false);
        REQUIRE(r.code == 0);
        return nlohmann::json::parse(r.output);
    }();
    return j;
}

// The rows of one suite of the quick run (there must be some).
std::vector<nlohmann::json> quick_rows(const std::string &suite) {
    std::vector<nlohmann::json> rows;
    for (const auto &row : quick_run()["results"])
        if (row["suite"] == suite) rows.push_back(row);
    REQUIRE(!rows.empty());
    return rows;
}

} // namespace

TEST_CASE("mha-bench --quick --json prints one object with every suite") {
    const auto &j = quick_run();
    CHECK(j["peak_gflops"].get<double>() > 0);
    CHECK(j["bandwidth_gbs"].get<double>() > 0);
    std::set<std::string> suites;
    for (const auto &row : j["results"]) {
        suites.insert(row["suite"].get<std::string>());
        CHECK(row.contains("name"));
        CHECK(row.contains("shape"));
        CHECK(row["threads"] == 1);
        CHECK(row["ms"].get<double>() > 0);
        CHECK((row.contains("gflops") || row.contains("gbs") || row.contains("gelem_per_s")));
        CHECK(row.contains("peak_fraction"));
        // GFLOP/s and GB/s rows are shares of a probe timed beside them.
        if (row.contains("gflops")) {
            REQUIRE(row["peak_gflops_in_row"].get<double>() > 0);
            CHECK(row["peak_fraction"].get<double>() ==
                  doctest::Approx(row["gflops"].get<double>() / row["peak_gflops_in_row"].get<double>()));
        }
        if (row.contains("gbs")) {
            REQUIRE(row["bandwidth_gbs_in_row"].get<double>() > 0);
            CHECK(row["peak_fraction"].get<double>() ==
                  doctest::Approx(row["gbs"].get<double>() / row["bandwidth_gbs_in_row"].get<double>()));
        }
        // Causal attention rows time the same call without the mask beside them; one-thread rows
        // have nothing to compare with one thread.
        const bool causal = row["shape"].get<std::string>().find("causal") != std::string::npos;
        if (row["suite"] == "attention") CHECK(row["vs"].contains("non-causal") == causal);
        if (row.contains("vs")) CHECK(!row["vs"].contains("1 thread"));
        // Layer rows split their time: the attention step as the layer runs it (right after a QKV
        // projection wrote its input), the projections as the rest, and the attention alone.
        if (row["suite"] == "layer") {
            REQUIRE(row.contains("attention_ms"));
            REQUIRE(row.contains("attention_alone_ms"));
            REQUIRE(row.contains("projection_ms"));
            CHECK(row["attention_ms"].get<double>() > 0);
            CHECK(row["attention_alone_ms"].get<double>() > 0);
            CHECK(row["projection_ms"].get<double>() ==
                  doctest::Approx(row["ms"].get<double>() - row["attention_ms"].get<double>()));
        }
    }
    CHECK(suites == std::set<std::string>{"gemm", "softmax", "attention", "decode", "layer", "serving", "encoder"});
}

TEST_CASE("mha-bench --quick --json, serving: ragged prefill, cached decode and a continuous batch") {
    std::map<std::string, nlohmann::json> by_name;
    for (const auto &row : quick_rows("serving")) {
        CAPTURE(row.dump());
        CHECK(row["threads"] == 1);
        CHECK(row["ms"].get<double>() > 0);
        REQUIRE(row["peak_fraction"].is_number());
        CHECK(row["peak_fraction"].get<double>() > 0);
        CHECK(row["tokens_per_s"].get<double>() > 0);
        for (const auto &[anchor, ratio] : row["vs"].items()) CHECK(ratio.get<double>() > 0);
        CHECK(!row["vs"].contains("1 thread"));
        REQUIRE(row.contains("same_bits"));
        by_name[row["name"].get<std::string>()] = row;
    }
    REQUIRE(by_name.size() == 3);

    // (a) The prompt mix in one varlen call, against the padded batch and one call per prompt;
    // GFLOP/s of the causal work. --quick runs the H8 D64 shape only.
    const auto &pre = by_name.at("serving/prefill");
    CHECK(pre["shape"] == "mix8 T4977 H8 D64 causal");
    CHECK(pre["seq_lens"] == nlohmann::json({244, 789, 126, 2048, 869, 304, 533, 64}));
    CHECK(pre["tokens"] == 4977);
    CHECK(pre["gflops"].get<double>() > 0);
    CHECK(pre["peak_gflops_in_row"].get<double>() > 0);
    CHECK(pre["flops_counted"] == "causal");
    CHECK(pre["vs"]["padded"].get<double>() > 0);
    CHECK(pre["vs"]["per-seq"].get<double>() > 0);
    // A prompt has the same bits in a ragged batch as alone (issue 13, section 5).
    CHECK(pre["same_bits"]["per-seq"] == true);

    // (b) One decode step of 16 x 4096 cached tokens: GB/s of K and V against the read probe.
    const auto &dec = by_name.at("serving/decode");
    CHECK(dec["shape"] == "B16 Lk4096 H32/8 D128");
    CHECK(dec["gbs"].get<double>() > 0);
    CHECK(dec["bandwidth_gbs_in_row"].get<double>() > 0);
    CHECK(dec["cached_tokens"] == 16 * 4096);
    CHECK(dec["cache_bytes"].get<double>() >= 16.0 * 4096 * 8 * 128 * 4 * 2);
    CHECK(dec["vs"]["dense"].get<double>() > 0);
    CHECK(dec["same_bits"]["dense"] == true);

    // (c) 2 prefill chunks of 512 and 30 decodes in one call, against two calls and the dense path.
    const auto &cont = by_name.at("serving/continuous");
    CHECK(cont["shape"] == "2x512@1024+30x1@2048 H32/8 D128");
    CHECK(cont["gflops"].get<double>() > 0);
    CHECK(cont["new_tokens"] == 2 * 512 + 30);
    CHECK(cont["cached_tokens"] == 2 * 1536 + 30 * 2048);
    CHECK(cont["kv_gbs"].get<double>() > 0);
    CHECK(cont["vs"]["split"].get<double>() > 0);
    CHECK(cont["vs"]["dense"].get<double>() > 0);
    CHECK(cont["same_bits"]["split"] == true);
    CHECK(cont["same_bits"]["dense"] == true);
}

TEST_CASE("mha-bench --quick --json, encoder: the encoder layer beside PyTorch and oneDNN, and the Add & Norm's share") {
    std::map<std::string, nlohmann::json> by_name;
    for (const auto &row : quick_rows("encoder")) {
        CAPTURE(row.dump());
        CHECK(row["threads"] == 1);
        CHECK(row["ms"].get<double>() > 0);
        CHECK(row["gflops"].get<double>() > 0);
        REQUIRE(row["peak_fraction"].is_number());
        CHECK(row["peak_fraction"].get<double>() > 0);
        CHECK(row["peak_gflops_in_row"].get<double>() > 0);
        REQUIRE(row.contains("vs"));
        for (const auto &[anchor, ratio] : row["vs"].items()) CHECK(ratio.get<double>() > 0);
        CHECK(!row["vs"].contains("1 thread"));
        by_name[row["name"].get<std::string>()] = row;
    }
    REQUIRE(by_name.size() == 2);

    // --quick runs B8 L128 only. GFLOP/s counts the GEMMs and the attention: 8 L E^2 + 4 L E F + 4 L^2 E.
    const auto &fwd = by_name.at("encoder/forward");
    CHECK(fwd["shape"] == "B8 L128 E512 H8 F2048");
    const double flops = 8.0 * (8.0 * 128 * 512 * 512 + 4.0 * 128 * 512 * 2048 + 4.0 * 128 * 128 * 512);
    CHECK(fwd["gflops"].get<double>() == doctest::Approx(flops / (fwd["ms"].get<double>() * 1e-3) * 1e-9));
    if (fwd["vs"].contains("oneDNN")) CHECK(fwd["max_abs_diff_vs_oneDNN"].get<double>() < 1e-3);  // the same layer
    if (fwd["vs"].contains("PyTorch")) {
        CHECK(fwd["torch_ms"].get<double>() > 0);
        CHECK(fwd["torch_fast_path"] == true);
        // Its threads were checked: the child's CPU time over its wall time, and the verdict.
        CHECK(fwd["anchor_cpu_per_wall"]["PyTorch"].get<double>() > 0);
        CHECK(fwd["anchor_valid"]["PyTorch"].is_boolean());  // nn.TransformerEncoderLayer's fused path, the anchor the issue names
    } else {
        MESSAGE("no PyTorch anchor (python3-torch not installed?)");
    }

    // The attention layer with its Add & Norm against the same layer without.
    const auto &an = by_name.at("encoder/add&norm");
    CHECK(an["shape"] == "B8 L128 E512 H8");
    CHECK(an["vs"]["no norm"].get<double>() > 0);
    CHECK(an["no_norm_ms"].get<double>() > 0);
    CHECK(an["add_norm_share"].get<double>() ==
          doctest::Approx(1.0 - an["no_norm_ms"].get<double>() / an["ms"].get<double>()));
    CHECK(std::abs(an["add_norm_share"].get<double>()) < 0.5);
}

TEST_CASE("mha-bench on two threads compares each row with one thread") {
    const auto r = run_tool("MHA_BENCH", "--quick --json --threads 2 --filter 'decode/fused/B1 Lk4096'", false);
    REQUIRE(r.code == 0);
    const auto j = nlohmann::json::parse(r.output);
    REQUIRE(j["results"].size() == 1);
    const auto &row = j["results"][0];
    CHECK(row["threads"] == 2);
    CHECK(row["vs"]["1 thread"].get<double>() > 0);
}

TEST_CASE("mha-bench records the few-rows GEMM's transpose, which MHA_TRANSPOSE picks or a bad value stops") {
    const char *args = "--quick --json --threads 1 --filter 'threads/softmax/32x128'";
    for (const char *name : {"shuffles", "inserts"}) {
        const auto r = run_tool("MHA_BENCH", args, false, std::string("MHA_PARALLEL_ALWAYS= MHA_TILE_CONFIG= MHA_TRANSPOSE=") + name);
        REQUIRE(r.code == 0);
        const auto j = nlohmann::json::parse(r.output);
        CHECK(j["gemm_transpose"] == name);
        CHECK(j["tiles"]["transpose"] == name);
        CHECK(j["tiles"]["source"] == "defaults + MHA_TRANSPOSE");
    }
    const auto bad = run_tool("MHA_BENCH", args, true, "MHA_TRANSPOSE=rotate");
    CHECK(bad.code != 0);
    CHECK(bad.output.find("MHA_TRANSPOSE") != std::string::npos);
}

TEST_CASE("mha-bench --filter threads: a small call on 2 threads beside 1 thread and every thread") {
    const auto r = run_tool("MHA_BENCH", "--quick --json --threads 1,2 --filter threads/softmax/32x128", false);
    REQUIRE(r.code == 0);
    const auto j = nlohmann::json::parse(r.output);
    REQUIRE(j["results"].size() == 1);
    const auto &row = j["results"][0];
    CHECK(row["suite"] == "threads");
    CHECK(row["threads"] == 2);
    CHECK(row["vs"]["1 thread"].get<double>() > 0);
    CHECK(row["vs"]["all threads"].get<double>() > 0);
    CHECK(row["cpu_per_wall"].get<double>() > 0);
    CHECK(row["anchor_valid"]["1 thread"] == true);  // mha's own anchors are not judged
}

namespace {

// The first processor's "key : value" lines of /proc/cpuinfo (the kernel's own reading of cpuid).
std::map<std::string, std::string> cpuinfo() {
    std::map<std::string, std::string> out;
    std::ifstream f("/proc/cpuinfo");
    for (std::string line; std::getline(f, line) && !line.empty();) {
        const auto colon = line.find(':');
        if (colon == std::string::npos) continue;
        std::string key = line.substr(0, colon);
        key.erase(key.find_last_not_of(" \t") + 1);
        const auto v = line.find_first_not_of(' ', colon + 1);
        out[key] = v == std::string::npos ? "" : line.substr(v);
    }
    return out;
}

} // namespace

TEST_CASE("mha-bench names the machine and the tiles it ran with: the defaults, or MHA_TILE_CONFIG's") {
    const char *args = "--quick --threads 1 --filter 'threads/softmax/32x128'";
    // The ISA the tool's runtimes take (MHA_ISA, else the best), and its tiles with neither a
    // config file nor MHA_PARALLEL_ALWAYS (which zeroes the thresholds) in the way.
    const char *isa_env = std::getenv("MHA_ISA");
    const Isa isa = isa_env && *isa_env ? parse_isa(isa_env).value() : best_isa();
    const std::string clean = "MHA_PARALLEL_ALWAYS= MHA_TILE_CONFIG= MHA_TRANSPOSE=";
    const CacheSizes caches = detect_cache_sizes();
    const TileConfig defaults = default_tile_config(isa, caches);
    auto tiles_json = [&](const TileConfig &t) {
        return nlohmann::json::parse(tile_config_json(TileConfigFile{isa, "", "", t}))["tiles"];
    };

    const auto r = run_tool("MHA_BENCH", std::string(args) + " --json", false, clean);
    REQUIRE(r.code == 0);
    const auto j = nlohmann::json::parse(r.output);
    const auto &m = j["machine"];
    const auto info = cpuinfo();
    if (info.count("model name")) CHECK(m["cpu"] == info.at("model name"));
    if (info.count("vendor_id")) CHECK(m["vendor"] == info.at("vendor_id"));
    if (info.count("cpu family")) CHECK(m["family"].get<int>() == std::stoi(info.at("cpu family")));
    if (info.count("model")) CHECK(m["model"].get<int>() == std::stoi(info.at("model")));
    CHECK(m["l1d_bytes"].get<int64_t>() == caches.l1d);
    CHECK(m["l2_bytes"].get<int64_t>() == caches.l2);
    CHECK(m["l3_bytes"].get<int64_t>() == caches.l3);
    CHECK(m["hardware_threads"].get<unsigned>() == std::thread::hardware_concurrency());
    CHECK(m["isa"] == std::string(isa_name(isa)));
    CHECK(m["isa_best"] == std::string(isa_name(best_isa())));
    auto tiles = j["tiles"];
    CHECK(tiles["source"] == "defaults");
    tiles.erase("source");
    CHECK(tiles == tiles_json(defaults));

    // A tuned config: every runtime of the run takes it, and the report says so.
    TempDir tmp;
    TileConfig tuned = defaults;
    tuned.kc = std::max<int64_t>(64, defaults.kc / 2 / 8 * 8);
    tuned.sup_max_k = tuned.kc;
    tuned.parallel_min_flops = int64_t{3} << 20;
    std::ofstream(tmp / "tuned.json") << tile_config_json(TileConfigFile{isa, "test", "", tuned});
    const std::string env = "MHA_PARALLEL_ALWAYS= MHA_TRANSPOSE= MHA_TILE_CONFIG=" + shell_quote(tmp / "tuned.json");
    const auto t = run_tool("MHA_BENCH", std::string(args) + " --json", false, env);
    REQUIRE(t.code == 0);
    auto tj = nlohmann::json::parse(t.output)["tiles"];
    CHECK(tj["source"] == tmp / "tuned.json");
    tj.erase("source");
    CHECK(tj == tiles_json(tuned));
    CHECK(tj != tiles_json(defaults));

    // The table's header: the machine and the tiles, each on a line of its own.
    const auto table = run_tool("MHA_BENCH", args, false, env);
    REQUIRE(table.code == 0);
    INFO(table.output);
    CHECK(table.output.find("\nmachine: " + m["cpu"].get<std::string>() + " (") != std::string::npos);
    CHECK(table.output.find("\ntiles (" + tmp / "tuned.json" + "): " + tuned.gemm_ukernel + " MC " +
                            std::to_string(tuned.mc) + " KC " + std::to_string(tuned.kc) + " ") != std::string::npos);

    // MHA_PARALLEL_ALWAYS=1 zeroes the thresholds of every runtime, and the report says so.
    const auto always = run_tool("MHA_BENCH", std::string(args) + " --json", false, "MHA_PARALLEL_ALWAYS=1 MHA_TILE_CONFIG= MHA_TRANSPOSE=");
    REQUIRE(always.code == 0);
    const auto aj = nlohmann::json::parse(always.output)["tiles"];
    CHECK(aj["source"] == "defaults + MHA_PARALLEL_ALWAYS");
    CHECK(aj["parallel_min_flops"] == 0);
    CHECK(aj["parallel_min_elems"] == 0);
    CHECK(aj["kc"] == defaults.kc);
}
