// mha-run: runs a PyTorch nn.MultiheadAttention(batch_first=True) layer's weights on .npy tensors,
// or with --encoder-layers an nn.TransformerEncoderLayer / nn.TransformerEncoder from its state_dict.
// Every input is read and checked before the layer runs; outputs are written only when everything
// succeeded, each through a temporary file, so a failure leaves no output behind. With --generate
// it runs the layer as a server would, through a KV cache: a (chunked) prefill, then decode steps
// that feed each sequence's last output row back, and --check-invariance compares every row with
// one causal forward pass over the whole sequence, bit for bit.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "cli_args.hpp"
#include "io/npy.hpp"
#include "io/torch_mha.hpp"
#include "mha/encoder.hpp"
#include "mha/layer.hpp"
#include "mha/serving.hpp"
#ifdef MHA_WITH_MPI
#include "mha/tp_layer.hpp"
#endif

using namespace mha;

namespace {

struct Inputs {
    int64_t B = 0, Lq = 0, Lk = 0;
    std::vector<float> query, key, value;
    io::Mask mask;
};

Inputs read_inputs(const cli::RunOptions &o, int64_t E, int64_t kdim, int64_t vdim) {
    Inputs in;
    const io::Array q = io::read_npy(o.query);
    if (q.shape.size() != 3) throw io::FileError(o.query + ": expected shape [B, Lq, " + std::to_string(E) + "], found " + q.shape_str());
    in.B = q.shape[0];
    in.Lq = q.shape[1];
    in.query = io::to_floats(o.query, q, {-1, -1, E});
    if (o.key.empty()) {
        if (kdim != E || vdim != E)
            throw io::FileError(o.weights + ": the weights take keys of width " + std::to_string(kdim) + " and values of width " +
                                std::to_string(vdim) + ", so --key and --value are needed");
        in.Lk = in.Lq;
    } else {
        const io::Array k = io::read_npy(o.key);
        if (k.shape.size() != 3) throw io::FileError(o.key + ": expected shape [B, Lk, kdim], found " + k.shape_str());
        in.Lk = k.shape[1];
        in.key = io::to_floats(o.key, k, {in.B, in.Lk, kdim});
        in.value = io::to_floats(o.value, io::read_npy(o.value), {in.B, in.Lk, vdim});
    }
    std::vector<uint8_t> kpm, am;
    if (!o.key_padding_mask.empty()) kpm = io::to_bools(o.key_padding_mask, io::read_npy(o.key_padding_mask), {in.B, in.Lk});
    if (!o.attn_mask.empty()) am = io::to_bools(o.attn_mask, io::read_npy(o.attn_mask), {in.Lq, in.Lk});
    in.mask = io::from_torch_masks(in.B, in.Lq, in.Lk, kpm, am);
    return in;
}

// ALiBi's slopes (Press et al. 2022): 2^(-8h/H) for h = 1..H when H is a power of two; otherwise
// those of the largest power of two n below H, then every other slope of 2n for the rest.
std::vector<float> alibi_slopes(int64_t H) {
    auto pow2_slopes = [](int64_t n) {
        std::vector<double> s;
        for (int64_t h = 1; h <= n; ++h) s.push_back(std::exp2(-8.0 * static_cast<double>(h) / static_cast<double>(n)));
        return s;
    };
    int64_t n = 1;
    while (n * 2 <= H) n *= 2;
    std::vector<double> s = pow2_slopes(n);
    const std::vector<double> extra = pow2_slopes(2 * n);
    for (int64_t i = 0; static_cast<int64_t>(s.size()) < H; i += 2) s.push_back(extra[static_cast<size_t>(i)]);
    return std::vector<float>(s.begin(), s.end());
}

double ms_since(std::chrono::steady_clock::time_point t0) {
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

// --generate: B sequences (the query's batch) through a KV cache. Prefill their Lq prompt rows
// (in chunks of --prefill-chunk), then N decode steps, each feeding every sequence's last output
// row back as its next input, all B sequences in one forward_cached call per step.
int run_generate(const cli::RunOptions &o, Runtime &rt, const Layer &layer, const Inputs &in) {
    const LayerConfig &c = layer.config();
    const int64_t B = in.B, Lq = in.Lq, N = o.generate, L = Lq + N, E = c.embed_dim;
    const int64_t chunk = o.prefill_chunk ? std::min(o.prefill_chunk, Lq) : Lq;
    KVCacheConfig cc;
    cc.num_kv_heads = c.num_kv_heads;
    cc.head_dim = c.head_dim;
    cc.value_dim = c.value_dim;
    cc.dtype = o.kv_dtype == "i8" ? DType::i8 : o.kv_dtype == "bf16" ? DType::bf16 : DType::f32;
    // A block holds at most attn_block_k tokens, so this many per sequence always fits.
    const int64_t bk = std::max<int64_t>(rt.tiles().attn_block_k, 1);
    cc.max_tokens = B * ((L + bk - 1) / bk * bk);
    KVCache cache(rt, cc);

    // x and y per sequence, [B, L, E]: the inputs (prompt, then the fed-back rows) and the outputs.
    const auto row = [&](std::vector<float> &t, int64_t b, int64_t i) { return t.data() + (b * L + i) * E; };
    std::vector<float> x(static_cast<size_t>(B * L * E)), y(x.size());
    for (int64_t b = 0; b < B; ++b) std::copy_n(in.query.data() + b * Lq * E, Lq * E, row(x, b, 0));
    std::vector<int64_t> ids(static_cast<size_t>(B)), offsets(static_cast<size_t>(B + 1));
    for (int64_t b = 0; b < B; ++b) ids[static_cast<size_t>(b)] = b;
    std::vector<float> xs, ys;
    // One forward_cached call on positions [i0, i0 + n) of every sequence.
    auto step = [&](int64_t i0, int64_t n) {
        xs.resize(static_cast<size_t>(B * n * E));
        ys.resize(xs.size());
        for (int64_t b = 0; b < B; ++b) {
            std::copy_n(row(x, b, i0), n * E, xs.data() + b * n * E);
            offsets[static_cast<size_t>(b + 1)] = (b + 1) * n;
        }
        LayerCachedForward p;
        p.num_seqs = B;
        p.seq_ids = ids.data();
        p.q_offsets = offsets.data();
        p.causal = true;
        layer.forward_cached(rt, cache, p, xs.data(), ys.data());
        for (int64_t b = 0; b < B; ++b) std::copy_n(ys.data() + b * n * E, n * E, row(y, b, i0));
    };

    auto t0 = std::chrono::steady_clock::now();
    int64_t prefill_calls = 0;
    for (int64_t i0 = 0; i0 < Lq; i0 += chunk, ++prefill_calls) step(i0, std::min(chunk, Lq - i0));
    const double prefill_ms = ms_since(t0);
    std::vector<double> step_ms;
    for (int64_t i = Lq; i < L; ++i) {
        for (int64_t b = 0; b < B; ++b) std::copy_n(row(y, b, i - 1), E, row(x, b, i));
        t0 = std::chrono::steady_clock::now();
        step(i, 1);
        step_ms.push_back(ms_since(t0));
    }
    double decode_ms = 0;
    for (double m : step_ms) decode_ms += m;
    std::vector<double> sorted = step_ms;
    std::sort(sorted.begin(), sorted.end());
    const double median_step = sorted[sorted.size() / 2];
    const double tokens_per_s = static_cast<double>(B * N) / (decode_ms * 1e-3);
    const double prefill_tokens_per_s = static_cast<double>(B * Lq) / (prefill_ms * 1e-3);

    // The full causal forward over every sequence's whole input, compared row by row.
    int64_t differing = 0, first_b = -1, first_i = -1;
    double worst = 0;
    if (o.check_invariance) {
        std::vector<float> full(y.size());
        LayerForward p;
        p.batch = B;
        p.q_len = p.kv_len = L;
        p.causal = true;
        layer.forward(rt, p, x.data(), nullptr, nullptr, full.data());
        for (int64_t b = 0; b < B; ++b)
            for (int64_t i = 0; i < L; ++i) {
                const float *g = row(y, b, i), *w = row(full, b, i);
                if (std::memcmp(g, w, static_cast<size_t>(E) * sizeof(float)) == 0) continue;
                if (differing++ == 0) {
                    first_b = b;
                    first_i = i;
                }
                for (int64_t e = 0; e < E; ++e)
                    worst = std::max(worst, std::abs(static_cast<double>(g[e]) - static_cast<double>(w[e])));
            }
    }

    if (!o.out.empty()) io::write_npy(o.out, {B, L, E}, y.data());
    if (o.json) {
        nlohmann::json j = {{"mode", "generate"}, {"kv_dtype", o.kv_dtype}, {"batch", B}, {"prompt_len", Lq}, {"generated", N},
                            {"prefill_chunk", chunk}, {"prefill_calls", prefill_calls}, {"prefill_ms", prefill_ms},
                            {"prefill_tokens_per_s", prefill_tokens_per_s}, {"decode_ms", decode_ms},
                            {"step_ms", step_ms}, {"median_step_ms", median_step}, {"tokens_per_s", tokens_per_s},
                            {"threads", rt.num_threads()}, {"embed_dim", E}, {"num_heads", c.num_heads},
                            {"cache_bytes", cache.bytes()}, {"isa", std::string(isa_name(rt.isa()))}};
        if (o.check_invariance)
            j["invariance"] = {{"identical", differing == 0}, {"rows", B * L}, {"differing_rows", differing},
                               {"max_abs_diff", worst}};
        std::printf("%s\n", j.dump().c_str());
    } else {
        std::printf("mha-run: generate: B %ld, prompt %ld, %ld steps, E %ld, H %ld on %d thread%s\n", static_cast<long>(B),
                    static_cast<long>(Lq), static_cast<long>(N), static_cast<long>(E), static_cast<long>(c.num_heads),
                    rt.num_threads(), rt.num_threads() > 1 ? "s" : "");
        std::printf("prefill: %ld tokens in %ld call%s, %.3f ms (%.0f tokens/s)\n", static_cast<long>(B * Lq),
                    static_cast<long>(prefill_calls), prefill_calls > 1 ? "s" : "", prefill_ms, prefill_tokens_per_s);
        std::printf("decode: %ld tokens in %ld steps, %.3f ms, median step %.3f ms: %.1f tokens/s\n",
                    static_cast<long>(B * N), static_cast<long>(N), decode_ms, median_step, tokens_per_s);
        if (o.check_invariance) {
            if (differing == 0)
                std::printf("invariance: all %ld rows (%ld sequence%s x (%ld prompt + %ld generated)) are bitwise identical "
                            "to the full causal forward\n",
                            static_cast<long>(B * L), static_cast<long>(B), B > 1 ? "s" : "", static_cast<long>(Lq),
                            static_cast<long>(N));
            else
                std::printf("invariance: FAILED: %ld of %ld rows differ from the full causal forward (first: sequence %ld, "
                            "position %ld; max |difference| %.3g)\n",
                            static_cast<long>(differing), static_cast<long>(B * L), static_cast<long>(first_b),
                            static_cast<long>(first_i), worst);
        }
    }
    return differing == 0 ? 0 : 3;
}

// Today's decoders: window, soft-cap, ALiBi, sinks (given, or the state_dict's), RoPE, from the
// command line; the arrays live here until the layer (which copies them) is built.
struct AttentionFlags {
    const cli::RunOptions &o;
    std::vector<float> slopes, sinks;
    LayerConfig apply(LayerConfig c) const {
        c.variant = AttentionVariant{o.window, o.softcap, slopes.empty() ? nullptr : slopes.data(),
                                     sinks.empty() ? nullptr : sinks.data()};
        c.rope.dims = o.rope_dims;
        c.rope.theta = o.rope_theta;
        c.rope.interleaved = o.rope_interleaved;
        return c;
    }
};

AttentionFlags read_attention_flags(const cli::RunOptions &o) {
    AttentionFlags f{o, {}, {}};
    const int64_t H = o.num_heads;
    if (o.alibi) f.slopes = alibi_slopes(H);
    if (!o.sinks.empty()) {
        f.sinks = io::to_floats(o.sinks, io::read_npy(o.sinks), {H});
    } else {
        const io::StateDict sd(o.weights, o.prefix);
        for (const char *key : {"sinks", "self_attn.sinks"})
            if (sd.has(key)) {
                f.sinks = sd.floats(key, {H});
                break;
            }
    }
    return f;
}

// --out and --attn-weights (per head, or averaged over the heads as PyTorch's
// average_attn_weights=True).
void write_outputs(const cli::RunOptions &o, const Inputs &in, int64_t E, const std::vector<float> &out,
                   const std::vector<float> &weights) {
    if (!o.out.empty()) io::write_npy(o.out, {in.B, in.Lq, E}, out.data());
    if (!o.attn_weights.empty()) {
        if (o.average_attn_weights) {
            const int64_t H = o.num_heads, per = in.Lq * in.Lk;
            std::vector<float> avg(static_cast<size_t>(in.B * per));
            for (int64_t b = 0; b < in.B; ++b)
                for (int64_t x = 0; x < per; ++x) {
                    double s = 0;
                    for (int64_t h = 0; h < H; ++h) s += weights[static_cast<size_t>((b * H + h) * per + x)];
                    avg[static_cast<size_t>(b * per + x)] = static_cast<float>(s / static_cast<double>(H));
                }
            io::write_npy(o.attn_weights, {in.B, in.Lq, in.Lk}, avg.data());
        } else {
            io::write_npy(o.attn_weights, {in.B, o.num_heads, in.Lq, in.Lk}, weights.data());
        }
    }
}

// The forward parameters of a self- or cross-attention call on these inputs, with their masks.
LayerForward forward_params(const Inputs &in, bool causal) {
    LayerForward p;
    p.batch = in.B;
    p.q_len = in.Lq;
    p.kv_len = in.Lk;
    p.causal = causal;
    if (!in.mask.allowed.empty()) {
        p.mask = in.mask.allowed.data();
        p.mask_batch_stride = in.mask.batch_stride;
        p.mask_row_stride = in.mask.row_stride;
    }
    return p;
}

// --encoder-layers N: the layers of an nn.TransformerEncoder (or one nn.TransformerEncoderLayer),
// each an mha::EncoderLayer built once, applied in order: layer 0 reads the query, the others
// rewrite the output in place; then the stack's final norm, if its state_dict has one.
int run_encoder(const cli::RunOptions &o) {
    io::EncoderOptions eo;
    eo.num_layers = o.encoder_layers;
    eo.num_heads = o.num_heads;
    eo.ffn_dim = o.ffn_dim;
    eo.activation = o.activation == "gelu" ? Activation::gelu : Activation::relu;
    eo.norm_first = o.norm_first;
    eo.norm_eps = o.norm_eps;
    const io::EncoderStackWeights w = io::load_encoder_weights(io::StateDict(o.weights, o.prefix), eo);
    const int64_t E = w.config.attention.embed_dim, N = static_cast<int64_t>(w.layers.size());
    if (E % o.num_heads != 0)
        throw cli::UsageError("--num-heads " + std::to_string(o.num_heads) + " does not divide embed_dim " + std::to_string(E));
    const Inputs in = read_inputs(o, E, E, E);

    Runtime rt(RuntimeOptions{o.threads, {}, {}, {}});
    std::vector<std::unique_ptr<EncoderLayer>> layers;
    for (int64_t i = 0; i < N; ++i) layers.push_back(std::make_unique<EncoderLayer>(rt, w.config, w.view(static_cast<size_t>(i))));
    const bool final_norm = !w.final_norm_weight.empty();
    const LayerForward p = forward_params(in, o.causal);
    std::vector<float> out(static_cast<size_t>(in.B * in.Lq * E));
    std::vector<double> ms;
    for (int r = 0; r < o.repeat; ++r) {
        const auto t0 = std::chrono::steady_clock::now();
        layers[0]->forward(rt, p, in.query.data(), out.data());
        for (int64_t i = 1; i < N; ++i) layers[static_cast<size_t>(i)]->forward(rt, p, out.data(), out.data());
        if (final_norm)
            io::layer_norm_rows(out.data(), in.B * in.Lq, E, w.final_norm_weight.data(),
                                w.final_norm_bias.empty() ? nullptr : w.final_norm_bias.data(), o.norm_eps);
        ms.push_back(ms_since(t0));
        if (o.repeat > 1 && !o.json) std::printf("run %d: %.3f ms\n", r + 1, ms.back());
    }
    if (!o.out.empty()) io::write_npy(o.out, {in.B, in.Lq, E}, out.data());

    std::vector<double> sorted = ms;
    std::sort(sorted.begin(), sorted.end());
    const double best = sorted.front(), median = sorted[sorted.size() / 2];
    double flops = 0;
    for (const auto &l : layers) flops += l->flops(p);
    const double gflops = flops / (best * 1e-3) * 1e-9;
    const int64_t F = w.config.ffn_dim;
    if (o.json) {
        char eps_text[32];  // the float's shortest decimal form: 1e-05, not 9.99999974738e-06
        std::snprintf(eps_text, sizeof eps_text, "%.9g", static_cast<double>(o.norm_eps));
        for (int digits = 1; digits < 9; ++digits) {
            char t[32];
            std::snprintf(t, sizeof t, "%.*g", digits, static_cast<double>(o.norm_eps));
            if (std::strtof(t, nullptr) == o.norm_eps) {
                std::snprintf(eps_text, sizeof eps_text, "%s", t);
                break;
            }
        }
        nlohmann::json j = {{"mode", "encoder"}, {"best_ms", best}, {"median_ms", median}, {"gflops", gflops},
                            {"threads", rt.num_threads()}, {"runs_ms", ms}, {"batch", in.B}, {"q_len", in.Lq},
                            {"kv_len", in.Lk}, {"embed_dim", E}, {"num_heads", o.num_heads}, {"encoder_layers", N},
                            {"ffn_dim", F}, {"activation", o.activation}, {"norm_first", o.norm_first},
                            {"norm_eps", std::stod(eps_text)}, {"final_norm", final_norm}, {"isa", std::string(isa_name(rt.isa()))}};
        std::printf("%s\n", j.dump().c_str());
    } else {
        std::printf("mha-run: encoder of %ld layer%s (E %ld, H %ld, FFN %ld, %s, %s%s), B %ld, L %ld on %d thread%s: "
                    "best %.3f ms, median %.3f ms, %.1f GFLOP/s\n",
                    static_cast<long>(N), N > 1 ? "s" : "", static_cast<long>(E), static_cast<long>(o.num_heads),
                    static_cast<long>(F), o.activation.c_str(), o.norm_first ? "pre-norm" : "post-norm",
                    final_norm ? ", final norm" : "", static_cast<long>(in.B), static_cast<long>(in.Lq), rt.num_threads(),
                    rt.num_threads() > 1 ? "s" : "", best, median, gflops);
    }
    return 0;
}

#ifdef MHA_WITH_MPI
// --tp: the layer's heads sharded across the ranks of MPI_COMM_WORLD. Every rank reads the weights
// and inputs and keeps its heads; the ranks agree that all of them read their files before the
// layer is built (a rank that cannot read them fails every rank instead of leaving them waiting);
// rank 0 alone prints and writes.
int run_tp(const cli::RunOptions &o) {
    int rank = 0, size = 1;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    std::unique_ptr<io::MhaWeights> w;
    Inputs in;
    std::optional<AttentionFlags> flags;
    std::exception_ptr failed;
    try {
        w = std::make_unique<io::MhaWeights>(io::load_mha_weights(io::StateDict(o.weights, o.prefix), o.num_heads));
        const int64_t E = w->config.embed_dim;
        if (E % o.num_heads != 0)
            throw cli::UsageError("--num-heads " + std::to_string(o.num_heads) + " does not divide embed_dim " + std::to_string(E));
        const LayerConfig rc = w->config.resolved();
        in = read_inputs(o, E, rc.kdim, rc.vdim);
        flags.emplace(read_attention_flags(o));
    } catch (...) {
        failed = std::current_exception();
    }
    int any = failed ? 1 : 0;
    MPI_Allreduce(MPI_IN_PLACE, &any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    if (failed) std::rethrow_exception(failed);
    if (any) {
        std::fprintf(stderr, "mha-run: rank %d of %d: another rank could not read its inputs\n", rank, size);
        return 2;
    }
    const LayerConfig c = flags->apply(w->config);
    const int64_t E = c.embed_dim;
    Runtime rt(RuntimeOptions{o.threads, {}, {}, {}});
    TpLayer layer(rt, MPI_COMM_WORLD, c, w->view());
    LayerForward p = forward_params(in, o.causal);
    std::vector<float> out(static_cast<size_t>(in.B * in.Lq * E));
    std::vector<float> weights(o.attn_weights.empty() ? 0 : static_cast<size_t>(in.B * o.num_heads * in.Lq * in.Lk));
    if (!weights.empty()) p.weights = weights.data();
    std::vector<double> ms;
    for (int r = 0; r < o.repeat; ++r) {
        MPI_Barrier(MPI_COMM_WORLD);  // every run starts together, so a run's time is the layer's, not a late start's
        const auto t0 = std::chrono::steady_clock::now();
        layer.forward(rt, p, in.query.data(), in.key.empty() ? nullptr : in.key.data(),
                      in.value.empty() ? nullptr : in.value.data(), out.data());
        ms.push_back(ms_since(t0));
        if (o.repeat > 1 && !o.json && rank == 0) std::printf("run %d: %.3f ms\n", r + 1, ms.back());
        if (r == 0 && o.repeat > 1) layer.reset_timing();  // the first run opens MPI's connections
    }
    const TpTiming t = layer.timing();
    double comm_share = t.seconds > 0 ? t.comm_seconds / t.seconds : 0;
    MPI_Allreduce(MPI_IN_PLACE, &comm_share, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);  // the worst rank's
    if (rank != 0) return 0;

    write_outputs(o, in, E, out, weights);
    std::vector<double> sorted = ms;
    std::sort(sorted.begin(), sorted.end());
    const double best = sorted.front(), median = sorted[sorted.size() / 2];
    const double gflops = layer.flops(p) / (best * 1e-3) * 1e-9;
    if (o.json) {
        nlohmann::json j = {{"mode", "tp"}, {"best_ms", best}, {"median_ms", median}, {"gflops", gflops},
                            {"ranks", size}, {"threads", rt.num_threads()}, {"comm_share", comm_share}, {"runs_ms", ms},
                            {"batch", in.B}, {"q_len", in.Lq}, {"kv_len", in.Lk}, {"embed_dim", E},
                            {"num_heads", o.num_heads}, {"isa", std::string(isa_name(rt.isa()))}};
        std::printf("%s\n", j.dump().c_str());
    } else {
        std::printf("mha-run: B %ld, Lq %ld, Lk %ld, E %ld, H %ld sharded over %d rank%s of %d thread%s: best %.3f ms, "
                    "median %.3f ms, %.1f GFLOP/s, %.1f%% communicating\n",
                    static_cast<long>(in.B), static_cast<long>(in.Lq), static_cast<long>(in.Lk), static_cast<long>(E),
                    static_cast<long>(o.num_heads), size, size > 1 ? "s" : "", rt.num_threads(),
                    rt.num_threads() > 1 ? "s" : "", best, median, gflops, 100 * comm_share);
    }
    return 0;
}
#endif

int run(const cli::RunOptions &o) {
    if (o.tp) {
#ifdef MHA_WITH_MPI
        return run_tp(o);
#else
        throw cli::UsageError("--tp needs an mha-run built with MPI (meson -Dmpi=enabled, OpenMPI's libopenmpi-dev)");
#endif
    }
    if (o.encoder_layers) return run_encoder(o);
    const io::MhaWeights w = io::load_mha_weights(io::StateDict(o.weights, o.prefix), o.num_heads);
    const LayerConfig &c = w.config;
    const int64_t E = c.embed_dim;
    if (E % o.num_heads != 0)
        throw cli::UsageError("--num-heads " + std::to_string(o.num_heads) + " does not divide embed_dim " + std::to_string(E));
    const LayerWeights lw = w.view();
    const LayerConfig rc = c.resolved();
    if (o.generate && (rc.kdim != E || rc.vdim != E))
        throw io::FileError(o.weights + ": --generate needs a self-attention layer (kdim = vdim = E = " + std::to_string(E) +
                            "), but these weights take keys of width " + std::to_string(rc.kdim) + " and values of width " +
                            std::to_string(rc.vdim));
    const Inputs in = read_inputs(o, E, rc.kdim, rc.vdim);

    const AttentionFlags flags = read_attention_flags(o);
    const LayerConfig lc = flags.apply(c);

    Runtime rt(RuntimeOptions{o.threads, {}, {}, {}});
    const Layer layer(rt, lc, lw);
    if (o.generate) return run_generate(o, rt, layer, in);
    LayerForward p = forward_params(in, o.causal);
    std::vector<float> out(static_cast<size_t>(in.B * in.Lq * E));
    std::vector<float> weights(o.attn_weights.empty() ? 0 : static_cast<size_t>(in.B * o.num_heads * in.Lq * in.Lk));
    if (!weights.empty()) p.weights = weights.data();
    std::vector<double> ms;
    for (int r = 0; r < o.repeat; ++r) {
        const auto t0 = std::chrono::steady_clock::now();
        layer.forward(rt, p, in.query.data(), in.key.empty() ? nullptr : in.key.data(),
                      in.value.empty() ? nullptr : in.value.data(), out.data());
        ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
        if (o.repeat > 1 && !o.json) std::printf("run %d: %.3f ms\n", r + 1, ms.back());
    }

    write_outputs(o, in, E, out, weights);

    std::vector<double> sorted = ms;
    std::sort(sorted.begin(), sorted.end());
    const double best = sorted.front(), median = sorted[sorted.size() / 2];
    const double gflops = layer.flops(p) / (best * 1e-3) * 1e-9;
    if (o.json) {
        nlohmann::json j = {{"best_ms", best}, {"median_ms", median}, {"gflops", gflops}, {"threads", rt.num_threads()},
                            {"runs_ms", ms}, {"batch", in.B}, {"q_len", in.Lq}, {"kv_len", in.Lk},
                            {"embed_dim", E}, {"num_heads", o.num_heads}, {"isa", std::string(isa_name(rt.isa()))}};
        std::printf("%s\n", j.dump().c_str());
    } else {
        std::printf("mha-run: B %ld, Lq %ld, Lk %ld, E %ld, H %ld on %d thread%s: best %.3f ms, median %.3f ms, %.1f GFLOP/s\n",
                    static_cast<long>(in.B), static_cast<long>(in.Lq), static_cast<long>(in.Lk), static_cast<long>(E),
                    static_cast<long>(o.num_heads), rt.num_threads(), rt.num_threads() > 1 ? "s" : "", best, median, gflops);
    }
    return 0;
}

} // namespace

namespace {

int run_main(int argc, char **argv) {
    try {
        const cli::RunOptions o = cli::parse_run_args(cli::args_of(argc, argv));
        if (o.help) {
            std::fputs(cli::kRunUsage, stdout);
            return 0;
        }
        return run(o);
    } catch (const cli::UsageError &e) {
        std::fprintf(stderr, "mha-run: %s\n\n%s", e.what(), cli::kRunUsage);
        return 2;
    } catch (const io::FileError &e) {
        std::fprintf(stderr, "mha-run: %s\n", e.what());
        return 2;
    } catch (const Error &e) {
        std::fprintf(stderr, "mha-run: %s\n", e.what());
        return e.status() == Status::invalid_argument || e.status() == Status::unsupported ? 2 : 1;
    } catch (const std::exception &e) {
        std::fprintf(stderr, "mha-run: %s\n", e.what());
        return 1;
    }
}

} // namespace

int main(int argc, char **argv) {
#ifdef MHA_WITH_MPI
    // MPI only for --tp: a plain run never starts it (nor needs mpirun).
    const bool tp = std::any_of(argv + 1, argv + argc, [](const char *a) { return std::strcmp(a, "--tp") == 0; });
    if (tp) MPI_Init(&argc, &argv);
    const int code = run_main(argc, argv);
    if (tp) MPI_Finalize();
    return code;
#else
    return run_main(argc, argv);
#endif
}
