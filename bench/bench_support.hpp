// What the Google Benchmark suites and mha-bench share: the shapes (defined once), the machine's
// measured peaks, the anchors (oneDNN, OpenBLAS) and a timer.
#pragma once

#include <cstdint>
#include <cstdio>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "mha/isa.hpp"
#include "mha/tile_config.hpp"

namespace mha::bench {

struct GemmShape {
    const char *label;  // what the shape stands for
    char ta, tb;
    int64_t m, n, k;
    bool quick;         // part of the --quick run
    bool packed_b = false;  // B packed once (mha::SgemmPackedB) before the timed calls, a weight's way
    double flops() const { return 2.0 * static_cast<double>(m) * static_cast<double>(n) * static_cast<double>(k); }
    std::string str() const;  // "1024x1024x1024 NT"
};

// The GEMM shapes of bench_gemm.cpp and the mha-bench gemm suite.
const std::vector<GemmShape> &gemm_shapes();

struct SoftmaxShape {
    int64_t rows, cols;
    bool quick;
    double elems() const { return static_cast<double>(rows) * static_cast<double>(cols); }
    std::string str() const;  // "512x512"
};

// The softmax shapes of bench_softmax.cpp and the mha-bench softmax suite.
const std::vector<SoftmaxShape> &softmax_shapes();

// The plain loop users would write: max, expf, sum, divide, one row at a time (one thread).
void scalar_softmax(int64_t rows, int64_t cols, const float *x, float *y);

// oneDNN's softmax primitive on a rows x cols row-major buffer for `threads` OpenMP threads,
// created once; run() executes it on that many. (A oneDNN primitive fixes its thread count when it
// is created and asks OpenMP for exactly that many, whatever omp_set_num_threads says later: one
// created while OpenMP's default was 2 ran on 2 threads in a 1-thread row.)
class DnnlSoftmax {
public:
    DnnlSoftmax(int64_t rows, int64_t cols, const float *x, float *y, int threads);
    ~DnnlSoftmax();
    void run();

private:
    struct Impl;
    Impl *impl_ = nullptr;
};

struct AttentionShape {
    int64_t batch, len, heads, dim;
    bool causal, quick;
    double flops() const { return 4.0 * static_cast<double>(len) * static_cast<double>(len) * static_cast<double>(dim) * static_cast<double>(heads) * static_cast<double>(batch); }
    std::string str() const;  // "L2048 H8 D64 causal"
};
// The attention shapes of bench_attention.cpp and the mha-bench attention suite (self-attention,
// Lq = Lk = len, batch 1). GFLOP/s always counts the nominal 4 L^2 D H, causal or not.
const std::vector<AttentionShape> &attention_shapes();

struct DecodeShape {
    int64_t batch, kv_len, heads, kv_heads, dim;
    bool quick;
    double kv_bytes() const { return 2.0 * 4.0 * static_cast<double>(batch * kv_len * kv_heads * dim); }
    std::string str() const;  // "B4 Lk4096 H32/8 D128"
};
const std::vector<DecodeShape> &decode_shapes();

// The serving suite of mha-bench (ragged prefill, decode and a continuous batch through the KV
// cache). The prompt mix: 8 lengths drawn log-uniformly from [64, 2048] by a fixed seed
// (splitmix64), then the shortest set to 64 and the longest to 2048 so the mix spans the range:
// 244, 789, 126, 2048, 869, 304, 533, 64 (4977 tokens).
const std::vector<int64_t> &serving_prompt_lens();

// The heads of a serving row: H query heads over Hkv KV heads of dimension D (= Dv).
struct ServingHeads {
    int64_t heads, kv_heads, dim;
    bool quick;
    std::string str() const;  // "H32/8 D128", or "H8 D64" when Hkv = H
};
// The ragged prefill's shapes: H8 D64 (in --quick) and H32/8 D128.
const std::vector<ServingHeads> &serving_prefill_heads();

// A continuous-batching step: `prefills` sequences each prefilling a chunk of `chunk` new tokens
// over `prefill_cached` tokens already cached, beside `decodes` sequences decoding one token each
// with `decode_cached` tokens cached (the new one included).
struct ContinuousShape {
    int64_t prefills, chunk, prefill_cached, decodes, decode_cached;
    ServingHeads heads;
    std::string str() const;  // "2x512@1024+30x1@2048 H32/8 D128"
    int64_t new_tokens() const { return prefills * chunk + decodes; }
    int64_t cached_tokens() const { return prefills * (prefill_cached + chunk) + decodes * decode_cached; }
};
const ContinuousShape &serving_continuous_shape();

// (query, key) pairs that causal attention computes for `q` queries that are the last of `kv`
// positions (bottom-right): sum over i < q of kv - q + i + 1. A prompt of L: L (L + 1) / 2.
double causal_pairs(int64_t q, int64_t kv);

// Fills x[0, n) with values in [-scale, scale) from a fixed hash of (seed, index): the same on
// every machine, and varied enough that no kernel path sees a degenerate input.
void fill_hashed(float *x, size_t n, uint64_t seed, float scale);

struct LayerShape {
    int64_t batch, len, embed, heads;
    bool quick;
    std::string str() const;        // "B8 L128 E512 H8"
    std::string torch_str() const;  // "B8,L128,E512,H8", as bench/torch_layer.py takes it
    // Projections (4 of E x E) and attention (4 L^2 E), self-attention.
    double flops() const;
};
// The layer shapes of bench_layer.cpp and the mha-bench layer suite (self-attention).
const std::vector<LayerShape> &layer_shapes();

// The layer composed from oneDNN pieces the way PyTorch composes it: Q, K and V by dnnl_sgemm with
// W^T plus a bias loop, the blocked dnnl_attention, the output projection likewise. w_in is
// in_proj_weight [3E, E], b_in [3E], w_out [E, E], b_out [E]; x and out are [B, L, E].
// scratch and scores are the caller's buffers, grown as needed.
void dnnl_layer(int threads, const LayerShape &s, const float *x, const float *w_in, const float *b_in,
                const float *w_out, const float *b_out, float *out, std::vector<float> &scratch,
                std::vector<float> &scores);

// Median ms of PyTorch's nn.MultiheadAttention for each shape, on `threads` threads, from
// bench/torch_layer.py run by /usr/bin/python3 (MHA_TORCH_SCRIPT overrides the script's path).
// Empty, with *why set, if PyTorch or the script is not available.
std::vector<double> torch_layer_ms(int threads, const std::vector<LayerShape> &shapes, double budget_s,
                                   std::string *why);

// The encoder suite of mha-bench: nn.TransformerEncoderLayer(E, H, dim_feedforward = F,
// batch_first=True) in eval mode, post-norm and relu, on `batch` sequences of `len` tokens.
struct EncoderShape {
    int64_t batch, len, embed, heads, ffn;
    bool quick;
    std::string str() const;        // "B8 L128 E512 H8 F2048"
    std::string torch_str() const;  // "B8,L128,E512,H8,F2048", as bench/torch_encoder.py takes it
    LayerShape attention() const { return {batch, len, embed, heads, quick}; }
    // The GEMMs and the attention per sequence: 8 L E^2 (Q, K, V and the output projection),
    // 4 L E F (linear1 and linear2), 4 L^2 E (Q K^T and P V). Bias, activation, softmax and
    // LayerNorm are not counted.
    double flops() const;
};
// B8 L128 (in --quick) and B1 L2048, E 512, H 8, F 2048.
const std::vector<EncoderShape> &encoder_shapes();

// One encoder layer's weights in PyTorch's layout (see mha::EncoderWeights): in_proj [3E, E] and
// [3E], out_proj [E, E] and [E], linear1 [F, E] and [F], linear2 [E, F] and [E], norm1 and norm2
// weight and bias [E]. Every pointer non-NULL.
struct EncoderTensors {
    const float *w_in, *b_in, *w_out, *b_out, *w1, *b1, *w2, *b2, *norm1_w, *norm1_b, *norm2_w, *norm2_b;
};
// Buffers of dnnl_encoder_layer, grown as needed.
struct DnnlEncoderScratch {
    std::vector<float> attn, y, h, normed, layer, scores;
};
// The encoder layer composed from oneDNN pieces, as a user without a fused layer would: the
// attention by dnnl_layer (dnnl_sgemm projections, blocked dnnl_attention), linear1 and linear2 by
// dnnl_sgemm, and plain loops (OpenMP over rows, `threads` of them) for the biases, the activation,
// the residual adds and LayerNorm (two passes over each row). x and out [B, L, E] (x != out).
void dnnl_encoder_layer(int threads, const EncoderShape &s, bool gelu, bool norm_first, float eps, const float *x,
                        const EncoderTensors &w, float *out, DnnlEncoderScratch &scratch);

// A PyTorch anchor in a child process: bench/<script> --serve (torch_layer.py: nn.MultiheadAttention,
// torch_encoder.py: nn.TransformerEncoderLayer) run by /usr/bin/python3 on `threads` threads
// (OMP_NUM_THREADS, OPENBLAS_NUM_THREADS and MKL_NUM_THREADS set in its environment before torch
// loads; env_override names a variable that may give the script's path), holding one module per
// shape (torch_str()), so that its runs can be interleaved with ours: run() runs one forward pass
// there and returns PyTorch's own wall and CPU time of it (the child's whole process: every thread
// its libraries start), so the caller can check that it ran on the threads it was given.
class TorchAnchor {
public:
    struct Timing {
        double ms = 0, cpu_ms = 0;
    };
    TorchAnchor(const char *script, const char *env_override, int threads, const std::vector<std::string> &shapes);
    ~TorchAnchor();
    TorchAnchor(const TorchAnchor &) = delete;
    TorchAnchor &operator=(const TorchAnchor &) = delete;
    bool ok() const { return ok_; }
    const std::string &why() const { return why_; }  // when not ok(): why not
    const std::string &version() const { return version_; }
    bool fast_path(const std::string &shape) const;  // encoder: did the profiler see torch._transformer_encoder_layer_fwd
    Timing run(const std::string &shape);            // throws std::runtime_error if the child has gone

private:
    bool ok_ = false;
    std::string why_, version_;
    std::map<std::string, bool> fast_;  // torch_str() -> fast path
    int pid_ = -1;
    FILE *to_ = nullptr, *from_ = nullptr;
};

// Unfused attention built on dnnl_sgemm, one (batch, head) at a time, as PyTorch composes it:
// S = Q K^T * scale, a row softmax (mha's, so the anchor is not held back by its softmax), O = P V.
// block_rows = 0 materializes the full Lq x Lk scores; otherwise block_rows query rows at a time,
// and causal rows multiply only the keys up to their diagonal. Layouts as mha::attention's.
void dnnl_attention(int threads, int64_t block_rows, int64_t batch, int64_t len, int64_t heads, int64_t dim,
                    bool causal, const float *q, const float *k, const float *v, float *out, std::vector<float> &scores);

// Peak fp32 FMA GFLOP/s of `threads` threads running the probe at once with the widest ISA the
// CPU has (the median of several short runs; about 0.3 s).
double measure_fma_peak_gflops(int threads);

// One short run of that probe (about 2 ms): what `threads` threads deliver right now. Benchmarks
// interleave it with the code they time, so a share of the peak compares the two in the same
// window on a machine whose other tenants come and go.
double fma_probe_gflops(int threads);

// The k-loop ceiling of the microkernel named `kernel` of `isa` (see k_loop_gflops_probe in
// peak_kernel.hpp): `reps` passes over a depth of kc, A read as MR floats a step and B as NR (a
// packed panel of each), on this thread; GFLOP/s, or 0 for a kernel the list does not have.
double k_loop_gflops(Isa isa, const char *kernel, int64_t reps, int64_t kc, const float *a, const float *b);

// Read bandwidth in GB/s of `threads` threads each streaming its share of a buffer far larger than
// the caches (the median of several passes).
double measure_read_bandwidth_gbs(int threads);

// One such pass (256 MiB; about 25 ms on one thread here), for benchmarks to interleave with the
// memory-bound code they time, as fma_probe_gflops is for the compute-bound.
double read_probe_gbs(int threads);

// Must run first in main(): sets OPENBLAS_CORETYPE=SkylakeX, or Haswell without AVX-512 (Debian's OpenBLAS misdetects this
// CPU and runs about 6x slower), and stops idle OpenBLAS/OpenMP threads from spinning between
// calls (OPENBLAS_THREAD_TIMEOUT=4, OMP_WAIT_POLICY=PASSIVE), unless the environment sets them;
// then re-executes the program so the libraries see them when they load.
void ensure_anchor_environment(char **argv);
// The anchor settings in force, "NAME=value ...", for the report.
std::string anchor_environment();

// The machine a report was measured on: cpuid's vendor, family and model (in decimal, as lscpu
// prints them: AMD family 25 (0x19) is Zen 3 and 4, 26 (0x1A) Zen 5; a virtual machine may report
// other values than its host's: the AMX Xeon of docs/performance-history.md reads family 6 model
// 167), the model name, the caches the defaults are derived from, and the hardware threads.
struct Machine {
    std::string cpu, vendor;
    int family = 0, model = 0;
    CacheSizes caches;
    unsigned hardware_threads = 0;
};
Machine machine();

// The anchors, each run on `threads` threads. has_*() says whether it was compiled in.
bool has_dnnl();
bool has_openblas();
void dnnl_sgemm(int threads, char ta, char tb, int64_t m, int64_t n, int64_t k, float alpha, const float *a,
                int64_t lda, const float *b, int64_t ldb, float beta, float *c, int64_t ldc);
void openblas_sgemm(int threads, char ta, char tb, int64_t m, int64_t n, int64_t k, float alpha,
                    const float *a, int64_t lda, const float *b, int64_t ldb, float beta, float *c, int64_t ldc);

// Median seconds of each function, timed in turn (a, b, c, a, b, c, ...) so that noise from other
// tenants of the machine falls on all of them alike; about `budget_s` seconds in all. With
// cpu_per_wall, also each function's process CPU time over its wall time, summed over its timed
// runs: how many threads it kept busy (an anchor whose library ignores the thread count it was
// given shows here). With `before`, it runs (untimed) ahead of every timed call: the state a call
// meets (mha-tune's threads phase: the calling thread busy a while, so the arena's workers sleep).
std::vector<double> time_interleaved(const std::vector<std::function<void()>> &fns, double budget_s, int min_reps = 3,
                                     std::vector<double> *cpu_per_wall = nullptr,
                                     const std::function<void()> &before = nullptr);

// Median seconds of `fn` over repetitions after a warm-up, running for about `budget_s` seconds.
double time_median(const std::function<void()> &fn, double budget_s, int min_reps = 3);

// The same, with `before` run (untimed) ahead of every timed run of `fn`: a step timed in the
// state the step before it leaves the caches in (the layer's attention right after the QKV
// projection wrote its input).
double time_median_after(const std::function<void()> &before, const std::function<void()> &fn, double budget_s,
                         int min_reps = 3);

} // namespace mha::bench
