// mha-run end to end: the PyTorch golden cases (tests/data/gen_layer_golden.py) through the real
// binary (MHA_RUN names it), and bad files: exit code 2, a message naming the file, no output.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include <nlohmann/json.hpp>

#include "io/npy.hpp"
#include "run_tool.hpp"

namespace fs = std::filesystem;
using namespace mha::io;

namespace {

const fs::path kData = fs::path(MHA_TEST_DATA) / "layer";

using mha::test::shell_quote;
using mha::test::TempDir;

mha::test::ToolResult run(const std::string &args) { return mha::test::run_tool("MHA_RUN", args); }

void expect_close(const std::string &got_path, const fs::path &want_path) {
    const Array got = read_npy(got_path), want = read_npy(want_path.string());
    REQUIRE(got.shape == want.shape);
    const auto g = to_floats("got", got, got.shape), w = to_floats("want", want, want.shape);
    double worst = 0;
    for (size_t i = 0; i < g.size(); ++i) worst = std::max(worst, std::abs(static_cast<double>(g[i]) - w[i]));
    INFO(got_path << " vs " << want_path.string() << ": worst " << worst);
    CHECK(worst <= 1e-4);
}

std::string q(const fs::path &p) { return shell_quote(p); }

} // namespace

TEST_CASE("mha-run matches PyTorch on every golden case, per-head and averaged weights") {
    TempDir tmp;
    struct Case {
        const char *name;
        int heads;
        std::string extra;
    };
    const Case cases[] = {
        {"self", 4, ""},
        {"cross_kdim_vdim", 2, "--key " + q(kData / "cross_kdim_vdim/key.npy") + " --value " + q(kData / "cross_kdim_vdim/value.npy")},
        {"no_bias", 4, ""},
        {"key_padding", 4, "--key-padding-mask " + q(kData / "key_padding/key_padding_mask.npy")},
        {"causal", 4, "--attn-mask " + q(kData / "causal/attn_mask.npy")},
        {"causal", 4, "--causal"},
        {"causal", 4, "--causal --attn-mask " + q(kData / "causal/attn_mask.npy")},
    };
    for (const auto &c : cases) {
        for (bool safetensors : {false, true})
            for (bool average : {false, true}) {
                CAPTURE(c.name);
                CAPTURE(c.extra);
                CAPTURE(safetensors);
                const fs::path d = kData / c.name;
                const std::string weights = safetensors ? q(d / "weights.safetensors") + " --prefix attn." : q(d / "weights");
                const auto r = run("--weights " + weights + " --num-heads " + std::to_string(c.heads) + " --query " +
                                     q(d / "query.npy") + " " + c.extra + " --out " + tmp / "o.npy" + " --attn-weights " +
                                     tmp / "w.npy" + (average ? " --average-attn-weights" : "") + " --threads 2");
                INFO(r.output);
                REQUIRE(r.code == 0);
                expect_close(tmp / "o.npy", d / "out.npy");
                expect_close(tmp / "w.npy", d / (average ? "weights_avg.npy" : "weights.npy"));
            }
    }
}

TEST_CASE("mha-run --repeat --json ends stdout with one JSON object") {
    const fs::path d = kData / "self";
    const auto r = run("--weights " + q(d / "weights") + " --num-heads 4 --query " + q(d / "query.npy") +
                         " --repeat 5 --json --threads 1");
    REQUIRE(r.code == 0);
    std::string last = r.output.substr(0, r.output.find_last_not_of('\n') + 1);
    last = last.substr(last.find_last_of('\n') + 1);
    const auto j = nlohmann::json::parse(last);
    CHECK(j["runs_ms"].size() == 5);
    CHECK(j["best_ms"].get<double>() > 0);
    CHECK(j["median_ms"].get<double>() >= j["best_ms"].get<double>());
    CHECK(j["gflops"].get<double>() > 0);
    CHECK(j["threads"] == 1);
}

TEST_CASE("mha-run: bad files exit 2, name the file and what was wrong, and write nothing") {
    TempDir tmp;
    const fs::path d = kData / "self";
    const std::string base = "--out " + tmp / "o.npy" + " --attn-weights " + tmp / "w.npy";
    {
        std::ofstream(tmp / "junk.npy") << "this is not numpy";
        std::ofstream(tmp / "case.safetensors") << "short";
    }
    // A safetensors file whose header lies about its offsets.
    {
        const auto good = read_file((d / "weights.safetensors").string());
        auto bad = good;
        const std::string header(good.begin() + 8, good.begin() + 8 + (good[0] | good[1] << 8));
        const size_t at = header.find("\"data_offsets\":[0,") != std::string::npos ? header.find("\"data_offsets\":[0,")
                                                                                   : header.find("\"data_offsets\": [0,");
        REQUIRE(at != std::string::npos);
        bad[8 + at + header.substr(at).find('0')] = '9';  // [0, n] becomes [9, n]: sizes no longer match
        std::ofstream(tmp / "lying.safetensors", std::ios::binary).write(reinterpret_cast<const char *>(bad.data()),
                                                                        static_cast<std::streamsize>(bad.size()));
    }
    struct Bad {
        const char *what;
        std::string args, names, says;
    };
    const std::string w = "--num-heads 4 --weights " + q(d / "weights");
    const Bad bad[] = {
        {"missing query", w + " --query " + tmp / "nope.npy", tmp / "nope.npy", "cannot open"},
        {"not npy", w + " --query " + tmp / "junk.npy", tmp / "junk.npy", "expected a .npy file"},
        {"wrong dtype", w + " --query " + q(kData / "key_padding/key_padding_mask.npy") + "", "key_padding_mask.npy",
         "expected shape"},
        {"wrong width", w + " --query " + q(kData / "cross_kdim_vdim/key.npy"), "key.npy", "found [2, 6, 12]"},
        {"mask dtype", w + " --query " + q(d / "query.npy") + " --attn-mask " + q(d / "query.npy"), "query.npy",
         "expected dtype bool"},
        {"mask shape", w + " --query " + q(d / "query.npy") + " --key-padding-mask " + q(kData / "causal/attn_mask.npy"),
         "attn_mask.npy", "expected shape [2, 5], found [6, 6]"},
        {"missing weights dir", "--num-heads 4 --weights " + tmp / "nodir" + " --query " + q(d / "query.npy"), "nodir", "missing"},
        {"missing weight file", "--num-heads 4 --weights " + q(kData / "self") + " --query " + q(d / "query.npy"), "out_proj.weight",
         "cannot open"},
        {"truncated safetensors", "--num-heads 4 --weights " + tmp / "case.safetensors" + " --query " + q(d / "query.npy"),
         "case.safetensors", "8-byte header length"},
        {"lying safetensors", "--num-heads 4 --weights " + tmp / "lying.safetensors" + " --prefix attn. --query " + q(d / "query.npy"),
         "lying.safetensors", "data_offsets"},
        {"wrong prefix", "--num-heads 4 --weights " + q(d / "weights.safetensors") + " --prefix enc. --query " + q(d / "query.npy"),
         "enc.out_proj.weight", "no tensor"},
        {"heads do not divide", "--num-heads 3 --weights " + q(d / "weights") + " --query " + q(d / "query.npy"),
         "--num-heads 3", "does not divide"},
    };
    for (const auto &b : bad) {
        CAPTURE(std::string(b.what));
        const auto r = run(base + " " + b.args);
        INFO(r.output);
        CHECK(r.code == 2);
        CHECK(r.output.find(b.names) != std::string::npos);
        CHECK(r.output.find(b.says) != std::string::npos);
        CHECK_FALSE(fs::exists(tmp / "o.npy"));
        CHECK_FALSE(fs::exists(tmp / "w.npy"));
    }
    const auto usage = run("--query");
    CHECK(usage.code == 2);
    CHECK(usage.output.find("usage: mha-run") != std::string::npos);
}
