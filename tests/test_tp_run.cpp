// mha-run --tp end to end under mpirun: the PyTorch golden cases (tests/data/layer) through the
// layer sharded over 2 ranks, rank 0 writing the outputs; a rank count that cannot split the heads
// refused by every rank with exit status 2; and a plain (unsharded) run of the same build alongside.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <string>

#include <nlohmann/json.hpp>

#include "io/npy.hpp"
#include "run_tool.hpp"

namespace fs = std::filesystem;
using mha::io::read_npy;
using mha::io::to_floats;
using mha::test::shell_quote;
using mha::test::TempDir;

namespace {

const fs::path kData = fs::path(MHA_TEST_DATA) / "layer";

std::string q(const fs::path &p) { return shell_quote(p); }

mha::test::ToolResult mpirun(int np, const std::string &args) {
    const char *launcher = std::getenv("MPIRUN");
    REQUIRE_MESSAGE(launcher, "MPIRUN must name mpirun (meson test sets it)");
    return mha::test::run_tool("MHA_RUN", args, true,
                               std::string(launcher) + " --oversubscribe --bind-to none -np " + std::to_string(np));
}

double worst_diff(const std::string &got_path, const fs::path &want_path) {
    const auto got = read_npy(got_path), want = read_npy(want_path.string());
    REQUIRE(got.shape == want.shape);
    const auto g = to_floats("got", got, got.shape), w = to_floats("want", want, want.shape);
    double worst = 0;
    for (size_t i = 0; i < g.size(); ++i) worst = std::max(worst, std::abs(static_cast<double>(g[i]) - w[i]));
    return worst;
}

} // namespace

TEST_CASE("mpirun -np 2 mha-run --tp matches PyTorch on the golden cases; rank 0 writes the outputs") {
    TempDir tmp;
    struct Case {
        const char *name;
        int heads;
        std::string extra;
    };
    const Case cases[] = {
        {"self", 4, ""},
        {"cross_kdim_vdim", 2, "--key " + q(kData / "cross_kdim_vdim/key.npy") + " --value " + q(kData / "cross_kdim_vdim/value.npy")},
        {"key_padding", 4, "--key-padding-mask " + q(kData / "key_padding/key_padding_mask.npy")},
        {"causal", 4, "--causal --attn-mask " + q(kData / "causal/attn_mask.npy")},
    };
    for (const auto &c : cases) {
        CAPTURE(c.name);
        const fs::path d = kData / c.name;
        const auto r = mpirun(2, "--tp --weights " + q(d / "weights") + " --num-heads " + std::to_string(c.heads) +
                                     " --query " + q(d / "query.npy") + " " + c.extra + " --out " + tmp / "o.npy" +
                                     " --attn-weights " + tmp / "w.npy" + " --repeat 2 --json");
        INFO(r.output);
        REQUIRE(r.code == 0);
        CHECK(worst_diff(tmp / "o.npy", d / "out.npy") <= 1e-4);
        CHECK(worst_diff(tmp / "w.npy", d / "weights.npy") <= 1e-5);
        // One JSON object, from rank 0 alone.
        std::string last = r.output.substr(0, r.output.find_last_not_of('\n') + 1);
        last = last.substr(last.find_last_of('\n') + 1);
        const auto j = nlohmann::json::parse(last);
        CHECK(j["mode"] == "tp");
        CHECK(j["ranks"] == 2);
        CHECK(j["comm_share"].get<double>() >= 0.0);
        CHECK(j["comm_share"].get<double>() <= 1.0);
        CHECK(std::count(r.output.begin(), r.output.end(), '{') == 1);
        fs::remove(tmp / "o.npy");
        fs::remove(tmp / "w.npy");
    }
}

TEST_CASE("mpirun -np 3 mha-run --tp refuses 4 heads on every rank, writes nothing, exits 2") {
    TempDir tmp;
    const fs::path d = kData / "self";
    const auto r = mpirun(3, "--tp --weights " + q(d / "weights") + " --num-heads 4 --query " + q(d / "query.npy") +
                                 " --out " + tmp / "o.npy");
    INFO(r.output);
    CHECK(r.code == 2);
    for (int rank = 0; rank < 3; ++rank)
        CHECK(r.output.find("rank " + std::to_string(rank) + " of 3: num_kv_heads = 4 (num_heads = 4) cannot be split over 3 ranks") !=
              std::string::npos);
    CHECK(!fs::exists(tmp / "o.npy"));
}

TEST_CASE("mha-run --tp takes the attention flags (window, soft-cap, ALiBi, RoPE) as the unsharded run does") {
    TempDir tmp;
    const fs::path d = kData / "self";
    const std::string common = "--weights " + q(d / "weights") + " --num-heads 4 --query " + q(d / "query.npy") +
                               " --causal --window 3 --softcap 5 --alibi --rope-dims 4 --out ";
    const auto one = mha::test::run_tool("MHA_RUN", common + tmp / "one.npy");
    INFO(one.output);
    REQUIRE(one.code == 0);
    const auto two = mpirun(2, "--tp " + common + tmp / "two.npy");
    INFO(two.output);
    REQUIRE(two.code == 0);
    // The modifiers change the output: the sharded run must match the unsharded one with them, not
    // the plain golden output (the output projection's sum order differs: a small tolerance).
    CHECK(worst_diff(tmp / "two.npy", tmp / "one.npy") <= 1e-5);
    CHECK(worst_diff(tmp / "one.npy", d / "out.npy") > 1e-3);
}
