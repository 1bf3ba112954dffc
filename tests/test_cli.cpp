// The command lines of mha-run, mha-bench and mha-tune: every flag, and every way to get one wrong.
#include <doctest/doctest.h>

#include "cli_args.hpp"

using namespace mha::cli;

namespace {

std::string usage_error(const std::vector<std::string> &args, RunOptions (*parse)(const std::vector<std::string> &)) {
    try {
        parse(args);
    } catch (const UsageError &e) {
        return e.what();
    }
    return "";
}

const std::vector<std::string> kMinimal = {"--weights", "w", "--num-heads", "8", "--query", "q.npy"};

std::vector<std::string> with(std::vector<std::string> extra) {
    std::vector<std::string> a = kMinimal;
    a.insert(a.end(), extra.begin(), extra.end());
    return a;
}

} // namespace

TEST_CASE("mha-run: every flag") {
    const RunOptions o = parse_run_args({"--weights", "m.safetensors", "--prefix", "layers.0.attn.", "--num-heads", "8",
                                         "--query", "q.npy", "--key", "k.npy", "--value", "v.npy", "--key-padding-mask",
                                         "kpm.npy", "--attn-mask", "am.npy", "--causal", "--out", "o.npy",
                                         "--attn-weights", "w.npy", "--average-attn-weights", "--threads", "2",
                                         "--repeat", "5", "--json"});
    CHECK(o.weights == "m.safetensors");
    CHECK(o.prefix == "layers.0.attn.");
    CHECK(o.num_heads == 8);
    CHECK(o.query == "q.npy");
    CHECK(o.key == "k.npy");
    CHECK(o.value == "v.npy");
    CHECK(o.key_padding_mask == "kpm.npy");
    CHECK(o.attn_mask == "am.npy");
    CHECK(o.causal);
    CHECK(o.out == "o.npy");
    CHECK(o.attn_weights == "w.npy");
    CHECK(o.average_attn_weights);
    CHECK(o.threads == 2);
    CHECK(o.repeat == 5);
    CHECK(o.json);
    const RunOptions d = parse_run_args(kMinimal);
    CHECK(d.threads == 1);
    CHECK(d.repeat == 1);
    CHECK_FALSE(d.causal);
    CHECK_FALSE(d.json);
    CHECK(d.key.empty());
    CHECK(parse_run_args({"--help"}).help);
    CHECK(parse_run_args({"-h"}).help);
    CHECK(parse_run_args(with({"--threads", "0"})).threads == 0);
}

TEST_CASE("mha-run: wrong command lines are refused, naming the flag") {
    auto err = [](const std::vector<std::string> &a) { return usage_error(a, parse_run_args); };
    CHECK(err({"--num-heads", "8", "--query", "q"}).find("--weights is required") != std::string::npos);
    CHECK(err({"--weights", "w", "--query", "q"}).find("--num-heads is required") != std::string::npos);
    CHECK(err({"--weights", "w", "--num-heads", "8"}).find("--query is required") != std::string::npos);
    CHECK(err(with({"--key", "k.npy"})).find("--key and --value") != std::string::npos);
    CHECK(err(with({"--value", "v.npy"})).find("--key and --value") != std::string::npos);
    CHECK(err(with({"--bogus"})).find("unknown argument '--bogus'") != std::string::npos);
    CHECK(err(with({"--out"})).find("--out needs a value") != std::string::npos);
    CHECK(err(with({"--threads", "two"})).find("--threads: 'two'") != std::string::npos);
    CHECK(err(with({"--threads", "-1"})).find("--threads") != std::string::npos);
    CHECK(err(with({"--repeat", "0"})).find("--repeat") != std::string::npos);
    CHECK(err(with({"--repeat", "99999999999999999999"})).find("--repeat") != std::string::npos);
    CHECK(err({"--weights", "w", "--num-heads", "0", "--query", "q"}).find("--num-heads") != std::string::npos);
    CHECK(err(with({"--num-heads", "4"})).find("given twice") != std::string::npos);
    CHECK(err(with({"--average-attn-weights"})).find("needs --attn-weights") != std::string::npos);
    CHECK(err(with({"--prefix", "a."})).find("--prefix applies to a .safetensors") != std::string::npos);
    CHECK(err(with({"--out", "q.npy"})).find("also an input") != std::string::npos);
}

TEST_CASE("mha-run: --generate, --prefill-chunk, --check-invariance") {
    const RunOptions d = parse_run_args(kMinimal);
    CHECK(d.generate == 0);
    CHECK(d.prefill_chunk == 0);
    CHECK_FALSE(d.check_invariance);
    const RunOptions o = parse_run_args(with({"--generate", "16", "--prefill-chunk", "4", "--check-invariance", "--out",
                                              "o.npy", "--threads", "2", "--json"}));
    CHECK(o.generate == 16);
    CHECK(o.prefill_chunk == 4);
    CHECK(o.check_invariance);
    CHECK(o.causal);  // implied
    CHECK(o.out == "o.npy");
    CHECK(parse_run_args(with({"--generate", "1", "--causal"})).causal);
    CHECK(parse_run_args(with({"--generate", "1048576"})).generate == 1048576);

    auto err = [](const std::vector<std::string> &a) { return usage_error(a, parse_run_args); };
    CHECK(err(with({"--generate", "0"})).find("--generate: '0' is not an integer in [1, ") != std::string::npos);
    CHECK(err(with({"--generate", "-3"})).find("--generate: '-3'") != std::string::npos);
    CHECK(err(with({"--generate", "ten"})).find("--generate: 'ten'") != std::string::npos);
    CHECK(err(with({"--generate", "1048577"})).find("--generate") != std::string::npos);
    CHECK(err(with({"--generate"})).find("--generate needs a value") != std::string::npos);
    CHECK(err(with({"--generate", "2", "--generate", "3"})).find("--generate is given twice") != std::string::npos);
    CHECK(err(with({"--generate", "2", "--prefill-chunk", "0"})).find("--prefill-chunk: '0'") != std::string::npos);
    CHECK(err(with({"--generate", "2", "--prefill-chunk", "x"})).find("--prefill-chunk: 'x'") != std::string::npos);
    CHECK(err(with({"--check-invariance"})).find("--check-invariance needs --generate") != std::string::npos);
    CHECK(err(with({"--prefill-chunk", "8"})).find("--prefill-chunk needs --generate") != std::string::npos);
    CHECK(err(with({"--generate", "2", "--key", "k.npy", "--value", "v.npy"})).find("--generate does not take --key") !=
          std::string::npos);
    CHECK(err(with({"--generate", "2", "--key-padding-mask", "m.npy"})).find("--generate does not take --key-padding-mask") !=
          std::string::npos);
    CHECK(err(with({"--generate", "2", "--attn-mask", "m.npy"})).find("--generate does not take --attn-mask") !=
          std::string::npos);
    CHECK(err(with({"--generate", "2", "--attn-weights", "w.npy"})).find("--generate does not take --attn-weights") !=
          std::string::npos);
    CHECK(err(with({"--generate", "2", "--repeat", "3"})).find("--generate does not take --repeat") != std::string::npos);
    CHECK(err(with({"--check-invariance", "--check-invariance", "--generate", "1"})).find("given twice") != std::string::npos);
}

TEST_CASE("mha-bench: every flag") {
    const BenchOptions d = parse_bench_args({});
    CHECK(d.threads == std::vector<int>{1, 2});
    CHECK_FALSE(d.quick);
    const BenchOptions o = parse_bench_args({"--quick", "--threads", "1,2,4", "--filter", "gemm|layer", "--json"});
    CHECK(o.quick);
    CHECK(o.json);
    CHECK(o.threads == std::vector<int>{1, 2, 4});
    CHECK(o.filter == "gemm|layer");
    CHECK(parse_bench_args({"--threads", "3"}).threads == std::vector<int>{3});
    CHECK(parse_bench_args({"--help"}).help);
    CHECK_THROWS_AS(parse_bench_args({"--threads", "1,,2"}), UsageError);
    CHECK_THROWS_AS(parse_bench_args({"--threads", "0"}), UsageError);
    CHECK_THROWS_AS(parse_bench_args({"--threads"}), UsageError);
    CHECK_THROWS_AS(parse_bench_args({"--fast"}), UsageError);
    CHECK_FALSE(d.mpi);
    CHECK_FALSE(d.threads_given);
    const BenchOptions m = parse_bench_args({"--mpi", "--threads", "1"});
    CHECK(m.mpi);
    CHECK(m.threads_given);
    CHECK_THROWS_AS(parse_bench_args({"--mpi", "--mpi"}), UsageError);
}

TEST_CASE("mha-run: --tp") {
    CHECK_FALSE(parse_run_args(kMinimal).tp);
    const RunOptions o = parse_run_args(with({"--tp", "--out", "o.npy", "--attn-weights", "w.npy", "--repeat", "3", "--json"}));
    CHECK(o.tp);
    CHECK(o.repeat == 3);
    CHECK(parse_run_args(with({"--tp", "--key", "k.npy", "--value", "v.npy", "--causal"})).tp);
    auto err = [](const std::vector<std::string> &a) { return usage_error(a, parse_run_args); };
    CHECK(err(with({"--tp", "--tp"})).find("--tp is given twice") != std::string::npos);
    CHECK(err(with({"--tp", "--generate", "4"})).find("--generate does not take --tp") != std::string::npos);
    CHECK(err(with({"--tp", "--encoder-layers", "1"})).find("--encoder-layers does not take --tp") != std::string::npos);
}

TEST_CASE("mha-tune: every flag") {
    const TuneOptions d = parse_tune_args({});
    CHECK_FALSE(d.quick);
    CHECK(d.threads == 1);
    CHECK(d.out.empty());
    const TuneOptions o =
        parse_tune_args({"--quick", "--out", "t.json", "--csv", "c.csv", "--threads", "2", "--max-candidates", "3"});
    CHECK(o.quick);
    CHECK(o.out == "t.json");
    CHECK(o.csv == "c.csv");
    CHECK(o.threads == 2);
    CHECK(o.max_candidates == 3);
    CHECK_FALSE(o.list);
    CHECK(parse_tune_args({"--list", "--quick", "--threads", "2"}).list);
    CHECK_THROWS_AS(parse_tune_args({"--list", "--out", "t.json"}), UsageError);
    CHECK_THROWS_AS(parse_tune_args({"--list", "--csv", "c.csv"}), UsageError);
    CHECK(parse_tune_args({"-h"}).help);
    CHECK_THROWS_AS(parse_tune_args({"--out"}), UsageError);
    CHECK_THROWS_AS(parse_tune_args({"--threads", "x"}), UsageError);
    CHECK_THROWS_AS(parse_tune_args({"--max-candidates", "0"}), UsageError);
    CHECK_THROWS_AS(parse_tune_args({"--slow"}), UsageError);
}

TEST_CASE("mha-run: --encoder-layers, --ffn-dim, --activation, --norm-first, --norm-eps") {
    const RunOptions d = parse_run_args(kMinimal);
    CHECK(d.encoder_layers == 0);
    CHECK(d.ffn_dim == 0);
    CHECK(d.activation == "relu");
    CHECK_FALSE(d.norm_first);
    CHECK(d.norm_eps == 1e-5f);
    const RunOptions o = parse_run_args(with({"--encoder-layers", "6", "--ffn-dim", "2048", "--activation", "gelu",
                                              "--norm-first", "--norm-eps", "1e-6", "--key-padding-mask", "kpm.npy",
                                              "--attn-mask", "am.npy", "--causal", "--out", "o.npy", "--threads", "2",
                                              "--repeat", "3", "--json"}));
    CHECK(o.encoder_layers == 6);
    CHECK(o.ffn_dim == 2048);
    CHECK(o.activation == "gelu");
    CHECK(o.norm_first);
    CHECK(o.norm_eps == 1e-6f);
    CHECK(o.key_padding_mask == "kpm.npy");
    CHECK(o.attn_mask == "am.npy");
    CHECK(o.causal);
    CHECK(o.repeat == 3);
    CHECK(o.json);
    const RunOptions one = parse_run_args({"--weights", "m.safetensors", "--prefix", "encoder.", "--num-heads", "8",
                                           "--query", "x.npy", "--encoder-layers", "1", "--activation", "relu",
                                           "--norm-eps", "0.01"});
    CHECK(one.encoder_layers == 1);
    CHECK(one.prefix == "encoder.");
    CHECK(one.activation == "relu");
    CHECK(one.norm_eps == 0.01f);
    CHECK_FALSE(one.norm_first);
    CHECK(parse_run_args(with({"--encoder-layers", "4096"})).encoder_layers == 4096);
    CHECK(parse_run_args(with({"--encoder-layers", "1", "--norm-eps", "1"})).norm_eps == 1.0f);
}

TEST_CASE("mha-run: wrong encoder command lines are refused, naming the flag") {
    auto err = [](const std::vector<std::string> &a) { return usage_error(a, parse_run_args); };
    auto enc = [](std::vector<std::string> extra) {
        std::vector<std::string> a = with({"--encoder-layers", "2"});
        a.insert(a.end(), extra.begin(), extra.end());
        return a;
    };
    CHECK(err(with({"--encoder-layers", "0"})).find("--encoder-layers: '0' is not an integer in [1, 4096]") != std::string::npos);
    CHECK(err(with({"--encoder-layers", "-2"})).find("--encoder-layers: '-2'") != std::string::npos);
    CHECK(err(with({"--encoder-layers", "two"})).find("--encoder-layers: 'two'") != std::string::npos);
    CHECK(err(with({"--encoder-layers", "4097"})).find("--encoder-layers") != std::string::npos);
    CHECK(err(with({"--encoder-layers"})).find("--encoder-layers needs a value") != std::string::npos);
    CHECK(err(enc({"--encoder-layers", "3"})).find("--encoder-layers is given twice") != std::string::npos);
    CHECK(err(enc({"--ffn-dim", "0"})).find("--ffn-dim: '0'") != std::string::npos);
    CHECK(err(enc({"--ffn-dim", "-5"})).find("--ffn-dim: '-5'") != std::string::npos);
    CHECK(err(enc({"--ffn-dim", "2k"})).find("--ffn-dim: '2k'") != std::string::npos);
    CHECK(err(enc({"--activation", "tanh"})).find("--activation: 'tanh' is not relu or gelu") != std::string::npos);
    CHECK(err(enc({"--activation", "GELU"})).find("--activation: 'GELU'") != std::string::npos);
    CHECK(err(enc({"--activation"})).find("--activation needs a value") != std::string::npos);
    for (const char *bad : {"0", "-1e-5", "abc", "nan", "inf", "2", "1e-50", "", "1e-5x"}) {
        CAPTURE(bad);
        CHECK(err(enc({"--norm-eps", bad})).find(std::string("--norm-eps: '") + bad + "' is not a number in (0, 1]") !=
              std::string::npos);
    }
    CHECK(err(enc({"--norm-first", "--norm-first"})).find("--norm-first is given twice") != std::string::npos);
    // The encoder's flags mean nothing without --encoder-layers.
    CHECK(err(with({"--ffn-dim", "64"})).find("--ffn-dim needs --encoder-layers N") != std::string::npos);
    CHECK(err(with({"--activation", "relu"})).find("--activation needs --encoder-layers N") != std::string::npos);
    CHECK(err(with({"--norm-first"})).find("--norm-first needs --encoder-layers N") != std::string::npos);
    CHECK(err(with({"--norm-eps", "1e-6"})).find("--norm-eps needs --encoder-layers N") != std::string::npos);
    // An encoder layer is self-attention without weights out, run on whole sequences.
    CHECK(err(enc({"--key", "k.npy", "--value", "v.npy"})).find("--encoder-layers does not take --key and --value") !=
          std::string::npos);
    CHECK(err(enc({"--attn-weights", "w.npy"})).find("--encoder-layers does not take --attn-weights") != std::string::npos);
    CHECK(err(enc({"--attn-weights", "w.npy", "--average-attn-weights"})).find("--encoder-layers does not take --attn-weights") !=
          std::string::npos);
    CHECK(err(enc({"--generate", "4"})).find("--encoder-layers does not take --generate") != std::string::npos);
    CHECK(err(enc({"--prefix", "layers."})).find("--prefix applies to a .safetensors") != std::string::npos);
    CHECK(err(enc({"--out", "q.npy"})).find("also an input") != std::string::npos);
    CHECK(err({"--weights", "w", "--query", "q", "--encoder-layers", "1"}).find("--num-heads is required") !=
          std::string::npos);
}

TEST_CASE("mha-run: --window, --softcap, --alibi, --sinks, --rope-*, --kv-dtype") {
    const RunOptions d = parse_run_args(kMinimal);
    CHECK(d.window == 0);
    CHECK(d.softcap == 0.0f);
    CHECK(!d.alibi);
    CHECK(d.sinks.empty());
    CHECK(d.rope_dims == 0);
    CHECK(d.kv_dtype == "f32");
    const RunOptions o = parse_run_args(with({"--window", "4096", "--softcap", "50", "--alibi", "--sinks", "s.npy",
                                              "--rope-dims", "64", "--rope-theta", "500000", "--rope-interleaved",
                                              "--generate", "4", "--kv-dtype", "i8"}));
    CHECK(o.window == 4096);
    CHECK(o.softcap == 50.0f);
    CHECK(o.alibi);
    CHECK(o.sinks == "s.npy");
    CHECK(o.rope_dims == 64);
    CHECK(o.rope_theta == 500000.0f);
    CHECK(o.rope_interleaved);
    CHECK(o.kv_dtype == "i8");
    auto err = [](const std::vector<std::string> &a) { return usage_error(a, parse_run_args); };
    CHECK(err(with({"--window", "0"})).find("--window: '0'") != std::string::npos);
    CHECK(err(with({"--window", "-1"})).find("--window") != std::string::npos);
    for (const char *c : {"0", "-2", "nan", "inf", "x"})
        CHECK(err(with({"--softcap", c})).find("--softcap") != std::string::npos);
    CHECK(err(with({"--rope-dims", "3"})).find("--rope-dims: 3 is odd") != std::string::npos);
    CHECK(err(with({"--rope-dims", "0"})).find("--rope-dims") != std::string::npos);
    CHECK(err(with({"--rope-theta", "100"})).find("need --rope-dims") != std::string::npos);
    CHECK(err(with({"--rope-dims", "8", "--rope-theta", "-1"})).find("--rope-theta") != std::string::npos);
    CHECK(err(with({"--generate", "2", "--kv-dtype", "f16"})).find("--kv-dtype: 'f16'") != std::string::npos);
    CHECK(err(with({"--kv-dtype", "i8"})).find("--kv-dtype needs --generate") != std::string::npos);
    CHECK(err(with({"--encoder-layers", "1", "--window", "8"})).find("--encoder-layers") != std::string::npos);
}
