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
#include <functional>
#include <map>
#include <regex>
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

TEST_CASE("mha-run --window --softcap --alibi --sinks --rope-dims: cached generation = the full forward bit for bit; --kv-dtype i8 runs") {
    TempDir tmp;
    const fs::path d = kData / "causal";  // query [2, 6, 16], 4 heads
    const float sinks[4] = {0.5f, -1.0f, 2.0f, 0.0f};
    mha::io::write_npy(tmp / "s.npy", {4}, sinks);
    const std::string base = "--weights " + q(d / "weights") + " --num-heads 4 --query " + q(d / "query.npy");
    const auto r = run(base + " --generate 6 --check-invariance --window 4 --softcap 3 --alibi --sinks " + tmp / "s.npy" +
                       " --rope-dims 4 --rope-theta 1000");
    INFO(r.output);
    REQUIRE(r.code == 0);
    CHECK(r.output.find("bitwise identical to the full causal forward") != std::string::npos);
    const auto i8 = run(base + " --generate 6 --kv-dtype i8 --rope-dims 4 --rope-interleaved --json");
    INFO(i8.output);
    REQUIRE(i8.code == 0);
    CHECK(i8.output.find("\"kv_dtype\":\"i8\"") != std::string::npos);
    const auto plain = run(base + " --causal --out " + tmp / "a.npy"), windowed = run(base + " --causal --window 2 --out " + tmp / "b.npy");
    REQUIRE(plain.code == 0);
    REQUIRE(windowed.code == 0);
    const auto a = to_floats("a", read_npy(tmp / "a.npy"), {2, 6, 16}), b = to_floats("b", read_npy(tmp / "b.npy"), {2, 6, 16});
    CHECK(a != b);  // the window reaches the layer
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

// ---- --encoder-layers: nn.TransformerEncoderLayer / nn.TransformerEncoder state_dicts --------------

namespace {

const fs::path kEncoderData = fs::path(MHA_TEST_DATA) / "encoder";

// case.txt of tests/data/gen_encoder_golden.py: "key value" per line.
std::map<std::string, std::string> read_case(const fs::path &file) {
    std::map<std::string, std::string> m;
    std::ifstream f(file);
    for (std::string k, v; f >> k >> v;) m[k] = v;
    return m;
}

std::vector<float> lcg_values(size_t n, uint32_t seed, float scale, float offset = 0.0f) {
    std::vector<float> v(n);
    uint32_t x = seed * 2654435761u + 12345u;
    for (auto &e : v) {
        x = x * 1664525u + 1013904223u;
        e = (static_cast<float>(x >> 8) * 0x1p-24f * 2.0f - 1.0f) * scale + offset;
    }
    return v;
}

// A synthetic nn.TransformerEncoder state_dict (E 32, H 4, F 48): every layer's tensors by key
// (without the "layers.N." prefix), and the final norm when asked.
struct SyntheticEncoder {
    static constexpr int64_t E = 32, F = 48, H = 4;
    std::vector<std::map<std::string, std::pair<std::vector<int64_t>, std::vector<float>>>> layers;
    std::map<std::string, std::pair<std::vector<int64_t>, std::vector<float>>> top;  // norm.weight, norm.bias

    explicit SyntheticEncoder(int n, bool final_norm = false) {
        for (int i = 0; i < n; ++i) {
            const uint32_t s = 100u * static_cast<uint32_t>(i + 1);
            const float se = 1.0f / std::sqrt(static_cast<float>(E)), sf = 1.0f / std::sqrt(static_cast<float>(F));
            auto t = [&](std::vector<int64_t> shape, uint32_t seed, float scale, float offset = 0.0f) {
                size_t count = 1;
                for (int64_t d : shape) count *= static_cast<size_t>(d);
                return std::make_pair(shape, lcg_values(count, s + seed, scale, offset));
            };
            layers.push_back({{"self_attn.in_proj_weight", t({3 * E, E}, 1, se)},
                              {"self_attn.in_proj_bias", t({3 * E}, 2, 0.3f)},
                              {"self_attn.out_proj.weight", t({E, E}, 3, se)},
                              {"self_attn.out_proj.bias", t({E}, 4, 0.3f)},
                              {"linear1.weight", t({F, E}, 5, se)},
                              {"linear1.bias", t({F}, 6, 0.3f)},
                              {"linear2.weight", t({E, F}, 7, sf)},
                              {"linear2.bias", t({E}, 8, 0.3f)},
                              {"norm1.weight", t({E}, 9, 0.5f, 1.0f)},
                              {"norm1.bias", t({E}, 10, 0.5f)},
                              {"norm2.weight", t({E}, 11, 0.5f, 1.0f)},
                              {"norm2.bias", t({E}, 12, 0.5f)}});
        }
        if (final_norm) {
            top["norm.weight"] = {{E}, lcg_values(E, 7001, 0.5f, 1.0f)};
            top["norm.bias"] = {{E}, lcg_values(E, 7002, 0.5f)};
        }
    }
    // Every tensor as <prefix><key>.npy in dir: the stack's keys ("layers.N.") or, with `bare`, layer
    // `only`'s keys alone (an nn.TransformerEncoderLayer's state_dict).
    void write_npy_dir(const fs::path &dir, bool bare = false, int only = 0) const {
        fs::create_directories(dir);
        for (int i = 0; i < static_cast<int>(layers.size()); ++i) {
            if (bare && i != only) continue;
            const std::string p = bare ? "" : "layers." + std::to_string(i) + ".";
            for (const auto &[k, t] : layers[static_cast<size_t>(i)])
                write_npy((dir / (p + k + ".npy")).string(), t.first, t.second.data());
        }
        if (!bare)
            for (const auto &[k, t] : top) write_npy((dir / (k + ".npy")).string(), t.first, t.second.data());
    }
    // The stack's tensors in one .safetensors file, every key under `prefix`.
    void write_safetensors(const fs::path &file, const std::string &prefix) const {
        nlohmann::json header = nlohmann::json::object();
        std::string data;
        auto add = [&](const std::string &key, const std::pair<std::vector<int64_t>, std::vector<float>> &t) {
            const size_t begin = data.size();
            data.append(reinterpret_cast<const char *>(t.second.data()), t.second.size() * sizeof(float));
            header[prefix + key] = {{"dtype", "F32"}, {"shape", t.first}, {"data_offsets", {begin, data.size()}}};
        };
        for (size_t i = 0; i < layers.size(); ++i)
            for (const auto &[k, t] : layers[i]) add("layers." + std::to_string(i) + "." + k, t);
        for (const auto &[k, t] : top) add(k, t);
        std::string h = header.dump();
        h.append((8 - h.size() % 8) % 8, ' ');
        std::ofstream f(file, std::ios::binary);
        for (int b = 0; b < 8; ++b) f.put(static_cast<char>((static_cast<uint64_t>(h.size()) >> (8 * b)) & 0xff));
        f << h << data;
    }
};

std::vector<float> floats_of(const std::string &path) {
    const Array a = read_npy(path);
    return to_floats(path, a, a.shape);
}

} // namespace

TEST_CASE("mha-run --encoder-layers matches PyTorch's nn.TransformerEncoderLayer and nn.TransformerEncoder") {
    if (!fs::exists(kEncoderData)) {
        MESSAGE("no golden files in " << kEncoderData.string() << " (tests/data/gen_encoder_golden.py writes them)");
        return;
    }
    TempDir tmp;
    int cases = 0;
    for (const auto &entry : fs::directory_iterator(kEncoderData)) {
        const fs::path d = entry.path();
        const auto c = read_case(d / "case.txt");
        if (!c.count("num_layers")) continue;  // not an nn.TransformerEncoder[Layer] case (seed 002's layer)
        ++cases;
        std::string flags = "--encoder-layers " + c.at("num_layers") + " --num-heads " + c.at("num_heads") +
                            " --ffn-dim " + c.at("ffn_dim") + " --activation " + c.at("activation") + " --norm-eps " +
                            c.at("eps") + (c.at("norm_first") == "1" ? " --norm-first" : "") + " --query " +
                            q(d / "query.npy");
        if (fs::exists(d / "key_padding_mask.npy")) flags += " --key-padding-mask " + q(d / "key_padding_mask.npy");
        std::vector<std::string> masks = {""};
        if (fs::exists(d / "attn_mask.npy")) masks = {" --attn-mask " + q(d / "attn_mask.npy"), " --causal"};
        for (const std::string &mask : masks)
            for (bool safetensors : {false, true})
                for (const char *threads : {"1", "2"}) {
                    CAPTURE(d.filename().string());
                    CAPTURE(mask);
                    CAPTURE(safetensors);
                    CAPTURE(threads);
                    const std::string weights = safetensors ? q(d / "weights.safetensors") : q(d / "weights");
                    const auto r = run("--weights " + weights + " " + flags + mask + " --out " + tmp / "o.npy" +
                                       " --threads " + threads);
                    INFO(r.output);
                    REQUIRE(r.code == 0);
                    CHECK(r.output.find("mha-run: encoder of " + c.at("num_layers") + " layer") != std::string::npos);
                    expect_close(tmp / "o.npy", d / "out.npy");
                    fs::remove(tmp / "o.npy");
                }
        // Without --ffn-dim, the width comes from linear1.weight.
        const std::string no_ffn = std::regex_replace(flags, std::regex(" --ffn-dim [0-9]+"), "");
        const auto r = run("--weights " + q(d / "weights") + " " + no_ffn + masks[0] + " --out " + tmp / "o.npy");
        INFO(r.output);
        REQUIRE(r.code == 0);
        expect_close(tmp / "o.npy", d / "out.npy");
        fs::remove(tmp / "o.npy");
    }
    CHECK(cases >= 7);  // 6 nn.TransformerEncoderLayer cases and the 2-layer nn.TransformerEncoder
}

TEST_CASE("mha-run --encoder-layers 2 applies layer 0, then layer 1: the same bits as two one-layer runs") {
    TempDir tmp;
    const SyntheticEncoder enc(2);
    const fs::path stack = tmp.path / "stack", l0 = tmp.path / "layer0", l1 = tmp.path / "layer1";
    enc.write_npy_dir(stack);
    enc.write_npy_dir(l0, true, 0);
    enc.write_npy_dir(l1, true, 1);
    enc.write_safetensors(tmp.path / "model.safetensors", "encoder.");
    const int64_t B = 2, L = 7, E = SyntheticEncoder::E;
    write_npy(tmp / "x.npy", {B, L, E}, lcg_values(static_cast<size_t>(B * L * E), 9, 1.0f).data());
    std::vector<uint8_t> kpm(static_cast<size_t>(B * L), 0);
    kpm[static_cast<size_t>(L + L - 1)] = kpm[static_cast<size_t>(L + L - 2)] = 1;
    {  // a bool [B, L] .npy, by hand (write_npy writes float32)
        std::string header = "{'descr': '|b1', 'fortran_order': False, 'shape': (2, 7), }";
        header.append((64 - (10 + header.size() + 1) % 64) % 64, ' ');
        header += '\n';
        std::ofstream f(tmp / "kpm.npy", std::ios::binary);
        f.write("\x93NUMPY\x01\x00", 8);
        f.put(static_cast<char>(header.size() & 0xff));
        f.put(static_cast<char>(header.size() >> 8));
        f << header;
        f.write(reinterpret_cast<const char *>(kpm.data()), static_cast<std::streamsize>(kpm.size()));
    }
    for (const char *flags : {"", " --activation gelu --norm-first", " --key-padding-mask KPM --causal --norm-eps 1e-3"}) {
        CAPTURE(flags);
        std::string f = std::regex_replace(std::string(flags), std::regex("KPM"), tmp / "kpm.npy");
        const std::string common = " --num-heads " + std::to_string(SyntheticEncoder::H) + f;
        const auto a = run("--weights " + q(stack) + " --encoder-layers 2 --query " + tmp / "x.npy" + common + " --out " +
                           tmp / "stack.npy");
        INFO(a.output);
        REQUIRE(a.code == 0);
        const auto b = run("--weights " + q(l0) + " --encoder-layers 1 --query " + tmp / "x.npy" + common + " --out " +
                           tmp / "y0.npy");
        REQUIRE(b.code == 0);
        const auto c = run("--weights " + q(l1) + " --encoder-layers 1 --query " + tmp / "y0.npy" + common + " --out " +
                           tmp / "y1.npy" + " --threads 2");
        REQUIRE(c.code == 0);
        const auto s = run("--weights " + tmp / "model.safetensors" + " --prefix encoder. --encoder-layers 2 --query " +
                           tmp / "x.npy" + common + " --out " + tmp / "st.npy" + " --threads 2 --repeat 2");
        INFO(s.output);
        REQUIRE(s.code == 0);
        const auto got = read_file(tmp / "stack.npy");
        CHECK(got == read_file(tmp / "y1.npy"));  // layer by layer, on 1 and 2 threads: the same bits
        CHECK(got == read_file(tmp / "st.npy"));  // a safetensors file under a prefix, 2 threads
        CHECK(got != read_file(tmp / "y0.npy"));
        for (float x : floats_of(tmp / "stack.npy")) CHECK(std::isfinite(x));
    }
}

TEST_CASE("mha-run --encoder-layers applies an nn.TransformerEncoder's final norm; --json says what ran") {
    TempDir tmp;
    const SyntheticEncoder plain(2), normed(2, true);
    plain.write_npy_dir(tmp.path / "plain");
    normed.write_npy_dir(tmp.path / "normed");
    const int64_t B = 1, L = 5, E = SyntheticEncoder::E;
    write_npy(tmp / "x.npy", {B, L, E}, lcg_values(static_cast<size_t>(B * L * E), 3, 1.0f).data());
    const std::string args = " --encoder-layers 2 --num-heads " + std::to_string(SyntheticEncoder::H) + " --query " + tmp / "x.npy" + " --norm-eps 1e-4";
    REQUIRE(run("--weights " + q(tmp.path / "plain") + args + " --out " + tmp / "a.npy").code == 0);
    const auto r = run("--weights " + q(tmp.path / "normed") + args + " --out " + tmp / "b.npy --json --repeat 3");
    INFO(r.output);
    REQUIRE(r.code == 0);
    const auto j = last_json_line(r.output);
    CHECK(j["mode"] == "encoder");
    CHECK(j["encoder_layers"] == 2);
    CHECK(j["ffn_dim"] == SyntheticEncoder::F);
    CHECK(j["embed_dim"] == E);
    CHECK(j["activation"] == "relu");
    CHECK(j["norm_first"] == false);
    CHECK(j["final_norm"] == true);
    CHECK(j["runs_ms"].size() == 3);
    CHECK(j["gflops"].get<double>() > 0);
    // b = LayerNorm(a) with the final norm's weight and bias, eps 1e-4.
    const auto a = floats_of(tmp / "a.npy"), b = floats_of(tmp / "b.npy");
    const auto &w = normed.top.at("norm.weight").second, &bias = normed.top.at("norm.bias").second;
    double worst = 0;
    for (int64_t t = 0; t < B * L; ++t) {
        double mean = 0, var = 0;
        for (int64_t e = 0; e < E; ++e) mean += a[static_cast<size_t>(t * E + e)];
        mean /= E;
        for (int64_t e = 0; e < E; ++e) var += std::pow(a[static_cast<size_t>(t * E + e)] - mean, 2);
        var /= E;
        for (int64_t e = 0; e < E; ++e) {
            const double want = (a[static_cast<size_t>(t * E + e)] - mean) / std::sqrt(var + 1e-4) * w[static_cast<size_t>(e)] +
                                bias[static_cast<size_t>(e)];
            worst = std::max(worst, std::abs(want - b[static_cast<size_t>(t * E + e)]));
        }
    }
    CHECK(worst < 1e-5);
}

TEST_CASE("mha-run --encoder-layers refuses a state_dict whose keys or shapes do not fit, naming the key") {
    TempDir tmp;
    const SyntheticEncoder enc(2);
    const int64_t E = SyntheticEncoder::E;
    write_npy(tmp / "x.npy", {2, 3, E}, lcg_values(static_cast<size_t>(2 * 3 * E), 4, 1.0f).data());
    write_npy(tmp / "x_wide.npy", {2, 3, E + 1}, lcg_values(static_cast<size_t>(2 * 3 * (E + 1)), 4, 1.0f).data());
    // A directory per broken state_dict: the good stack, then one change.
    auto broken = [&](const std::string &name, const std::function<void(const fs::path &)> &change) {
        const fs::path d = tmp.path / name;
        enc.write_npy_dir(d);
        change(d);
        return q(d);
    };
    const std::string good = broken("good", [](const fs::path &) {});
    const std::string bare = q(tmp.path / "bare");
    enc.write_npy_dir(tmp.path / "bare", true, 0);
    const std::string missing = broken("missing", [](const fs::path &d) { fs::remove(d / "layers.1.norm2.weight.npy"); });
    const std::string shape = broken("shape", [](const fs::path &d) {
        write_npy((d / "layers.0.linear1.bias.npy").string(), {47}, lcg_values(47, 1, 1.0f).data());
    });
    const std::string in_proj = broken("in_proj", [](const fs::path &d) {
        write_npy((d / "layers.0.self_attn.in_proj_weight.npy").string(), {3 * E, E + 1},
                  lcg_values(static_cast<size_t>(3 * E * (E + 1)), 1, 1.0f).data());
    });
    const std::string other_e = broken("other_e", [](const fs::path &d) {
        write_npy((d / "layers.1.self_attn.in_proj_weight.npy").string(), {3 * 16, 16}, lcg_values(3 * 16 * 16, 1, 1.0f).data());
    });
    const std::string extra = broken("extra", [](const fs::path &d) {
        write_npy((d / "layers.0.self_attn.extra.npy").string(), {E}, lcg_values(static_cast<size_t>(E), 1, 1.0f).data());
    });
    const std::string bias_k = broken("bias_k", [](const fs::path &d) {
        write_npy((d / "layers.1.self_attn.bias_k.npy").string(), {1, 1, E}, lcg_values(static_cast<size_t>(E), 1, 1.0f).data());
    });
    const std::string dtype = broken("dtype", [&](const fs::path &d) {
        fs::copy_file(kData / "key_padding/key_padding_mask.npy", d / "layers.1.norm1.bias.npy",
                      fs::copy_options::overwrite_existing);
    });
    const std::string bias_only = broken("bias_only", [](const fs::path &d) {
        write_npy((d / "norm.bias.npy").string(), {SyntheticEncoder::E}, lcg_values(SyntheticEncoder::E, 1, 1.0f).data());
    });
    struct Bad {
        const char *what;
        std::string args, names, says;
    };
    const std::string x = " --num-heads " + std::to_string(SyntheticEncoder::H) + " --query " + tmp / "x.npy";
    const Bad bad[] = {
        {"missing key", "--weights " + missing + " --encoder-layers 2" + x, "layers.1.norm2.weight", "missing (expected [32]"},
        {"wrong shape", "--weights " + shape + " --encoder-layers 2" + x, "layers.0.linear1.bias.npy",
         "expected shape [48], found [47]"},
        {"in_proj not [3E, E]", "--weights " + in_proj + " --encoder-layers 2" + x, "layers.0.self_attn.in_proj_weight",
         "expected shape [3E, E], found [96, 33]"},
        {"layers of different widths", "--weights " + other_e + " --encoder-layers 2" + x,
         "layers.1.self_attn.in_proj_weight", "expected shape [96, 32], found [48, 16]"},
        {"--ffn-dim does not fit", "--weights " + good + " --encoder-layers 2 --ffn-dim 64" + x, "layers.0.linear1.weight",
         "expected shape [64, 32], found [48, 32]"},
        {"more layers than asked", "--weights " + good + " --encoder-layers 1" + x, "layers.1.",
         "holds 2 layers (layers.0. to layers.1.), --encoder-layers asks for 1"},
        {"fewer layers than asked", "--weights " + good + " --encoder-layers 3" + x, "layers.2.self_attn.in_proj_weight",
         "missing: the state_dict holds 2 layers"},
        {"one layer's keys for a stack", "--weights " + bare + " --encoder-layers 2" + x, "layers.0.self_attn.in_proj_weight",
         "one nn.TransformerEncoderLayer's keys"},
        {"an nn.MultiheadAttention state_dict", "--weights " + q(kData / "self/weights") + " --encoder-layers 1" + x,
         "layers.0.self_attn.in_proj_weight", "holds no encoder layer"},
        {"unexpected key", "--weights " + extra + " --encoder-layers 2" + x, "layers.0.self_attn.extra", "unexpected key"},
        {"add_bias_kv", "--weights " + bias_k + " --encoder-layers 2" + x, "layers.1.self_attn.bias_k",
         "add_bias_kv is not supported"},
        {"wrong dtype", "--weights " + dtype + " --encoder-layers 2" + x, "layers.1.norm1.bias.npy", "expected dtype float32"},
        {"final norm.bias without its weight", "--weights " + bias_only + " --encoder-layers 2" + x, "norm.weight", "missing"},
        {"heads do not divide", "--weights " + good + " --encoder-layers 2 --num-heads 5 --query " + tmp / "x.npy",
         "--num-heads 5", "does not divide embed_dim 32"},
        {"query of another width", "--weights " + good + " --encoder-layers 2 --num-heads " + std::to_string(SyntheticEncoder::H) + " --query " + tmp / "x_wide.npy",
         "x_wide.npy", "expected shape [*, *, 32], found [2, 3, 33]"},
        {"wrong prefix", "--weights " + tmp / "m.safetensors" + " --prefix enc. --encoder-layers 2" + x,
         "enc.layers.0.self_attn.in_proj_weight", "missing"},
    };
    enc.write_safetensors(tmp.path / "m.safetensors", "encoder.");
    for (const auto &b : bad) {
        CAPTURE(std::string(b.what));
        const auto r = run(b.args + " --out " + tmp / "o.npy");
        INFO(r.output);
        CHECK(r.code == 2);
        CHECK(r.output.find(b.names) != std::string::npos);
        CHECK(r.output.find(b.says) != std::string::npos);
        CHECK_FALSE(fs::exists(tmp / "o.npy"));
    }
    // The good state_dict runs, and without --encoder-layers it is no nn.MultiheadAttention's.
    CHECK(run("--weights " + good + " --encoder-layers 2" + x + " --out " + tmp / "o.npy").code == 0);
    const auto mha = run("--weights " + good + x);
    CHECK(mha.code == 2);
    CHECK(mha.output.find("out_proj.weight") != std::string::npos);
}
