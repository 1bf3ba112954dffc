// mha-run end to end: the PyTorch golden cases (tests/data/gen_layer_golden.py) through the real
// binary (MHA_RUN names it), and bad files: exit code 2, a message naming the file, no output.
// --generate: prefill and decode through the KV cache, bit for bit against the full causal forward.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

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

namespace {

// A self-attention layer with E = 64, H = 4 and deterministic weights of about 1/sqrt(E), written as
// a state_dict directory, and a query [B, L, E]: big enough that the cache holds several blocks.
fs::path write_synthetic_layer(const TempDir &tmp, int64_t B, int64_t L) {
    const int64_t E = 64;
    auto values = [](size_t n, uint32_t seed, float scale) {
        std::vector<float> v(n);
        uint32_t x = seed;
        for (auto &e : v) {
            x = x * 1664525u + 1013904223u;
            e = (static_cast<float>(x >> 8) * 0x1p-24f * 2.0f - 1.0f) * scale;
        }
        return v;
    };
    const fs::path dir = fs::path(tmp / "synthetic");
    fs::create_directories(dir / "weights");
    const float w = 1.0f / 8.0f;
    write_npy((dir / "weights/in_proj_weight.npy").string(), {3 * E, E}, values(static_cast<size_t>(3 * E * E), 1, w).data());
    write_npy((dir / "weights/in_proj_bias.npy").string(), {3 * E}, values(static_cast<size_t>(3 * E), 2, 0.1f).data());
    write_npy((dir / "weights/out_proj.weight.npy").string(), {E, E}, values(static_cast<size_t>(E * E), 3, w).data());
    write_npy((dir / "weights/out_proj.bias.npy").string(), {E}, values(static_cast<size_t>(E), 4, 0.1f).data());
    write_npy((dir / "query.npy").string(), {B, L, E}, values(static_cast<size_t>(B * L * E), 5, 1.0f).data());
    return dir;
}

nlohmann::json last_json_line(const std::string &output) {
    std::string last = output.substr(0, output.find_last_not_of('\n') + 1);
    last = last.substr(last.find_last_of('\n') + 1);
    return nlohmann::json::parse(last);
}

} // namespace

TEST_CASE("mha-run --generate: the prompt's rows match PyTorch's causal layer, and every row matches the full causal forward bit for bit") {
    TempDir tmp;
    const fs::path d = kData / "causal";  // query [2, 6, 16], 4 heads
    for (const char *extra : {"--threads 1", "--threads 2 --prefill-chunk 4", "--prefill-chunk 1 --causal"}) {
        CAPTURE(extra);
        const auto r = run("--weights " + q(d / "weights") + " --num-heads 4 --query " + q(d / "query.npy") +
                           " --generate 5 --check-invariance --out " + tmp / "o.npy" + " " + extra);
        INFO(r.output);
        REQUIRE(r.code == 0);
        CHECK(r.output.find("tokens/s") != std::string::npos);
        CHECK(r.output.find("all 22 rows") != std::string::npos);
        CHECK(r.output.find("bitwise identical to the full causal forward") != std::string::npos);
        // The first 6 rows of each sequence are the prompt's: PyTorch's causal output.
        const Array got = read_npy(tmp / "o.npy"), want = read_npy((d / "out.npy").string());
        REQUIRE(got.shape == std::vector<int64_t>{2, 11, 16});
        const auto g = to_floats("got", got, got.shape), w = to_floats("want", want, {2, 6, 16});
        double worst = 0;
        for (int64_t b = 0; b < 2; ++b)
            for (int64_t x = 0; x < 6 * 16; ++x)
                worst = std::max(worst, std::abs(static_cast<double>(g[static_cast<size_t>(b * 11 * 16 + x)]) -
                                                 w[static_cast<size_t>(b * 6 * 16 + x)]));
        CHECK(worst <= 1e-4);
        for (float x : g) CHECK(std::isfinite(x));
        fs::remove(tmp / "o.npy");
    }
}

TEST_CASE("mha-run --generate --json: several cache blocks, chunked prefill, the same bits on 1 and 2 threads") {
    TempDir tmp;
    const fs::path d = write_synthetic_layer(tmp, 2, 70);
    const std::string base = "--weights " + q(d / "weights") + " --num-heads 4 --query " + q(d / "query.npy") +
                             " --generate 40 --check-invariance --json";
    std::vector<std::vector<uint8_t>> outs;
    for (const char *extra : {"--threads 1", "--threads 2 --prefill-chunk 32", "--threads 1 --prefill-chunk 7"}) {
        CAPTURE(extra);
        const std::string out = tmp / (std::to_string(outs.size()) + ".npy");
        const auto r = run(base + " --out " + out + " " + extra);
        INFO(r.output);
        REQUIRE(r.code == 0);
        const auto j = last_json_line(r.output);
        CHECK(j["mode"] == "generate");
        CHECK(j["batch"] == 2);
        CHECK(j["prompt_len"] == 70);
        CHECK(j["generated"] == 40);
        CHECK(j["step_ms"].size() == 40);
        CHECK(j["tokens_per_s"].get<double>() > 0);
        CHECK(j["prefill_tokens_per_s"].get<double>() > 0);
        CHECK(j["cache_bytes"].get<double>() >= 2.0 * 110 * 2 * 64 * 4);  // K and V of 2 x 110 tokens
        CHECK(j["invariance"]["identical"] == true);
        CHECK(j["invariance"]["rows"] == 220);
        CHECK(j["invariance"]["differing_rows"] == 0);
        outs.push_back(read_file(out));
    }
    CHECK(last_json_line(run(base + " --prefill-chunk 32").output)["prefill_calls"] == 3);
    // However the prompt was prefilled and on however many threads: the same bits.
    CHECK(outs[0] == outs[1]);
    CHECK(outs[0] == outs[2]);
}

TEST_CASE("mha-run --generate refuses a cross-attention layer, naming the weights") {
    TempDir tmp;
    const fs::path d = kData / "cross_kdim_vdim";
    const auto r = run("--weights " + q(d / "weights") + " --num-heads 2 --query " + q(d / "query.npy") +
                       " --generate 3 --out " + tmp / "o.npy");
    INFO(r.output);
    CHECK(r.code == 2);
    CHECK(r.output.find("--generate needs a self-attention layer") != std::string::npos);
    CHECK(r.output.find("cross_kdim_vdim/weights") != std::string::npos);
    CHECK_FALSE(fs::exists(tmp / "o.npy"));
    const auto usage = run("--weights " + q(d / "weights") + " --num-heads 2 --query " + q(d / "query.npy") +
                           " --check-invariance");
    CHECK(usage.code == 2);
    CHECK(usage.output.find("--check-invariance needs --generate") != std::string::npos);
}
