// The command lines of mha-run, mha-bench and mha-tune, parsed apart from the tools so that the
// tests can check every flag. Every parser throws UsageError with a message naming the flag.
#pragma once

#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace mha::cli {

class UsageError : public std::runtime_error {
public:
    using std::runtime_error::runtime_error;
};

struct RunOptions {
    std::string weights;          // --weights: a directory of .npy files or a .safetensors file
    std::string prefix;           // --prefix: key prefix inside a .safetensors file
    int64_t num_heads = 0;        // --num-heads (required)
    std::string query, key, value;  // --query (required), --key, --value (both or neither)
    std::string key_padding_mask, attn_mask;  // --key-padding-mask, --attn-mask
    bool causal = false;          // --causal
    std::string out;              // --out
    std::string attn_weights;     // --attn-weights
    bool average_attn_weights = false;  // --average-attn-weights
    int threads = 1;              // --threads (0 = all hardware threads)
    int repeat = 1;               // --repeat
    bool json = false;            // --json
    bool help = false;            // --help / -h
    // Generation through a KV cache (causal self-attention): prefill the query, then feed each
    // sequence's last output row back `generate` times, one decode step each.
    int64_t generate = 0;         // --generate N (0: a plain forward pass)
    int64_t prefill_chunk = 0;    // --prefill-chunk N: prefill N tokens per call (0: the whole query at once)
    bool check_invariance = false;  // --check-invariance: compare every row with the full causal forward
    // An nn.TransformerEncoderLayer (1) or nn.TransformerEncoder (N layers) from its state_dict.
    int64_t encoder_layers = 0;   // --encoder-layers N (0: an nn.MultiheadAttention layer)
    int64_t ffn_dim = 0;          // --ffn-dim F (0: taken from linear1.weight's shape)
    std::string activation = "relu";  // --activation relu|gelu
    bool norm_first = false;      // --norm-first: pre-norm (PyTorch's norm_first=True)
    float norm_eps = 1e-5f;       // --norm-eps E: layer_norm_eps
    // The layer's heads sharded across the ranks of MPI_COMM_WORLD (run under mpirun; -Dmpi builds).
    bool tp = false;              // --tp
    // The attention of today's decoders (mha_attention_variant, mha_rope).
    int64_t window = 0;           // --window W: a query sees the W latest positions up to its own
    float softcap = 0.0f;         // --softcap C: s = C tanh(s / C)
    bool alibi = false;           // --alibi: ALiBi's standard slopes for H heads
    std::string sinks;            // --sinks s.npy: [H] sink logits (default: the state_dict's sinks, if any)
    int64_t rope_dims = 0;        // --rope-dims N: rotate the first N dims of q and k heads
    float rope_theta = 0.0f;      // --rope-theta T (default 10000)
    bool rope_interleaved = false;  // --rope-interleaved: adjacent pairs (GPT-J) instead of rotate_half
    std::string kv_dtype = "f32"; // --kv-dtype f32|bf16|i8: the KV cache's storage with --generate
};
RunOptions parse_run_args(const std::vector<std::string> &args);
extern const char *const kRunUsage;

struct BenchOptions {
    bool quick = false, json = false, help = false;
    bool mpi = false;             // --mpi: the mpi suite alone (implied when mpirun started mha-bench)
    std::vector<int> threads = {1, 2};
    bool threads_given = false;   // --threads was on the command line (the mpi suite's default is 1)
    std::string filter;
};
BenchOptions parse_bench_args(const std::vector<std::string> &args);
extern const char *const kBenchUsage;

struct TuneOptions {
    bool quick = false, help = false;
    bool list = false;            // print the candidates each search would measure, and measure none
    std::string out, csv;
    int threads = 1;
    int max_candidates = 0;       // 0 = no limit (the tests use a few)
};
TuneOptions parse_tune_args(const std::vector<std::string> &args);
extern const char *const kTuneUsage;

// argv[1..argc) as strings.
std::vector<std::string> args_of(int argc, char **argv);

} // namespace mha::cli
