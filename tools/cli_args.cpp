#include "cli_args.hpp"

#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <functional>
#include <map>
#include <utility>

namespace mha::cli {

const char *const kRunUsage =
    "usage: mha-run --weights PATH [--prefix P] --num-heads H --query q.npy [--key k.npy --value v.npy]\n"
    "               [--key-padding-mask m.npy] [--attn-mask m.npy] [--causal] [--out o.npy]\n"
    "               [--attn-weights w.npy [--average-attn-weights]] [--threads N] [--repeat N] [--json]\n"
    "       mha-run --weights PATH [--prefix P] --num-heads H --query q.npy --generate N [--prefill-chunk N]\n"
    "               [--check-invariance] [--out o.npy] [--threads N] [--json]\n"
    "       mpirun -np N mha-run --tp --weights PATH --num-heads H --query q.npy [the first form's flags]\n"
    "       mha-run --weights PATH [--prefix P] --num-heads H --query x.npy --encoder-layers N [--ffn-dim F]\n"
    "               [--activation relu|gelu] [--norm-first] [--norm-eps E] [--key-padding-mask m.npy]\n"
    "               [--attn-mask m.npy] [--causal] [--out o.npy] [--threads N] [--repeat N] [--json]\n"
    "  Runs a PyTorch nn.MultiheadAttention(batch_first=True) layer's weights on .npy tensors, or with\n"
    "  --encoder-layers an nn.TransformerEncoderLayer / nn.TransformerEncoder(batch_first=True) in eval mode.\n"
    "  --weights PATH            a directory of <state_dict key>.npy files (in_proj_weight.npy, in_proj_bias.npy,\n"
    "                            out_proj.weight.npy, out_proj.bias.npy; or q_proj_weight.npy, k_proj_weight.npy,\n"
    "                            v_proj_weight.npy when kdim/vdim differ from E), or a .safetensors file\n"
    "  --prefix P                the layer's key prefix inside a .safetensors file (e.g. \"layers.0.self_attn.\")\n"
    "  --num-heads H             number of heads (E must be a multiple of H)\n"
    "  --query q.npy             [B, Lq, E] float32\n"
    "  --key k.npy --value v.npy [B, Lk, kdim] and [B, Lk, vdim] float32; default: the query (self-attention)\n"
    "  --key-padding-mask m.npy  [B, Lk] bool or uint8; nonzero = padding (ignored), as in PyTorch\n"
    "  --attn-mask m.npy         [Lq, Lk] bool or uint8; nonzero = not allowed, as in PyTorch\n"
    "  --causal                  query i sees keys j <= i + Lk - Lq\n"
    "  --out o.npy               write the output [B, Lq, E] float32\n"
    "  --attn-weights w.npy      write the per-head weights [B, H, Lq, Lk]; with --average-attn-weights the\n"
    "                            head average [B, Lq, Lk], as PyTorch's need_weights returns by default\n"
    "  --threads N               threads (default 1; 0 = all hardware threads)\n"
    "  --repeat N                run the forward pass N times and time each run (default 1)\n"
    "  --json                    end stdout with one JSON object: best_ms, median_ms, gflops, threads, ...\n"
    "  --generate N              causal self-attention through a KV cache: prefill each query sequence, then\n"
    "                            feed its last output row back as the next input N times (one decode step\n"
    "                            each, all sequences batched); prints tokens/s. --out gets [B, Lq + N, E]: the\n"
    "                            prompt's rows, then the generated ones. Implies --causal\n"
    "  --prefill-chunk N         with --generate: prefill N tokens per call (default: the whole query at once)\n"
    "  --check-invariance        with --generate: compare every row, prompt and generated, with one causal\n"
    "                            forward pass over the whole sequence (prompt + generated rows as input), bit\n"
    "                            for bit, and say so; exit status 3 if any row differs\n"
    "  --tp                      shard the layer's heads across the ranks of MPI_COMM_WORLD (run under\n"
    "                            mpirun -np N, N dividing H); every rank reads the inputs, rank 0 alone prints\n"
    "                            and writes --out / --attn-weights. Needs a build with -Dmpi (OpenMPI)\n"
    "  --encoder-layers N        run an encoder: N = 1 takes an nn.TransformerEncoderLayer's state_dict\n"
    "                            (self_attn.in_proj_weight, self_attn.out_proj.weight, linear1.weight, linear2.weight,\n"
    "                            norm1.weight, norm2.weight and their biases) or a one-layer nn.TransformerEncoder's;\n"
    "                            N > 1 an nn.TransformerEncoder's (the same keys under layers.0. ... layers.N-1.,\n"
    "                            and its final norm.weight / norm.bias if it has one), applied in order\n"
    "  --ffn-dim F               dim_feedforward; default: linear1.weight's rows (checked when given)\n"
    "  --activation relu|gelu    the feed-forward activation (default relu; gelu is the erf form)\n"
    "  --norm-first              pre-norm (norm_first=True); default post-norm\n"
    "  --norm-eps E              layer_norm_eps (default 1e-5)\n"
    "  Today's decoders (any mode but --encoder-layers):\n"
    "  --window W                sliding window: query position i sees keys j > i - W (with or without --causal)\n"
    "  --softcap C               tanh soft-capping of the scaled scores: C tanh(s / C)\n"
    "  --alibi                   ALiBi biases with the paper's slopes (2^(-8h/H), its rule when H is not a power of 2)\n"
    "  --sinks s.npy             [H] float32 sink logits (gpt-oss); without it, a state_dict key 'sinks' or\n"
    "                            'self_attn.sinks' is used when present\n"
    "  --rope-dims N [--rope-theta T] [--rope-interleaved]\n"
    "                            rotary embeddings on the first N (even) dims of every q and k head, base T\n"
    "                            (default 10000); pairs (x[d], x[d + N/2]) (Hugging Face), or adjacent pairs\n"
    "  --kv-dtype f32|bf16|i8    with --generate: the KV cache's storage (default f32; i8: int8, a scale per\n"
    "                            token and KV head; --check-invariance then shows its rounding)\n"
    "Exit status: 0 on success, 2 on bad arguments or bad files (nothing is written), 3 when\n"
    "--check-invariance finds a row that differs, 1 otherwise.\n";

const char *const kBenchUsage =
    "usage: mha-bench [--quick] [--threads N[,N...]] [--filter REGEX] [--json]\n"
    "       mpirun -np N mha-bench --mpi [--quick] [--threads N[,N...]] [--filter REGEX] [--json]\n"
    "  Suites: gemm, softmax, attention, decode, layer, serving, encoder, variants (not in --quick); each row beside its\n"
    "  anchors, in one run.\n"
    "  --mpi        the mpi suite alone (implied under mpirun): the layer sharded over the N ranks, its time per\n"
    "               forward, the share spent communicating and the speed-up over one rank (-Dmpi builds)\n"
    "  --quick      the short run (under a minute)\n"
    "  --threads    thread counts to run (default 1,2)\n"
    "  --filter     run only rows whose \"suite/name/shape\" matches REGEX\n"
    "  --json       print one JSON object instead of the table\n";

const char *const kTuneUsage =
    "usage: mha-tune [--quick] [--list] [--out FILE] [--csv FILE] [--threads N]\n"
    "  Searches the GEMM blocking (MC, KC, NC, microkernel) and the attention tiles (query block, key\n"
    "  block) that fit this CPU's caches, on the projection and attention shapes; then sup_chain_rows on\n"
    "  few-row products, the register transpose (shuffles or inserts) on the calls that transpose, and,\n"
    "  with --threads above 1, parallel_min_flops and parallel_min_elems on small\n"
    "  calls made after the workers have gone to sleep; and compares the best with the defaults (over\n"
    "  all shapes, or it keeps the defaults).\n"
    "  --quick          a short search (about half a minute on one thread)\n"
    "  --list           print the candidates each search would measure (the later searches' from the\n"
    "                   defaults) and the shapes it times them on, and measure nothing\n"
    "  --out FILE       write the best tile config as JSON (MHA_TILE_CONFIG=FILE makes the runtime use it)\n"
    "  --csv FILE       write every measured candidate\n"
    "  --threads N      threads to tune for (default 1)\n"
    "  --max-candidates N  measure at most N candidates per search (for tests)\n";

std::vector<std::string> args_of(int argc, char **argv) { return std::vector<std::string>(argv + 1, argv + argc); }

namespace {

// A float32 in (0, 1] (not one that rounds to 0).
float parse_eps(const std::string &flag, const std::string &v) {
    char *end = nullptr;
    errno = 0;
    const double x = std::strtod(v.c_str(), &end);
    if (v.empty() || *end || errno || !std::isfinite(x) || !(static_cast<float>(x) > 0.0f) || x > 1.0)
        throw UsageError(flag + ": '" + v + "' is not a number in (0, 1]");
    return static_cast<float>(x);
}

// A finite float32 > 0.
float parse_positive(const std::string &flag, const std::string &v) {
    char *end = nullptr;
    errno = 0;
    const double x = std::strtod(v.c_str(), &end);
    if (v.empty() || *end || errno || !std::isfinite(static_cast<float>(x)) || !(static_cast<float>(x) > 0.0f))
        throw UsageError(flag + ": '" + v + "' is not a finite number > 0");
    return static_cast<float>(x);
}

int64_t parse_int(const std::string &flag, const std::string &v, int64_t lo, int64_t hi) {
    char *end = nullptr;
    errno = 0;
    const long long x = std::strtoll(v.c_str(), &end, 10);
    if (v.empty() || *end || errno || x < lo || x > hi)
        throw UsageError(flag + ": '" + v + "' is not an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]");
    return x;
}

// Walks args: a flag without a value calls its entry in `flags`, a flag with one its entry in
// `valued`; an unknown, repeated or value-less flag throws UsageError.
void walk(const std::vector<std::string> &args, const std::map<std::string, std::function<void()>> &flags,
          const std::map<std::string, std::function<void(const std::string &)>> &valued) {
    std::map<std::string, int> seen;
    for (size_t i = 0; i < args.size(); ++i) {
        const std::string &a = args[i];
        if (++seen[a] > 1 && a != "--help" && a != "-h") throw UsageError(a + " is given twice");
        if (auto f = flags.find(a); f != flags.end()) {
            f->second();
        } else if (auto v = valued.find(a); v != valued.end()) {
            if (i + 1 >= args.size()) throw UsageError(a + " needs a value");
            v->second(args[++i]);
        } else {
            throw UsageError("unknown argument '" + a + "'");
        }
    }
}

} // namespace

RunOptions parse_run_args(const std::vector<std::string> &args) {
    RunOptions o;
    bool repeat_given = false, seen_activation = false, seen_eps = false;
    auto path = [](std::string &dst) { return [&dst](const std::string &v) { dst = v; }; };
    walk(args,
         {{"--causal", [&] { o.causal = true; }},
          {"--average-attn-weights", [&] { o.average_attn_weights = true; }},
          {"--json", [&] { o.json = true; }},
          {"--check-invariance", [&] { o.check_invariance = true; }},
          {"--norm-first", [&] { o.norm_first = true; }},
          {"--tp", [&] { o.tp = true; }},
          {"--alibi", [&] { o.alibi = true; }},
          {"--rope-interleaved", [&] { o.rope_interleaved = true; }},
          {"--help", [&] { o.help = true; }},
          {"-h", [&] { o.help = true; }}},
         {{"--weights", path(o.weights)},
          {"--prefix", path(o.prefix)},
          {"--num-heads", [&](const std::string &v) { o.num_heads = parse_int("--num-heads", v, 1, 1 << 20); }},
          {"--query", path(o.query)},
          {"--key", path(o.key)},
          {"--value", path(o.value)},
          {"--key-padding-mask", path(o.key_padding_mask)},
          {"--attn-mask", path(o.attn_mask)},
          {"--out", path(o.out)},
          {"--attn-weights", path(o.attn_weights)},
          {"--threads", [&](const std::string &v) { o.threads = static_cast<int>(parse_int("--threads", v, 0, 4096)); }},
          {"--repeat", [&](const std::string &v) {
               o.repeat = static_cast<int>(parse_int("--repeat", v, 1, 1000000));
               repeat_given = true;
           }},
          {"--generate", [&](const std::string &v) { o.generate = parse_int("--generate", v, 1, 1 << 20); }},
          {"--prefill-chunk", [&](const std::string &v) { o.prefill_chunk = parse_int("--prefill-chunk", v, 1, int64_t{1} << 40); }},
          {"--encoder-layers", [&](const std::string &v) { o.encoder_layers = parse_int("--encoder-layers", v, 1, 4096); }},
          {"--ffn-dim", [&](const std::string &v) { o.ffn_dim = parse_int("--ffn-dim", v, 1, int64_t{1} << 30); }},
          {"--activation", [&](const std::string &v) {
               if (v != "relu" && v != "gelu") throw UsageError("--activation: '" + v + "' is not relu or gelu");
               o.activation = v;
               seen_activation = true;
           }},
          {"--window", [&](const std::string &v) { o.window = parse_int("--window", v, 1, int64_t{1} << 40); }},
          {"--softcap", [&](const std::string &v) { o.softcap = parse_positive("--softcap", v); }},
          {"--sinks", path(o.sinks)},
          {"--rope-dims", [&](const std::string &v) { o.rope_dims = parse_int("--rope-dims", v, 2, 1 << 20); }},
          {"--rope-theta", [&](const std::string &v) { o.rope_theta = parse_positive("--rope-theta", v); }},
          {"--kv-dtype", [&](const std::string &v) {
               if (v != "f32" && v != "bf16" && v != "i8") throw UsageError("--kv-dtype: '" + v + "' is not f32, bf16 or i8");
               o.kv_dtype = v;
           }},
          {"--norm-eps", [&](const std::string &v) {
               o.norm_eps = parse_eps("--norm-eps", v);
               seen_eps = true;
           }}});
    if (o.help) return o;
    if (o.weights.empty()) throw UsageError("--weights is required");
    if (o.num_heads == 0) throw UsageError("--num-heads is required");
    if (o.query.empty()) throw UsageError("--query is required");
    if (o.key.empty() != o.value.empty()) throw UsageError("--key and --value go together (neither means self-attention)");
    if (!o.prefix.empty() && !o.weights.ends_with(".safetensors"))
        throw UsageError("--prefix applies to a .safetensors --weights file");
    if (o.average_attn_weights && o.attn_weights.empty()) throw UsageError("--average-attn-weights needs --attn-weights");
    for (const std::string *p : {&o.out, &o.attn_weights})
        if (!p->empty() && (*p == o.query || *p == o.key || *p == o.value))
            throw UsageError("output file " + *p + " is also an input");
    if (o.rope_dims % 2 != 0) throw UsageError("--rope-dims: " + std::to_string(o.rope_dims) + " is odd");
    if (o.rope_dims == 0 && (o.rope_theta != 0.0f || o.rope_interleaved))
        throw UsageError("--rope-theta and --rope-interleaved need --rope-dims N");
    if (o.kv_dtype != "f32" && !o.generate) throw UsageError("--kv-dtype needs --generate N");
    if (o.encoder_layers && (o.window || o.softcap != 0.0f || o.alibi || !o.sinks.empty() || o.rope_dims))
        throw UsageError("--window, --softcap, --alibi, --sinks and --rope-* apply to an attention layer, not --encoder-layers");
    if (o.encoder_layers == 0) {
        // The encoder's flags say how to run its layers: without --encoder-layers they mean nothing.
        const std::pair<bool, const char *> encoder_only[] = {
            {o.ffn_dim != 0, "--ffn-dim"},
            {seen_activation, "--activation"},
            {o.norm_first, "--norm-first"},
            {seen_eps, "--norm-eps"}};
        for (const auto &[given, what] : encoder_only)
            if (given) throw UsageError(std::string(what) + " needs --encoder-layers N");
    } else {
        // An encoder layer is self-attention on its input and returns no attention weights.
        const std::pair<bool, const char *> not_with[] = {
            {!o.key.empty(), "--key and --value (an encoder layer attends over its own input)"},
            {!o.attn_weights.empty(), "--attn-weights (an encoder layer returns no attention weights)"},
            {o.generate != 0, "--generate (an encoder runs whole sequences)"},
            {o.prefill_chunk != 0, "--prefill-chunk"},
            {o.check_invariance, "--check-invariance"},
            {o.tp, "--tp (the sharded layer is the attention layer)"}};
        for (const auto &[given, what] : not_with)
            if (given) throw UsageError(std::string("--encoder-layers does not take ") + what);
        return o;
    }
    if (o.generate == 0) {
        if (o.check_invariance) throw UsageError("--check-invariance needs --generate N");
        if (o.prefill_chunk) throw UsageError("--prefill-chunk needs --generate N");
    } else {
        // Generation is causal self-attention over the cache: no other keys, masks or weights.
        const std::pair<bool, const char *> not_with[] = {
            {!o.key.empty(), "--key and --value (it runs self-attention on the query)"},
            {!o.key_padding_mask.empty(), "--key-padding-mask (it runs causally over a KV cache)"},
            {!o.attn_mask.empty(), "--attn-mask (it runs causally over a KV cache)"},
            {!o.attn_weights.empty(), "--attn-weights"},
            {repeat_given, "--repeat (it times every step)"},
            {o.tp, "--tp (the sharded layer runs the plain forward pass)"}};
        for (const auto &[given, what] : not_with)
            if (given) throw UsageError(std::string("--generate does not take ") + what);
        o.causal = true;
    }
    return o;
}

BenchOptions parse_bench_args(const std::vector<std::string> &args) {
    BenchOptions o;
    walk(args,
         {{"--quick", [&] { o.quick = true; }},
          {"--json", [&] { o.json = true; }},
          {"--mpi", [&] { o.mpi = true; }},
          {"--help", [&] { o.help = true; }},
          {"-h", [&] { o.help = true; }}},
         {{"--filter", [&](const std::string &v) { o.filter = v; }},
          {"--threads", [&](const std::string &v) {
               o.threads.clear();
               o.threads_given = true;
               size_t pos = 0;
               while (pos <= v.size()) {
                   const size_t end = std::min(v.find(',', pos), v.size());
                   o.threads.push_back(static_cast<int>(parse_int("--threads", v.substr(pos, end - pos), 1, 1024)));
                   pos = end + 1;
               }
           }}});
    return o;
}

TuneOptions parse_tune_args(const std::vector<std::string> &args) {
    TuneOptions o;
    walk(args,
         {{"--quick", [&] { o.quick = true; }},
          {"--list", [&] { o.list = true; }},
          {"--help", [&] { o.help = true; }},
          {"-h", [&] { o.help = true; }}},
         {{"--out", [&](const std::string &v) { o.out = v; }},
          {"--csv", [&](const std::string &v) { o.csv = v; }},
          {"--threads", [&](const std::string &v) { o.threads = static_cast<int>(parse_int("--threads", v, 1, 1024)); }},
          {"--max-candidates",
           [&](const std::string &v) { o.max_candidates = static_cast<int>(parse_int("--max-candidates", v, 1, 1000000)); }}});
    if (o.list && !(o.out.empty() && o.csv.empty())) throw UsageError("--list measures nothing: it takes no --out or --csv");
    return o;
}

} // namespace mha::cli
