// mha-bench: the benchmark suite for people choosing hardware and settings. Every row is measured
// beside its anchors in the same run and reported against the FMA peak measured at start-up.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <functional>
#include <map>
#include <memory>
#include <regex>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "bench/bench_support.hpp"
#include "bench/encoder_fixture.hpp"
#include "bench/layer_fixture.hpp"
#include "cli_args.hpp"
#include "gemm/transpose_variant.hpp"
#include "mha/attention.hpp"
#include "mha/gemm.hpp"
#include "mha/serving.hpp"
#include "mha/softmax.hpp"
#ifdef MHA_WITH_MPI
#include <chrono>
#include <cmath>
#include <thread>

#include "mha/tp_layer.hpp"
#endif

using namespace mha;

namespace {

struct Context {
    cli::BenchOptions opt;
    std::map<int, double> peak;  // threads -> GFLOP/s
    std::map<int, double> bandwidth;  // threads -> read GB/s
    double budget_s() const { return opt.quick ? 0.25 : 1.0; }
    // What the run was measured on and with: the machine, and the ISA and tiles the runtimes of
    // the run resolve (MHA_ISA, MHA_TILE_CONFIG or the defaults, MHA_PARALLEL_ALWAYS; all but the
    // threads suite's "all threads" runtime, which zeroes the thresholds itself), so reports from
    // different CPUs or configs can be told apart and compared.
    bench::Machine machine;
    Isa isa = Isa::avx2;
    TileConfig tiles;
    std::string tiles_source;  // "defaults" or the MHA_TILE_CONFIG file, "+ MHA_PARALLEL_ALWAYS" if set
};

// Fills ctx's machine, ISA and tiles (a broken MHA_TILE_CONFIG stops the run here, naming it).
void describe_machine(Context &ctx) {
    const Runtime probe(RuntimeOptions{1, {}, {}, {}});
    ctx.isa = probe.isa();
    ctx.tiles = probe.tiles();
    const char *path = std::getenv("MHA_TILE_CONFIG"), *always = std::getenv("MHA_PARALLEL_ALWAYS");
    ctx.tiles_source = path && *path ? path : "defaults";
    if (always && std::string(always) == "1") ctx.tiles_source += " + MHA_PARALLEL_ALWAYS";  // thresholds 0
    ctx.machine = bench::machine();
}

// The report's "machine" and "tiles" objects.
void json_machine(const Context &ctx, nlohmann::json &j) {
    const bench::Machine &m = ctx.machine;
    j["machine"] = {{"cpu", m.cpu}, {"vendor", m.vendor}, {"family", m.family}, {"model", m.model},
                    {"l1d_bytes", m.caches.l1d}, {"l2_bytes", m.caches.l2}, {"l3_bytes", m.caches.l3},
                    {"hardware_threads", m.hardware_threads}, {"isa", std::string(isa_name(ctx.isa))},
                    {"isa_best", std::string(isa_name(best_isa()))}};
    nlohmann::json t = nlohmann::json::parse(tile_config_json(TileConfigFile{ctx.isa, m.cpu, "", ctx.tiles}))["tiles"];
    t["source"] = ctx.tiles_source;
    j["tiles"] = t;
}

// The same for the table's header: two lines.
void print_machine(const Context &ctx) {
    const bench::Machine &m = ctx.machine;
    const TileConfig &t = ctx.tiles;
    std::printf("machine: %s (%s family %d model %d), L1d %lld KiB, L2 %lld KiB, L3 %lld MiB, %u hardware threads; "
                "ISA %s\n",
                m.cpu.c_str(), m.vendor.c_str(), m.family, m.model, static_cast<long long>(m.caches.l1d >> 10),
                static_cast<long long>(m.caches.l2 >> 10), static_cast<long long>(m.caches.l3 >> 20), m.hardware_threads,
                std::string(isa_name(ctx.isa)).c_str());
    std::printf("tiles (%s): %s MC %lld KC %lld NC %lld, small problems to N %lld or K %lld, chain rows %lld; "
                "attention BQ %lld BK %lld chunk %lld; threads from %lld FLOP / %lld elements\n",
                ctx.tiles_source.c_str(), t.gemm_ukernel.c_str(), static_cast<long long>(t.mc),
                static_cast<long long>(t.kc), static_cast<long long>(t.nc), static_cast<long long>(t.sup_max_n),
                static_cast<long long>(t.sup_max_k), static_cast<long long>(t.sup_chain_rows),
                static_cast<long long>(t.attn_block_q), static_cast<long long>(t.attn_block_k),
                static_cast<long long>(t.attn_kv_chunk), static_cast<long long>(t.parallel_min_flops),
                static_cast<long long>(t.parallel_min_elems));
}

struct Row {
    std::string suite, name, shape;
    int threads = 1;
    double ms = 0;
    double rate = 0;            // in `unit`
    std::string unit;           // "GFLOP/s" or "Gelem/s"
    double peak_fraction = -1;  // of the FMA peak (or the read bandwidth); < 0 when it does not apply
    double peak_in_row = -1;    // the probe's median, timed interleaved with the row: FMA GFLOP/s for
                                // GFLOP/s rows, read GB/s for GB/s rows
    std::vector<std::pair<std::string, double>> vs = {};  // anchor -> its time / our time
    double part_ms = -1;        // layer: the attention step's share of ms, timed right after a QKV
                                // projection as the layer runs it (the rest is projections)
    nlohmann::json extra = nlohmann::json::object();  // more fields for the JSON (serving: the mix, tokens/s, ...)
    // serving: whether our output has the same bits as each anchor's (anchor -> identical)
    std::vector<std::pair<std::string, bool>> same_bits = {};
    std::string note = {};      // printed at the end of the table row (encoder: the Add & Norm's share)
    // Process CPU time / wall time over the timed runs: ours, and each anchor's with whether it
    // ran on the threads it was given (within 0.2); an anchor that did not is printed as invalid.
    double cpu_per_wall = -1;
    struct AnchorCpu {
        std::string name;
        double cpu_per_wall;
        int threads;
        bool valid;
    };
    std::vector<AnchorCpu> anchor_cpu = {};
};

struct Anchor {
    std::string name;
    std::function<void()> run;
    int threads = 0;  // the threads it is given; 0 = the row's
    // An anchor timed by another process (PyTorch): run() appends that process's own wall and CPU
    // time of each run here, and they replace our clock's (which would add the pipe's round trip).
    std::vector<bench::TorchAnchor::Timing> *own_times = nullptr;
};

double median_of(std::vector<double> v);

// Times `ours`, every anchor and a probe of the machine's peak in turn, and appends the row: the
// FMA probe for GFLOP/s rows, the read-bandwidth probe for GB/s rows. The share of the peak
// compares the row with the probe's median over the same window: on a shared machine the
// start-up peak can be 10-15% off by the time a row runs.
void measure(const Context &ctx, Row r, double work, const std::function<void()> &ours,
             const std::vector<Anchor> &anchors, std::vector<Row> &rows) {
    std::vector<std::function<void()>> fns = {ours};
    for (const auto &a : anchors) fns.push_back(a.run);
    const bool flops = r.unit == "GFLOP/s", bytes = r.unit == "GB/s";
    std::vector<double> probe;
    if (flops) fns.push_back([&] { probe.push_back(bench::fma_probe_gflops(r.threads)); });
    if (bytes) fns.push_back([&] { probe.push_back(bench::read_probe_gbs(r.threads)); });
    std::vector<double> cpu;
    auto t = bench::time_interleaved(fns, ctx.budget_s() * static_cast<double>(fns.size()), 3, &cpu);
    r.ms = t[0] * 1e3;
    r.cpu_per_wall = cpu[0];
    for (size_t i = 0; i < anchors.size(); ++i) {
        const Anchor &a = anchors[i];
        double ratio = cpu[i + 1];
        if (a.own_times && a.own_times->size() > 1) {
            std::vector<double> ms;
            double cpu_ms = 0, wall_ms = 0;
            for (size_t j = 1; j < a.own_times->size(); ++j) {  // the first was the warm-up
                ms.push_back((*a.own_times)[j].ms);
                wall_ms += (*a.own_times)[j].ms;
                cpu_ms += (*a.own_times)[j].cpu_ms;
            }
            t[i + 1] = median_of(ms) * 1e-3;
            ratio = wall_ms > 0 ? cpu_ms / wall_ms : 0;
            if (a.name == "PyTorch") r.extra["torch_ms"] = t[i + 1] * 1e3;  // its own time, not our clock's
        }
        // The libraries' thread pools are what can ignore the count they are given; mha's own
        // anchors run on task_arenas of their size by construction (and a short call of theirs
        // can be charged the spin of another arena's threads), so only the libraries are judged.
        const bool library = a.name == "oneDNN" || a.name == "OpenBLAS" || a.name == "PyTorch" || a.name == "blocked" ||
                             a.name == "full" || a.name == "scalar";
        const int given = a.threads ? a.threads : r.threads;
        r.anchor_cpu.push_back({a.name, ratio, given, !library || std::abs(ratio - given) <= 0.2});
    }
    r.rate = work / t[0] * 1e-9;
    if (!probe.empty()) {
        std::sort(probe.begin(), probe.end());
        r.peak_in_row = probe[probe.size() / 2];
        r.peak_fraction = r.rate / r.peak_in_row;
    }
    for (size_t i = 0; i < anchors.size(); ++i) r.vs.emplace_back(anchors[i].name, t[i + 1] / t[0]);
    rows.push_back(r);
}

void suite_gemm(Context &ctx, const std::regex *filter, std::vector<Row> &rows) {
    for (const auto &s : bench::gemm_shapes()) {
        if (ctx.opt.quick && !s.quick) continue;
        const std::string name = s.label;
        if (filter && !std::regex_search("gemm/" + name + "/" + s.str(), *filter)) continue;
        std::vector<float> a(static_cast<size_t>(s.m * s.k), 0.5f), b(static_cast<size_t>(s.k * s.n), 0.25f),
            c(static_cast<size_t>(s.m * s.n));
        const int64_t lda = s.ta == 'N' ? s.k : s.m, ldb = s.tb == 'N' ? s.n : s.k;
        for (int threads : ctx.opt.threads) {
            std::fprintf(stderr, "gemm %s %s threads=%d\n", s.label, s.str().c_str(), threads);
            Runtime rt(RuntimeOptions{threads, {}, {}, {}});
            std::vector<Anchor> anchors;
            if (bench::has_dnnl())
                anchors.push_back({"oneDNN", [&] {
                                       bench::dnnl_sgemm(threads, s.ta, s.tb, s.m, s.n, s.k, 1.0f, a.data(), lda, b.data(),
                                                         ldb, 0.0f, c.data(), s.n);
                                   }});
            if (bench::has_openblas())
                anchors.push_back({"OpenBLAS", [&] {
                                       bench::openblas_sgemm(threads, s.ta, s.tb, s.m, s.n, s.k, 1.0f, a.data(), lda,
                                                             b.data(), ldb, 0.0f, c.data(), s.n);
                                   }});
            auto unpacked = [&](Runtime &r) {
                sgemm(r, static_cast<Trans>(s.ta), static_cast<Trans>(s.tb), s.m, s.n, s.k, 1.0f, a.data(), lda,
                      b.data(), ldb, 0.0f, c.data(), s.n);
            };
            // A "packed B" row times products against a B packed once before (SgemmPackedB), beside
            // the same product packing B per call (ours, "unpacked"; and the libraries').
            Runtime rt1(RuntimeOptions{1, {}, {}, {}});
            std::unique_ptr<SgemmPackedB> pb, pb1;
            if (s.packed_b) {
                pb = std::make_unique<SgemmPackedB>(rt, static_cast<Trans>(s.tb), s.k, s.n, b.data(), ldb);
                pb1 = std::make_unique<SgemmPackedB>(rt1, static_cast<Trans>(s.tb), s.k, s.n, b.data(), ldb);
                anchors.push_back({"unpacked", [&] { unpacked(rt); }});
            }
            auto ours = [&](Runtime &r, const SgemmPackedB *p) {
                if (p) return sgemm(r, static_cast<Trans>(s.ta), s.m, 1.0f, a.data(), lda, *p, 0.0f, c.data(), s.n);
                unpacked(r);
            };
            if (threads > 1) anchors.push_back({"1 thread", [&] { ours(rt1, pb1.get()); }, 1});
            measure(ctx, Row{"gemm", name, s.str(), threads, 0, 0, "GFLOP/s", -1, {}}, s.flops(),
                    [&] { ours(rt, pb.get()); }, anchors, rows);
        }
    }
}

void suite_softmax(Context &ctx, const std::regex *filter, std::vector<Row> &rows) {
    for (const auto &s : bench::softmax_shapes()) {
        if (ctx.opt.quick && !s.quick) continue;
        if (filter && !std::regex_search("softmax/rows/" + s.str(), *filter)) continue;
        std::vector<float> x(static_cast<size_t>(s.rows * s.cols)), y(x.size());
        for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(i % 97) * 0.1f - 5.0f;
        for (int threads : ctx.opt.threads) {
            std::fprintf(stderr, "softmax %s threads=%d\n", s.str().c_str(), threads);
            std::unique_ptr<bench::DnnlSoftmax> dnnl;
            if (bench::has_dnnl()) dnnl = std::make_unique<bench::DnnlSoftmax>(s.rows, s.cols, x.data(), y.data(), threads);
            Runtime rt(RuntimeOptions{threads, {}, {}, {}});
            std::vector<Anchor> anchors;
            if (dnnl) anchors.push_back({"oneDNN", [&] { dnnl->run(); }});
            anchors.push_back({"scalar", [&] { bench::scalar_softmax(s.rows, s.cols, x.data(), y.data()); }, 1});
            Runtime rt1(RuntimeOptions{1, {}, {}, {}});
            if (threads > 1)
                anchors.push_back({"1 thread", [&] { softmax(rt1, s.rows, s.cols, x.data(), s.cols, y.data(), s.cols); }, 1});
            measure(ctx, Row{"softmax", "rows", s.str(), threads, 0, 0, "Gelem/s", -1, {}}, s.elems(),
                    [&] { softmax(rt, s.rows, s.cols, x.data(), s.cols, y.data(), s.cols); }, anchors, rows);
        }
    }
}

void suite_attention(Context &ctx, const std::regex *filter, std::vector<Row> &rows) {
    for (const auto &s : bench::attention_shapes()) {
        if (ctx.opt.quick && !s.quick) continue;
        if (filter && !std::regex_search("attention/fused/" + s.str(), *filter)) continue;
        const size_t n = static_cast<size_t>(s.batch * s.len * s.heads * s.dim);
        std::vector<float> q(n), k(n), v(n), out(n), scores;
        for (size_t i = 0; i < n; ++i) {
            q[i] = static_cast<float>(i % 13) * 0.01f;
            k[i] = static_cast<float>(i % 7) * 0.02f;
            v[i] = static_cast<float>(i % 5) * 0.1f;
        }
        AttentionParams p;
        p.batch = s.batch; p.q_len = p.kv_len = s.len; p.num_heads = p.num_kv_heads = s.heads;
        p.head_dim = p.value_dim = s.dim; p.causal = s.causal;
        for (int threads : ctx.opt.threads) {
            std::fprintf(stderr, "attention %s threads=%d\n", s.str().c_str(), threads);
            Runtime rt(RuntimeOptions{threads, {}, {}, {}}), rt1(RuntimeOptions{1, {}, {}, {}});
            std::vector<Anchor> anchors;
            if (bench::has_dnnl()) {
                anchors.push_back({"blocked", [&] {
                                       bench::dnnl_attention(threads, 256, s.batch, s.len, s.heads, s.dim, s.causal, q.data(),
                                                             k.data(), v.data(), out.data(), scores);
                                   }});
                anchors.push_back({"full", [&] {
                                       bench::dnnl_attention(threads, 0, s.batch, s.len, s.heads, s.dim, s.causal, q.data(),
                                                             k.data(), v.data(), out.data(), scores);
                                   }});
            }
            // mha's own unfused composition (GEMM, softmax, GEMM per head), the tests' second opinion.
            anchors.push_back({"unfused", [&] { attention_unfused(rt, p, q.data(), k.data(), v.data(), out.data()); }});
            // The targets that are ratios of our own calls, timed in the same window: causal against
            // the same shape without the mask, and more threads against one.
            AttentionParams full = p;
            full.causal = false;
            if (s.causal)
                anchors.push_back({"non-causal", [&] { attention(rt, full, q.data(), k.data(), v.data(), out.data()); }});
            if (threads > 1)
                anchors.push_back({"1 thread", [&] { attention(rt1, p, q.data(), k.data(), v.data(), out.data()); }, 1});
            measure(ctx, Row{"attention", "fused", s.str(), threads, 0, 0, "GFLOP/s", -1, {}}, s.flops(),
                    [&] { attention(rt, p, q.data(), k.data(), v.data(), out.data()); }, anchors, rows);
        }
    }
}

void suite_decode(Context &ctx, const std::regex *filter, std::vector<Row> &rows) {
    for (const auto &s : bench::decode_shapes()) {
        if (ctx.opt.quick && !s.quick) continue;
        if (filter && !std::regex_search("decode/fused/" + s.str(), *filter)) continue;
        const int64_t B = s.batch, H = s.heads, Hkv = s.kv_heads, D = s.dim, L = s.kv_len;
        std::vector<float> q(static_cast<size_t>(B * H * D), 0.01f), k(static_cast<size_t>(B * L * Hkv * D), 0.02f),
            v(k.size(), 0.5f), out(q.size());
        AttentionParams p;
        p.batch = B; p.q_len = 1; p.kv_len = L; p.num_heads = H; p.num_kv_heads = Hkv; p.head_dim = p.value_dim = D;
        for (int threads : ctx.opt.threads) {
            std::fprintf(stderr, "decode %s threads=%d\n", s.str().c_str(), threads);
            Runtime rt(RuntimeOptions{threads, {}, {}, {}}), rt1(RuntimeOptions{1, {}, {}, {}});
            std::vector<Anchor> anchors = {
                {"unfused", [&] { attention_unfused(rt, p, q.data(), k.data(), v.data(), out.data()); }}};
            if (threads > 1)
                anchors.push_back({"1 thread", [&] { attention(rt1, p, q.data(), k.data(), v.data(), out.data()); }, 1});
            measure(ctx, Row{"decode", "fused", s.str(), threads, 0, 0, "GB/s", -1, {}}, s.kv_bytes(),
                    [&] { attention(rt, p, q.data(), k.data(), v.data(), out.data()); }, anchors, rows);
        }
    }
}

void suite_layer(Context &ctx, const std::regex *filter, std::vector<Row> &rows) {
    std::vector<bench::LayerShape> shapes;
    for (const auto &s : bench::layer_shapes())
        if ((!ctx.opt.quick || s.quick) && (!filter || std::regex_search("layer/forward/" + s.str(), *filter)))
            shapes.push_back(s);
    if (shapes.empty()) return;
    std::vector<std::string> torch_shapes;
    for (const auto &s : shapes) torch_shapes.push_back(s.torch_str());
    for (int threads : ctx.opt.threads) {
        std::fprintf(stderr, "layer: PyTorch nn.MultiheadAttention, threads=%d\n", threads);
        bench::TorchAnchor torch("torch_layer.py", "MHA_TORCH_SCRIPT", threads, torch_shapes);
        if (!torch.ok()) std::fprintf(stderr, "layer: PyTorch anchor skipped: %s\n", torch.why().c_str());
        for (size_t i = 0; i < shapes.size(); ++i) {
            const auto &s = shapes[i];
            std::fprintf(stderr, "layer %s threads=%d\n", s.str().c_str(), threads);
            Runtime rt(RuntimeOptions{threads, {}, {}, {}});
            bench::LayerFixture f(rt, s);
            std::vector<bench::TorchAnchor::Timing> torch_times;
            std::vector<Anchor> anchors;
            if (torch.ok())
                anchors.push_back({"PyTorch", [&] { torch_times.push_back(torch.run(s.torch_str())); }, 0, &torch_times});
            if (bench::has_dnnl()) anchors.push_back({"oneDNN", [&] { f.onednn(threads); }});
            Runtime rt1(RuntimeOptions{1, {}, {}, {}});
            if (threads > 1) anchors.push_back({"1 thread", [&] { f.forward(rt1); }, 1});
            measure(ctx, Row{"layer", "forward", s.str(), threads, 0, 0, "GFLOP/s", -1, {}}, s.flops(),
                    [&] { f.forward(rt); }, anchors, rows);
            Row &r = rows.back();
            if (torch.ok()) r.extra["torch_version"] = torch.version();
            // The attention step as the layer runs it: right after a QKV projection wrote its input.
            // Timed alone and repeated, it runs on inputs its own previous call left in the caches:
            // Xeon, 1 thread, B8 L128, 2.33 ms alone against 3.39 ms after the projection, a share
            // of 13% instead of 19% (B4 L512 and B1 L2048: within 3%). The warm figure stays in the
            // JSON (attention_alone_ms).
            r.part_ms = bench::time_median_after([&] { f.project_qkv(rt); }, [&] { f.attention_in_layer(rt); },
                                                 ctx.budget_s()) * 1e3;
            r.extra["attention_alone_ms"] = bench::time_median([&] { f.attention_only(rt); }, ctx.budget_s()) * 1e3;
        }
    }
}

// ---- serving: ragged prefill, decode and a continuous batch through the KV cache -------------

Row serving_row(const std::string &name, const std::string &shape, int threads, const char *unit) {
    Row r;
    r.suite = "serving";
    r.name = name;
    r.shape = shape;
    r.threads = threads;
    r.unit = unit;
    return r;
}

bool same_bits(const std::vector<float> &a, const std::vector<float> &b) {
    return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// The largest tokens a cache block can hold on this runtime (block_tokens divides attn_block_k), so
// a capacity of round_up(len, this) per sequence always suffices.
int64_t cache_tokens_for(const Runtime &rt, int64_t len) {
    const int64_t bk = std::max<int64_t>(rt.tiles().attn_block_k, 1);
    return (len + bk - 1) / bk * bk;
}

// (a) The prompt mix prefilled in one mha::attention_varlen call (causal), beside the same batch
// padded to the longest prompt through mha::attention and one mha::attention call per prompt.
// Padding: each prompt's rows at the front of its batch entry, zeros after; q_len = kv_len = the
// longest, causal (bottom-right is top-left when q_len = kv_len) and kv_valid_lens = the prompt
// lengths, so the real rows see exactly their causal prefix and the padded query rows are computed
// and thrown away, as a server that pads does. GFLOP/s counts the useful causal work only:
// 4 D H per visible (query, key) pair, 2 L (L + 1) D H per prompt, for all three.
void serving_prefill(Context &ctx, const std::regex *filter, std::vector<Row> &rows) {
    const std::vector<int64_t> &lens = bench::serving_prompt_lens();
    const int64_t S = static_cast<int64_t>(lens.size()), Lmax = *std::max_element(lens.begin(), lens.end());
    std::vector<int64_t> offsets(static_cast<size_t>(S + 1), 0);
    std::partial_sum(lens.begin(), lens.end(), offsets.begin() + 1);
    const int64_t T = offsets.back();
    std::vector<int32_t> valid(lens.begin(), lens.end());
    for (const auto &h : bench::serving_prefill_heads()) {
        if (ctx.opt.quick && !h.quick) continue;
        const std::string shape = "mix" + std::to_string(S) + " T" + std::to_string(T) + " " + h.str() + " causal";
        if (filter && !std::regex_search("serving/prefill/" + shape, *filter)) continue;
        const int64_t H = h.heads, Hkv = h.kv_heads, D = h.dim, qrow = H * D, kvrow = Hkv * D;
        std::vector<float> q(static_cast<size_t>(T * qrow)), k(static_cast<size_t>(T * kvrow)), v(k.size()),
            out(q.size()), out_seq(q.size());
        bench::fill_hashed(q.data(), q.size(), 1, 1.0f);
        bench::fill_hashed(k.data(), k.size(), 2, 1.0f);
        bench::fill_hashed(v.data(), v.size(), 3, 1.0f);
        std::vector<float> qp(static_cast<size_t>(S * Lmax * qrow), 0.0f), kp(static_cast<size_t>(S * Lmax * kvrow), 0.0f),
            vp(kp.size(), 0.0f), outp(qp.size());
        for (int64_t s = 0; s < S; ++s) {
            const auto L = lens[static_cast<size_t>(s)], o = offsets[static_cast<size_t>(s)];
            std::copy_n(q.begin() + o * qrow, L * qrow, qp.begin() + s * Lmax * qrow);
            std::copy_n(k.begin() + o * kvrow, L * kvrow, kp.begin() + s * Lmax * kvrow);
            std::copy_n(v.begin() + o * kvrow, L * kvrow, vp.begin() + s * Lmax * kvrow);
        }
        VarlenParams p;
        p.num_seqs = S;
        p.q_offsets = p.kv_offsets = offsets.data();
        p.num_heads = H; p.num_kv_heads = Hkv; p.head_dim = p.value_dim = D;
        p.causal = true;
        AttentionParams padded;
        padded.batch = S; padded.q_len = padded.kv_len = Lmax;
        padded.num_heads = H; padded.num_kv_heads = Hkv; padded.head_dim = padded.value_dim = D;
        padded.causal = true;
        padded.kv_valid_lens = valid.data();
        double flops = 0;
        for (int64_t L : lens) flops += 4.0 * static_cast<double>(D * H) * bench::causal_pairs(L, L);
        auto per_seq = [&](Runtime &r) {
            for (int64_t s = 0; s < S; ++s) {
                AttentionParams one = padded;
                one.batch = 1;
                one.q_len = one.kv_len = lens[static_cast<size_t>(s)];
                one.kv_valid_lens = nullptr;
                const int64_t o = offsets[static_cast<size_t>(s)];
                attention(r, one, q.data() + o * qrow, k.data() + o * kvrow, v.data() + o * kvrow, out_seq.data() + o * qrow);
            }
        };
        for (int threads : ctx.opt.threads) {
            std::fprintf(stderr, "serving prefill %s threads=%d\n", shape.c_str(), threads);
            Runtime rt(RuntimeOptions{threads, {}, {}, {}}), rt1(RuntimeOptions{1, {}, {}, {}});
            std::vector<Anchor> anchors = {
                {"padded", [&] { attention(rt, padded, qp.data(), kp.data(), vp.data(), outp.data()); }},
                {"per-seq", [&] { per_seq(rt); }}};
            if (threads > 1)
                anchors.push_back({"1 thread", [&] { attention_varlen(rt1, p, q.data(), k.data(), v.data(), out.data()); }, 1});
            measure(ctx, serving_row("prefill", shape, threads, "GFLOP/s"), flops,
                    [&] { attention_varlen(rt, p, q.data(), k.data(), v.data(), out.data()); }, anchors, rows);
            Row &r = rows.back();
            r.extra["seq_lens"] = lens;
            r.extra["tokens"] = T;
            r.extra["tokens_per_s"] = static_cast<double>(T) / (r.ms * 1e-3);
            r.extra["flops_counted"] = "causal";
            r.same_bits.emplace_back("per-seq", same_bits(out, out_seq));
            bool pad_same = true;
            for (int64_t s = 0; s < S && pad_same; ++s)
                pad_same = std::memcmp(outp.data() + s * Lmax * qrow, out.data() + offsets[static_cast<size_t>(s)] * qrow,
                                       static_cast<size_t>(lens[static_cast<size_t>(s)] * qrow) * sizeof(float)) == 0;
            r.same_bits.emplace_back("padded", pad_same);
        }
    }
}

// (b) One decode step of B sequences of L cached tokens each (fp32 cache): one query per sequence
// through mha::attention_cached, as GB/s of the K and V bytes of every cached token, against the
// read probe; beside it the same step through dense mha::attention (batch B, q_len 1, K and V
// contiguous per sequence). The cache is filled once; attention does not append, so every
// repetition reads the same L tokens.
void serving_decode(Context &ctx, const std::regex *filter, std::vector<Row> &rows) {
    const bench::DecodeShape s = {16, 4096, 32, 8, 128, true};
    if (filter && !std::regex_search("serving/decode/" + s.str(), *filter)) return;
    const int64_t B = s.batch, L = s.kv_len, H = s.heads, Hkv = s.kv_heads, D = s.dim, kvrow = Hkv * D;
    std::vector<float> q(static_cast<size_t>(B * H * D)), k(static_cast<size_t>(B * L * kvrow)), v(k.size()),
        out(q.size()), out_dense(q.size());
    bench::fill_hashed(q.data(), q.size(), 11, 1.0f);
    bench::fill_hashed(k.data(), k.size(), 12, 1.0f);
    bench::fill_hashed(v.data(), v.size(), 13, 1.0f);
    Runtime setup(RuntimeOptions{1, {}, {}, {}});  // the cache's runtime (outlives it)
    KVCacheConfig cc;
    cc.num_kv_heads = Hkv; cc.head_dim = cc.value_dim = D;
    cc.max_tokens = B * cache_tokens_for(setup, L);
    KVCache cache(setup, cc);
    std::vector<int64_t> ids(static_cast<size_t>(B)), offsets(static_cast<size_t>(B + 1));
    std::iota(ids.begin(), ids.end(), 0);
    std::iota(offsets.begin(), offsets.end(), 0);
    for (int64_t b = 0; b < B; ++b) cache.append(b, L, k.data() + b * L * kvrow, v.data() + b * L * kvrow);
    CachedParams p;
    p.num_seqs = B; p.seq_ids = ids.data(); p.q_offsets = offsets.data(); p.num_heads = H; p.causal = true;
    AttentionParams dense;
    dense.batch = B; dense.q_len = 1; dense.kv_len = L;
    dense.num_heads = H; dense.num_kv_heads = Hkv; dense.head_dim = dense.value_dim = D;
    dense.causal = true;
    for (int threads : ctx.opt.threads) {
        std::fprintf(stderr, "serving decode %s threads=%d\n", s.str().c_str(), threads);
        Runtime rt(RuntimeOptions{threads, {}, {}, {}}), rt1(RuntimeOptions{1, {}, {}, {}});
        std::vector<Anchor> anchors = {
            {"dense", [&] { attention(rt, dense, q.data(), k.data(), v.data(), out_dense.data()); }}};
        if (threads > 1) anchors.push_back({"1 thread", [&] { attention_cached(rt1, cache, p, q.data(), out.data()); }, 1});
        measure(ctx, serving_row("decode", s.str(), threads, "GB/s"), s.kv_bytes(),
                [&] { attention_cached(rt, cache, p, q.data(), out.data()); }, anchors, rows);
        Row &r = rows.back();
        r.extra["cached_tokens"] = B * L;
        r.extra["cache_bytes"] = cache.bytes();
        r.extra["tokens_per_s"] = static_cast<double>(B) / (r.ms * 1e-3);
        r.same_bits.emplace_back("dense", same_bits(out, out_dense));
    }
}

// (c) One step of a continuous batch in one mha::attention_cached call: prefill chunks (their
// queries are the last `chunk` of prefill_cached + chunk cached tokens, causal) beside decodes
// (one query over decode_cached tokens). The K and V of every token, the new ones included, are
// appended once before timing (attention does not append), so the lengths stay fixed. Anchors:
// "split", the same step as two attention_cached calls (the chunks, then the decodes), and
// "dense", the same two groups through mha::attention on contiguous K and V. GFLOP/s counts
// 4 D H per visible (query, key) pair.
void serving_continuous(Context &ctx, const std::regex *filter, std::vector<Row> &rows) {
    const bench::ContinuousShape &c = bench::serving_continuous_shape();
    if (ctx.opt.quick && !c.heads.quick) return;
    if (filter && !std::regex_search("serving/continuous/" + c.str(), *filter)) return;
    const int64_t H = c.heads.heads, Hkv = c.heads.kv_heads, D = c.heads.dim, qrow = H * D, kvrow = Hkv * D;
    const int64_t NP = c.prefills, ND = c.decodes, Lp = c.prefill_cached + c.chunk, Ld = c.decode_cached;
    const int64_t Tq = c.new_tokens(), pre_rows = NP * c.chunk;
    std::vector<float> q(static_cast<size_t>(Tq * qrow)), out(q.size()), out_split(q.size()), out_dense(q.size());
    std::vector<float> kp(static_cast<size_t>(NP * Lp * kvrow)), vp(kp.size()), kd(static_cast<size_t>(ND * Ld * kvrow)),
        vd(kd.size());
    bench::fill_hashed(q.data(), q.size(), 21, 1.0f);
    bench::fill_hashed(kp.data(), kp.size(), 22, 1.0f);
    bench::fill_hashed(vp.data(), vp.size(), 23, 1.0f);
    bench::fill_hashed(kd.data(), kd.size(), 24, 1.0f);
    bench::fill_hashed(vd.data(), vd.size(), 25, 1.0f);
    Runtime setup(RuntimeOptions{1, {}, {}, {}});
    KVCacheConfig cc;
    cc.num_kv_heads = Hkv; cc.head_dim = cc.value_dim = D;
    cc.max_tokens = NP * cache_tokens_for(setup, Lp) + ND * cache_tokens_for(setup, Ld);
    KVCache cache(setup, cc);
    std::vector<int64_t> ids(static_cast<size_t>(NP + ND)), offsets(static_cast<size_t>(NP + ND + 1), 0);
    std::iota(ids.begin(), ids.end(), 0);
    for (int64_t s = 0; s < NP; ++s) {
        cache.append(s, Lp, kp.data() + s * Lp * kvrow, vp.data() + s * Lp * kvrow);
        offsets[static_cast<size_t>(s + 1)] = (s + 1) * c.chunk;
    }
    for (int64_t s = 0; s < ND; ++s) {
        cache.append(NP + s, Ld, kd.data() + s * Ld * kvrow, vd.data() + s * Ld * kvrow);
        offsets[static_cast<size_t>(NP + s + 1)] = pre_rows + s + 1;
    }
    CachedParams all;
    all.num_seqs = NP + ND; all.seq_ids = ids.data(); all.q_offsets = offsets.data(); all.num_heads = H;
    all.causal = true;
    std::vector<int64_t> dec_offsets(static_cast<size_t>(ND + 1));
    std::iota(dec_offsets.begin(), dec_offsets.end(), 0);
    CachedParams pre = all, dec = all;
    pre.num_seqs = NP;
    dec.num_seqs = ND; dec.seq_ids = ids.data() + NP; dec.q_offsets = dec_offsets.data();
    AttentionParams dpre, ddec;
    for (AttentionParams *a : {&dpre, &ddec}) {
        a->num_heads = H; a->num_kv_heads = Hkv; a->head_dim = a->value_dim = D; a->causal = true;
    }
    dpre.batch = NP; dpre.q_len = c.chunk; dpre.kv_len = Lp;
    ddec.batch = ND; ddec.q_len = 1; ddec.kv_len = Ld;
    const double pairs = static_cast<double>(NP) * bench::causal_pairs(c.chunk, Lp) +
                         static_cast<double>(ND) * bench::causal_pairs(1, Ld);
    const double flops = 4.0 * static_cast<double>(D * H) * pairs;
    const double kv_bytes = 2.0 * 4.0 * static_cast<double>(c.cached_tokens() * kvrow);
    for (int threads : ctx.opt.threads) {
        std::fprintf(stderr, "serving continuous %s threads=%d\n", c.str().c_str(), threads);
        Runtime rt(RuntimeOptions{threads, {}, {}, {}}), rt1(RuntimeOptions{1, {}, {}, {}});
        std::vector<Anchor> anchors = {
            {"split", [&] {
                 attention_cached(rt, cache, pre, q.data(), out_split.data());
                 attention_cached(rt, cache, dec, q.data() + pre_rows * qrow, out_split.data() + pre_rows * qrow);
             }},
            {"dense", [&] {
                 attention(rt, dpre, q.data(), kp.data(), vp.data(), out_dense.data());
                 attention(rt, ddec, q.data() + pre_rows * qrow, kd.data(), vd.data(), out_dense.data() + pre_rows * qrow);
             }}};
        if (threads > 1) anchors.push_back({"1 thread", [&] { attention_cached(rt1, cache, all, q.data(), out.data()); }, 1});
        measure(ctx, serving_row("continuous", c.str(), threads, "GFLOP/s"), flops,
                [&] { attention_cached(rt, cache, all, q.data(), out.data()); }, anchors, rows);
        Row &r = rows.back();
        r.extra["new_tokens"] = Tq;
        r.extra["tokens_per_s"] = static_cast<double>(Tq) / (r.ms * 1e-3);
        r.extra["cached_tokens"] = c.cached_tokens();
        r.extra["kv_gbs"] = kv_bytes / (r.ms * 1e-3) * 1e-9;
        r.extra["flops_counted"] = "causal";
        r.same_bits.emplace_back("split", same_bits(out, out_split));
        r.same_bits.emplace_back("dense", same_bits(out, out_dense));
    }
}

void suite_serving(Context &ctx, const std::regex *filter, std::vector<Row> &rows) {
    serving_prefill(ctx, filter, rows);
    serving_decode(ctx, filter, rows);
    serving_continuous(ctx, filter, rows);
}

// ---- encoder: nn.TransformerEncoderLayer against PyTorch's fused layer and oneDNN -------------

double median_of(std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
}

// mha::EncoderLayer (post-norm, relu) at each encoder shape on every thread count, interleaved
// with (a) PyTorch 1.13's nn.TransformerEncoderLayer on its fused fast path, run in a child process
// (bench/torch_encoder.py --serve) pinned to the row's threads: each of its turns in measure()
// runs one forward pass there and the ratio uses PyTorch's own time of it; (b) the same layer
// composed from dnnl_sgemm, the oneDNN attention composition and plain loops; (c) on more than one
// thread, our layer on one. GFLOP/s counts 8 L E^2 + 4 L E F + 4 L^2 E per sequence.
// Then the Add & Norm's share of the attention layer at B8 L128: mha::Layer with norm = post
// against the same layer with norm = none, interleaved.
void suite_encoder(Context &ctx, const std::regex *filter, std::vector<Row> &rows) {
    std::vector<bench::EncoderShape> shapes;
    for (const auto &s : bench::encoder_shapes())
        if ((!ctx.opt.quick || s.quick) && (!filter || std::regex_search("encoder/forward/" + s.str(), *filter)))
            shapes.push_back(s);
    const bench::LayerShape an = bench::encoder_shapes().front().attention();  // B8 L128 E512 H8
    const bool add_norm = !filter || std::regex_search("encoder/add&norm/" + an.str(), *filter);
    for (int threads : ctx.opt.threads) {
        std::unique_ptr<bench::TorchAnchor> torch;
        if (!shapes.empty()) {
            std::fprintf(stderr, "encoder: PyTorch nn.TransformerEncoderLayer, threads=%d\n", threads);
            std::vector<std::string> torch_shapes;
            for (const auto &s : shapes) torch_shapes.push_back(s.torch_str());
            torch = std::make_unique<bench::TorchAnchor>("torch_encoder.py", "MHA_TORCH_ENCODER_SCRIPT", threads, torch_shapes);
            if (!torch->ok()) std::fprintf(stderr, "encoder: PyTorch anchor skipped: %s\n", torch->why().c_str());
        }
        for (const auto &s : shapes) {
            std::fprintf(stderr, "encoder %s threads=%d\n", s.str().c_str(), threads);
            Runtime rt(RuntimeOptions{threads, {}, {}, {}}), rt1(RuntimeOptions{1, {}, {}, {}});
            bench::EncoderFixture f(rt, s);
            std::vector<bench::TorchAnchor::Timing> torch_times;
            std::vector<Anchor> anchors;
            if (torch->ok())
                anchors.push_back({"PyTorch", [&] { torch_times.push_back(torch->run(s.torch_str())); }, 0, &torch_times});
            if (bench::has_dnnl()) anchors.push_back({"oneDNN", [&] { f.onednn(threads); }});
            if (threads > 1) anchors.push_back({"1 thread", [&] { f.forward(rt1); }, 1});
            Row row;
            row.suite = "encoder";
            row.name = "forward";
            row.shape = s.str();
            row.threads = threads;
            row.unit = "GFLOP/s";
            measure(ctx, row, s.flops(), [&] { f.forward(rt); }, anchors, rows);
            Row &r = rows.back();
            if (!torch_times.empty()) {
                r.extra["torch_version"] = torch->version();
                r.extra["torch_fast_path"] = torch->fast_path(s.torch_str());
                if (!torch->fast_path(s.torch_str())) r.note = "PyTorch NOT on its fused path";
            }
            if (bench::has_dnnl()) r.extra["max_abs_diff_vs_oneDNN"] = f.max_abs_diff();
            r.extra["flops_counted"] = "8 L E^2 + 4 L E F + 4 L^2 E per sequence";
        }
        if (add_norm) {
            std::fprintf(stderr, "encoder add&norm %s threads=%d\n", an.str().c_str(), threads);
            Runtime rt(RuntimeOptions{threads, {}, {}, {}});
            bench::LayerFixture f(rt, an);  // its weights; two layers over them, with and without the norm
            std::vector<float> gamma(static_cast<size_t>(an.embed)), beta(gamma.size());
            bench::fill_hashed(gamma.data(), gamma.size(), 201, 0.1f);
            for (float &g : gamma) g += 1.0f;
            bench::fill_hashed(beta.data(), beta.size(), 202, 0.1f);
            LayerConfig c;
            c.embed_dim = an.embed;
            c.num_heads = an.heads;
            LayerWeights w = LayerWeights::from_in_proj(c, f.w_in.data(), f.b_in.data(), f.w_out.data(), f.b_out.data());
            const Layer plain(rt, c, w);
            c.norm = Norm::post;
            w.norm_weight = gamma.data();
            w.norm_bias = beta.data();
            const Layer normed(rt, c, w);
            std::vector<float> out2(f.out.size());
            Row row;
            row.suite = "encoder";
            row.name = "add&norm";
            row.shape = an.str();
            row.threads = threads;
            row.unit = "GFLOP/s";
            measure(ctx, row, an.flops(), [&] { normed.forward(rt, f.forward_params, f.x.data(), nullptr, nullptr, f.out.data()); },
                    {{"no norm", [&] { plain.forward(rt, f.forward_params, f.x.data(), nullptr, nullptr, out2.data()); }}},
                    rows);
            Row &r = rows.back();
            const double none_ms = r.vs.front().second * r.ms;
            r.extra["no_norm_ms"] = none_ms;
            r.extra["add_norm_share"] = (r.ms - none_ms) / r.ms;
            char note[96];
            std::snprintf(note, sizeof note, "add&norm %.1f%% of the layer's time", 100.0 * (r.ms - none_ms) / r.ms);
            r.note = note;
        }
    }
}

// Threads only where they pay: small calls of each entry point on the most threads asked for,
// against the same call on one thread and on all threads whatever the size (the tile config's
// parallel_min_flops and parallel_min_elems at 0). Where "all threads" crosses "1 thread" is the
// break-even those defaults come from; "vs 1 thread" must stay at or above 1.00x.
// ---- variants: the attention of today's decoders (issue 20) -------------------------------------
// Each row beside the same call without its feature: window 1024 at L 16384 (GFLOP/s over the
// visible pairs only, beside plain causal L 2048), softcap, ALiBi and sinks at L 2048, RoPE in the
// layer at B8 L128, the int8 cache in the serving decode shape, and head dims 64 to 256 at L 1024
// (their share of the FMA probe).
void suite_variants(Context &ctx, const std::regex *filter, std::vector<Row> &rows) {
    auto wanted = [&](const std::string &name) { return !ctx.opt.quick && (!filter || std::regex_search(name, *filter)); };
    auto fill = [](std::vector<float> &x, size_t n, uint64_t seed) {
        x.resize(n);
        bench::fill_hashed(x.data(), n, seed, 1.0f);
    };
    const int64_t H = 8;
    // (a) attention rows: name, L, D, causal, the variant; work = 4 D H x visible pairs.
    struct AttnRow {
        std::string name;
        int64_t L, D;
        bool causal;
        int64_t window;
        float softcap;
        bool alibi, sinks;
    };
    std::vector<AttnRow> attn = {{"window1024", 16384, 64, true, 1024, 0, false, false},
                                 {"softcap", 2048, 64, false, 0, 30.0f, false, false},
                                 {"alibi", 2048, 64, false, 0, 0, true, false},
                                 {"sinks", 2048, 64, false, 0, 0, false, true}};
    for (int64_t D : {64, 80, 96, 112, 128, 256}) attn.push_back({"D" + std::to_string(D), 1024, D, false, 0, 0, false, false});
    std::vector<float> slopes, sinks;
    for (int64_t h = 0; h < H; ++h) {
        slopes.push_back(std::exp2(-8.0f * static_cast<float>(h + 1) / static_cast<float>(H)));
        sinks.push_back(0.5f);
    }
    for (const AttnRow &a : attn) {
        const std::string shape = "L" + std::to_string(a.L) + " H8 D" + std::to_string(a.D) + (a.causal ? " causal" : "");
        if (!wanted("variants/" + a.name + "/" + shape)) continue;
        std::vector<float> q, k, v, out(static_cast<size_t>(a.L * H * a.D));
        fill(q, out.size(), 31);
        fill(k, out.size(), 32);
        fill(v, out.size(), 33);
        AttentionParams p;
        p.batch = 1; p.q_len = p.kv_len = a.L; p.num_heads = p.num_kv_heads = H; p.head_dim = p.value_dim = a.D;
        p.causal = a.causal;
        AttentionParams plain = p;
        p.variant = AttentionVariant{a.window, a.softcap, a.alibi ? slopes.data() : nullptr, a.sinks ? sinks.data() : nullptr};
        double pairs = 0;
        for (int64_t i = 0; i < a.L; ++i) {
            const int64_t hi = a.causal ? i + 1 : a.L, lo = a.window ? std::max<int64_t>(0, i - a.window + 1) : 0;
            pairs += static_cast<double>(hi - lo);
        }
        // Plain causal attention at L 2048: the window row's target compares GFLOP/s with it.
        AttentionParams ref2048 = plain;
        ref2048.q_len = ref2048.kv_len = std::min<int64_t>(2048, a.L);
        for (int threads : ctx.opt.threads) {
            std::fprintf(stderr, "variants %s %s threads=%d\n", a.name.c_str(), shape.c_str(), threads);
            Runtime rt(RuntimeOptions{threads, {}, {}, {}});
            std::vector<Anchor> anchors;
            if (a.window)
                anchors.push_back({"causal L2048", [&] { attention(rt, ref2048, q.data(), k.data(), v.data(), out.data()); }});
            else if (a.softcap != 0.0f || a.alibi || a.sinks)
                anchors.push_back({"plain", [&] { attention(rt, plain, q.data(), k.data(), v.data(), out.data()); }});
            measure(ctx, Row{"variants", a.name, shape, threads, 0, 0, "GFLOP/s", -1, {}},
                    4.0 * static_cast<double>(a.D * H) * pairs, [&] { attention(rt, p, q.data(), k.data(), v.data(), out.data()); },
                    anchors, rows);
            if (a.window) {  // the L 2048 anchor's GFLOP/s over its causal pairs, for the 0.8x target
                Row &r = rows.back();
                const double t2048 = r.ms * 1e-3 * r.vs.back().second;
                r.extra["causal_L2048_gflops"] = 4.0 * static_cast<double>(a.D * H) * (2048.0 * 2049.0 / 2.0) / t2048 * 1e-9;
                // What the target reads: this row's GFLOP/s over its visible pairs against that one's
                // (the column shows this ratio, not the usual time ratio).
                r.vs.back() = {"causal L2048 GF/s", r.extra["causal_L2048_gflops"].get<double>() > 0
                                                         ? r.rate / r.extra["causal_L2048_gflops"].get<double>() : 0.0};
            }
        }
    }
    // (b) RoPE in the layer at B8 L128 E512 H8, beside the same layer without it.
    if (wanted("variants/rope/B8 L128 E512 H8")) {
        const bench::LayerShape s{8, 128, 512, 8, false};
        for (int threads : ctx.opt.threads) {
            std::fprintf(stderr, "variants rope %s threads=%d\n", s.str().c_str(), threads);
            Runtime rt(RuntimeOptions{threads, {}, {}, {}});
            bench::LayerFixture f(rt, s);
            LayerConfig c = f.layer->config();
            c.rope.dims = 64;
            const Layer roped(rt, c, LayerWeights::from_in_proj(c, f.w_in.data(), f.b_in.data(), f.w_out.data(), f.b_out.data()));
            measure(ctx, Row{"variants", "rope", s.str(), threads, 0, 0, "GFLOP/s", -1, {}}, s.flops(),
                    [&] { roped.forward(rt, f.forward_params, f.x.data(), nullptr, nullptr, f.out.data()); },
                    {{"no rope", [&] { f.forward(rt); }}}, rows);
        }
    }
    // (c) Decode from an int8 cache, the serving decode shape, beside the fp32 cache.
    const bench::DecodeShape d = {16, 4096, 32, 8, 128, false};
    if (wanted("variants/decode_i8/" + d.str())) {
        const int64_t B = d.batch, L = d.kv_len, Hq = d.heads, Hkv = d.kv_heads, D = d.dim, kvrow = Hkv * D;
        std::vector<float> q, k, v, out(static_cast<size_t>(B * Hq * D));
        fill(q, out.size(), 41);
        fill(k, static_cast<size_t>(B * L * kvrow), 42);
        fill(v, k.size(), 43);
        Runtime setup(RuntimeOptions{1, {}, {}, {}});
        KVCacheConfig cc;
        cc.num_kv_heads = Hkv; cc.head_dim = cc.value_dim = D;
        cc.max_tokens = B * cache_tokens_for(setup, L);
        KVCache f32(setup, cc);
        cc.dtype = DType::i8;
        KVCache i8(setup, cc);
        for (int64_t b = 0; b < B; ++b) {
            f32.append(b, L, k.data() + b * L * kvrow, v.data() + b * L * kvrow);
            i8.append(b, L, k.data() + b * L * kvrow, v.data() + b * L * kvrow);
        }
        std::vector<int64_t> ids(static_cast<size_t>(B)), offsets(static_cast<size_t>(B + 1));
        std::iota(ids.begin(), ids.end(), 0);
        std::iota(offsets.begin(), offsets.end(), 0);
        CachedParams p;
        p.num_seqs = B; p.seq_ids = ids.data(); p.q_offsets = offsets.data(); p.num_heads = Hq; p.causal = true;
        for (int threads : ctx.opt.threads) {
            std::fprintf(stderr, "variants decode_i8 %s threads=%d\n", d.str().c_str(), threads);
            Runtime rt(RuntimeOptions{threads, {}, {}, {}});
            // GB/s of the int8 bytes read (a scale per token and head included).
            const double bytes = static_cast<double>(B * L * Hkv) * (2.0 * static_cast<double>(D) + 8.0);
            measure(ctx, Row{"variants", "decode_i8", d.str(), threads, 0, 0, "GB/s", -1, {}}, bytes,
                    [&] { attention_cached(rt, i8, p, q.data(), out.data()); },
                    {{"f32 cache", [&] { attention_cached(rt, f32, p, q.data(), out.data()); }}}, rows);
            Row &r = rows.back();
            r.extra["tokens_per_s"] = static_cast<double>(B) / (r.ms * 1e-3);
            r.extra["cache_bytes"] = i8.bytes();
        }
    }
}

void suite_threads(Context &ctx, const std::regex *filter, std::vector<Row> &rows) {
    const int threads = *std::max_element(ctx.opt.threads.begin(), ctx.opt.threads.end());
    if (threads < 2) return;
    Runtime rt(RuntimeOptions{threads, {}, {}, {}}), rt1(RuntimeOptions{1, {}, {}, {}});
    TileConfig always = rt.tiles();
    always.parallel_min_flops = always.parallel_min_elems = 0;
    Runtime rt_all(RuntimeOptions{threads, {}, always, {}});
    auto row = [&](const char *name, const std::string &shape, const char *unit, double work, auto call) {
        if (filter && !std::regex_search(std::string("threads/") + name + "/" + shape, *filter)) return;
        std::fprintf(stderr, "threads %s %s threads=%d\n", name, shape.c_str(), threads);
        measure(ctx, Row{"threads", name, shape, threads, 0, 0, unit, -1, {}}, work, [&] { call(rt); },
                {{"1 thread", [&] { call(rt1); }, 1}, {"all threads", [&] { call(rt_all); }}}, rows);
    };
    for (int64_t n : {32, 64, 96, 128, 192, 256, 384}) {
        std::vector<float> a(static_cast<size_t>(n * n), 0.5f), c(a.size());
        row("sgemm", std::to_string(n) + "^3", "GFLOP/s", 2.0 * n * n * n,
            [&](Runtime &r) { sgemm(r, Trans::N, Trans::N, n, n, n, 1.0f, a.data(), n, a.data(), n, 0.0f, c.data(), n); });
    }
    for (int64_t rows_n : {32, 128, 256, 512, 1024, 2048, 8192}) {
        std::vector<float> x(static_cast<size_t>(rows_n * 128)), y(x.size());
        bench::fill_hashed(x.data(), x.size(), 7, 4.0f);
        row("softmax", std::to_string(rows_n) + "x128", "Gelem/s", static_cast<double>(x.size()),
            [&](Runtime &r) { softmax(r, rows_n, 128, x.data(), 128, y.data(), 128); });
    }
    for (int64_t len : {16, 32, 64, 128, 256}) {
        AttentionParams p;
        p.batch = 1;
        p.q_len = p.kv_len = len;
        p.num_heads = p.num_kv_heads = 8;
        p.head_dim = p.value_dim = 64;
        std::vector<float> q(static_cast<size_t>(len * 8 * 64)), out(q.size());
        bench::fill_hashed(q.data(), q.size(), 8, 1.0f);
        row("attention", "L" + std::to_string(len) + " H8 D64", "GFLOP/s", 4.0 * len * len * 64 * 8,
            [&](Runtime &r) { attention(r, p, q.data(), q.data(), q.data(), out.data()); });
    }
}

void print_table(const Context &ctx, const std::vector<Row> &rows) {
    std::printf("mha-bench%s: FMA peak", ctx.opt.quick ? " --quick" : "");
    for (auto [t, g] : ctx.peak) std::printf(" %.1f GFLOP/s (%d thread%s)", g, t, t > 1 ? "s" : "");
    std::printf(", read bandwidth");
    for (auto [t, b] : ctx.bandwidth) std::printf(" %.1f GB/s (%d thread%s)", b, t, t > 1 ? "s" : "");
    std::printf("\n");
    std::printf("anchors: oneDNN %s, OpenBLAS %s; environment: %s\n", bench::has_dnnl() ? "yes" : "not built",
                bench::has_openblas() ? "yes" : "not built", bench::anchor_environment().c_str());
    std::printf("mha: the register transposes (few-rows GEMM, packs): %s (MHA_TRANSPOSE)\n",
                gemm::transpose_variant_name(gemm::transpose_variant()));
    print_machine(ctx);
    std::string suite;
    int shape_width = 20;  // wide enough for every shape (the serving shapes are longer)
    for (const auto &r : rows) shape_width = std::max(shape_width, static_cast<int>(r.shape.size()));
    std::vector<std::string> columns;  // the suite's anchors, in order of first appearance
    for (const auto &r : rows) {
        if (r.suite != suite) {
            suite = r.suite;
            columns.clear();
            for (const auto &o : rows)
                for (const auto &[n, v] : o.vs)
                    if (o.suite == suite && std::find(columns.begin(), columns.end(), n) == columns.end())
                        columns.push_back(n);
            std::printf("\n%-9s %-10s %-*s %7s %10s %12s %7s", "suite", "name", shape_width, "shape", "threads", "ms", "rate",
                        "%peak");
            for (const auto &n : columns) std::printf(" %13s", ("vs " + n).c_str());
            std::printf("\n");
        }
        char peak[16] = "-";
        if (r.peak_fraction >= 0) std::snprintf(peak, sizeof peak, "%.1f%%", 100.0 * r.peak_fraction);
        char rate[32];
        std::snprintf(rate, sizeof rate, "%.2f %s", r.rate,
                      r.unit == "GFLOP/s" ? "GF/s" : r.unit == "GB/s" ? "GB/s" : "Ge/s");
        std::printf("%-9s %-10s %-*s %7d %10.3f %12s %7s", r.suite.c_str(), r.name.c_str(), shape_width, r.shape.c_str(),
                    r.threads, r.ms, rate, peak);
        std::string invalid;  // anchors that did not run on the threads they were given
        for (const auto &a : r.anchor_cpu)
            if (!a.valid) {
                char buf[128];
                std::snprintf(buf, sizeof buf, "%s%s CPU/wall %.2f on %d thread%s", invalid.empty() ? "" : ", ",
                              a.name.c_str(), a.cpu_per_wall, a.threads, a.threads > 1 ? "s" : "");
                invalid += buf;
            }
        for (const auto &n : columns) {
            const auto it = std::find_if(r.vs.begin(), r.vs.end(), [&](const auto &x) { return x.first == n; });
            const auto cpu = std::find_if(r.anchor_cpu.begin(), r.anchor_cpu.end(), [&](const auto &x) { return x.name == n; });
            if (it == r.vs.end())
                std::printf(" %13s", "-");
            else if (cpu != r.anchor_cpu.end() && !cpu->valid)
                std::printf(" %13s", "invalid");
            else
                std::printf(" %12.2fx", it->second);
        }
        if (!invalid.empty()) std::printf("   INVALID: %s", invalid.c_str());
        if (r.part_ms >= 0)
            std::printf("   attention %.0f%% / projections %.0f%%", 100.0 * r.part_ms / r.ms, 100.0 * (1.0 - r.part_ms / r.ms));
        if (!r.note.empty()) std::printf("   %s", r.note.c_str());
        if (!r.same_bits.empty()) {
            std::string same, differ;
            for (const auto &[n, eq] : r.same_bits) {
                std::string &list = eq ? same : differ;
                list += (list.empty() ? "" : ", ") + n;
            }
            if (!same.empty()) std::printf("   same bits as %s", same.c_str());
            if (!differ.empty()) std::printf("   OTHER bits than %s", differ.c_str());
        }
        std::printf("\n");
    }
    std::printf("\nGF/s = GFLOP/s (attention: the nominal 4 L^2 D H, causal too); Ge/s = 10^9 elements/s; decode GB/s =\n"
                "K and V bytes read per second. %%peak: GFLOP/s rows against the FMA probe of as many threads, decode\n"
                "rows against the read-bandwidth probe of as many threads, each timed interleaved with the row (the\n"
                "start-up figures above are in the JSON as peak_fraction_startup). vs X = X's time / mha's time.\n"
                "Anchors: blocked/full = unfused attention on dnnl_sgemm (256-row blocks / whole matrix);\n"
                "unfused = mha's own GEMM, softmax, GEMM composition; scalar = the plain softmax loop;\n"
                "non-causal = the same call without the causal mask (1.82x = causal at 0.55x the time);\n"
                "1 thread = the same call on a one-thread runtime (the speed-up of this row's threads);\n"
                "gemm packed B: B packed once (SgemmPackedB) before the timed calls; unpacked = mha_sgemm on B as\n"
                "stored, which packs what it must of B every call, as oneDNN's and OpenBLAS's calls do;\n"
                "every anchor's process CPU time / wall time is measured over its runs: a library's (oneDNN, OpenBLAS,\n"
                "PyTorch, the dnnl compositions, scalar) more than 0.2 off the threads it was given is printed as\n"
                "invalid (every ratio is in the JSON);\n"
                "layer: oneDNN = the same layer composed from dnnl_sgemm (projections, blocked attention), PyTorch =\n"
                "nn.MultiheadAttention(batch_first=True, need_weights=False) run by bench/torch_layer.py in a child pinned\n"
                "to the row's threads, its runs interleaved with ours and timed by itself;\n"
                "layer GF/s counts 8 L E^2 + 4 L^2 E per sequence; the split times the attention step as the layer\n"
                "runs it, right after a QKV projection wrote its input (timed alone and warm: attention_alone_ms).\n"
                "serving: prefill = the 8-prompt mix (64..2048 tokens) in one attention_varlen call, GF/s of the\n"
                "useful causal work (2 L (L+1) D H per prompt); padded = the mix padded to 2048 through mha::attention\n"
                "with kv_valid_lens, per-seq = one mha::attention call per prompt; decode = one query per sequence\n"
                "through attention_cached, GB/s of cached K and V; dense = the same through mha::attention;\n"
                "continuous = prefill chunks and decodes in one attention_cached call, GF/s of the causal work;\n"
                "split = the chunks and the decodes in two attention_cached calls; same bits as X = our output\n"
                "is bitwise identical to X's.\n"
                "encoder: mha::EncoderLayer (post-norm, relu); PyTorch = 1.13's nn.TransformerEncoderLayer(batch_first=True)\n"
                "in eval mode under torch.inference_mode() (its fused path), run by bench/torch_encoder.py in a child\n"
                "pinned to the row's threads, its runs interleaved with ours and timed by itself; oneDNN = the same\n"
                "layer from dnnl_sgemm, the layer suite's attention composition and plain loops for bias, relu and\n"
                "LayerNorm; GF/s counts 8 L E^2 + 4 L E F + 4 L^2 E per sequence (the GEMMs and the attention).\n"
                "add&norm = the attention layer with its Add & Norm (norm = post) against the same layer without\n"
                "(vs no norm); its share = 1 - (no norm's time / the row's time).\n"
                "threads: small calls on the most threads asked for (default tiles) against 1 thread and against every\n"
                "thread whatever the size (parallel_min_flops = parallel_min_elems = 0): where \"all threads\" drops\n"
                "below \"1 thread\" is the break-even behind those defaults.\n");
}

void print_json(const Context &ctx, const std::vector<Row> &rows) {
    nlohmann::json j;
    j["peak_gflops"] = ctx.peak.begin()->second;
    j["peak_gflops_threads"] = ctx.peak.begin()->first;
    for (auto [t, g] : ctx.peak) j["peak_gflops_by_threads"][std::to_string(t)] = g;
    j["bandwidth_gbs"] = ctx.bandwidth.begin()->second;
    for (auto [t, b] : ctx.bandwidth) j["bandwidth_gbs_by_threads"][std::to_string(t)] = b;
    j["anchor_environment"] = bench::anchor_environment();
    j["gemm_transpose"] = gemm::transpose_variant_name(gemm::transpose_variant());
    json_machine(ctx, j);
    j["results"] = nlohmann::json::array();
    for (const auto &r : rows) {
        nlohmann::json o = {{"suite", r.suite}, {"name", r.suite + "/" + r.name}, {"shape", r.shape},
                            {"threads", r.threads}, {"ms", r.ms}};
        o[r.unit == "GFLOP/s" ? "gflops" : r.unit == "GB/s" ? "gbs" : "gelem_per_s"] = r.rate;
        o["peak_fraction"] = r.peak_fraction >= 0 ? nlohmann::json(r.peak_fraction) : nlohmann::json(nullptr);
        if (r.peak_in_row > 0 && r.unit == "GFLOP/s") {
            o["peak_gflops_in_row"] = r.peak_in_row;
            o["peak_fraction_startup"] = r.rate / ctx.peak.at(r.threads);
        }
        if (r.peak_in_row > 0 && r.unit == "GB/s") {
            o["bandwidth_gbs_in_row"] = r.peak_in_row;
            o["peak_fraction_startup"] = r.rate / ctx.bandwidth.at(r.threads);
        }
        for (const auto &[n, v] : r.vs) o["vs"][n] = v;
        o["cpu_per_wall"] = r.cpu_per_wall;
        for (const auto &a : r.anchor_cpu) {
            o["anchor_cpu_per_wall"][a.name] = a.cpu_per_wall;
            o["anchor_valid"][a.name] = a.valid;
        }
        for (const auto &[n, eq] : r.same_bits) o["same_bits"][n] = eq;
        for (const auto &[key, val] : r.extra.items()) o[key] = val;
        if (r.part_ms >= 0) {
            o["attention_ms"] = r.part_ms;
            o["projection_ms"] = r.ms - r.part_ms;
        }
        j["results"].push_back(o);
    }
    std::printf("%s\n", j.dump(2).c_str());
}

#ifdef MHA_WITH_MPI
// ---- mpi: the layer's heads sharded over the ranks of mpirun -np N (mha::TpLayer) -------------
//
// Per shape and threads per rank: the time of one sharded forward (the slowest rank's, every run
// started together after a barrier; the median of the runs), the share of it the ranks spent in MPI
// (the status agreement, the exchange of the partial sums and the all-gather; waiting for a slower
// rank counts), and the speed-up over one rank: the unsharded mha::Layer on rank 0 with as many
// threads, while the other ranks wait without spinning.

// Waits for every rank at a barrier without busy-polling (OpenMPI's blocking calls spin, which would
// take a core from the rank being timed).
void idle_barrier(MPI_Comm comm) {
    MPI_Request req;
    MPI_Ibarrier(comm, &req);
    for (int done = 0;;) {
        MPI_Test(&req, &done, MPI_STATUS_IGNORE);
        if (done) return;
        std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
}

double seconds_now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

// `runs` timed calls of fn on every rank, each started together: the median over runs of the
// slowest rank's time.
double median_collective(MPI_Comm comm, int runs, const std::function<void()> &fn) {
    std::vector<double> t;
    for (int r = 0; r < runs; ++r) {
        MPI_Barrier(comm);
        const double t0 = seconds_now();
        fn();
        double dt = seconds_now() - t0;
        MPI_Allreduce(MPI_IN_PLACE, &dt, 1, MPI_DOUBLE, MPI_MAX, comm);
        t.push_back(dt);
    }
    return median_of(t);
}

int run_mpi_suite(const Context &ctx, const std::regex *filter) {
    int rank = 0, size = 1;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    const std::vector<int> threads_list = ctx.opt.threads_given ? ctx.opt.threads : std::vector<int>{1};
    const bench::LayerShape shapes[] = {{1, 2048, 512, 8, true}, {1, 512, 512, 8, true}, {4, 256, 512, 8, false},
                                        {1, 4096, 1024, 16, false}};
    std::vector<Row> rows;
    for (const auto &s : shapes) {
        const std::string shape = s.str() + " np" + std::to_string(size);
        if ((ctx.opt.quick && !s.quick) || (filter && !std::regex_search("mpi/forward/" + shape, *filter))) continue;
        for (int threads : threads_list) {
            if (rank == 0) std::fprintf(stderr, "mpi %s threads=%d\n", shape.c_str(), threads);
            Runtime rt(RuntimeOptions{threads, {}, {}, {}});
            bench::LayerFixture f(rt, s);
            LayerConfig c;
            c.embed_dim = s.embed;
            c.num_heads = s.heads;
            TpLayer tp(rt, MPI_COMM_WORLD, c,
                       LayerWeights::from_in_proj(c, f.w_in.data(), f.b_in.data(), f.w_out.data(), f.b_out.data()));
            std::vector<float> out(f.out.size());
            auto sharded = [&] { tp.forward(rt, f.forward_params, f.x.data(), nullptr, nullptr, out.data()); };

            // One rank alone: rank 0 runs the unsharded layer; the others wait without spinning.
            double one_ms = 0;
            if (rank == 0) {
                f.forward(rt);  // warm-up
                one_ms = bench::time_median([&] { f.forward(rt); }, ctx.budget_s()) * 1e3;
            }
            idle_barrier(MPI_COMM_WORLD);
            MPI_Bcast(&one_ms, 1, MPI_DOUBLE, 0, MPI_COMM_WORLD);

            sharded();  // warm-up (and the buffers)
            const int runs = std::clamp(static_cast<int>(ctx.budget_s() / std::max(one_ms * 1e-3 / size, 1e-4)), 3, 200);
            tp.reset_timing();
            const double ms = median_collective(MPI_COMM_WORLD, runs, sharded) * 1e3;
            const TpTiming t = tp.timing();
            double share = t.seconds > 0 ? t.comm_seconds / t.seconds : 0, worst_share = share;
            const double wait_share = t.seconds > 0 ? t.wait_seconds / t.seconds : 0;
            MPI_Allreduce(MPI_IN_PLACE, &worst_share, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
            double diff = 0;  // against the unsharded layer's output, as a sanity check (the bound is the tests')
            for (size_t i = 0; i < out.size(); ++i) diff = std::max(diff, std::abs(static_cast<double>(out[i]) - f.out[i]));

            Row r{"mpi", "forward", shape, threads, ms, s.flops() / (ms * 1e-3) * 1e-9, "GFLOP/s", -1, {}};
            r.vs.emplace_back("1 rank", one_ms / ms);
            char note[200];
            std::snprintf(note, sizeof note,
                          "communication %.1f%% (of it waiting for the slowest rank %.1f%%; worst rank %.1f%%), max |out - 1 "
                          "rank| %.2g",
                          100 * share, 100 * wait_share, 100 * worst_share, diff);
            r.note = note;
            r.extra = {{"ranks", size}, {"one_rank_ms", one_ms}, {"speedup", one_ms / ms}, {"comm_share", share},
                       {"wait_share", wait_share}, {"comm_share_worst_rank", worst_share}, {"runs", runs},
                       {"max_abs_diff_vs_one_rank", diff}};
            rows.push_back(r);
        }
    }
    if (rank != 0) return 0;
    if (ctx.opt.json) {
        nlohmann::json j;
        j["suite"] = "mpi";
        j["ranks"] = size;
        json_machine(ctx, j);
        j["results"] = nlohmann::json::array();
        for (const auto &r : rows) {
            nlohmann::json o = {{"suite", r.suite}, {"name", r.suite + "/" + r.name}, {"shape", r.shape},
                                {"threads", r.threads}, {"ms", r.ms}, {"gflops", r.rate}};
            for (const auto &[key, val] : r.extra.items()) o[key] = val;
            j["results"].push_back(o);
        }
        std::printf("%s\n", j.dump(2).c_str());
        return 0;
    }
    std::printf("mha-bench --mpi%s: %d rank%s\n", ctx.opt.quick ? " --quick" : "", size, size > 1 ? "s" : "");
    print_machine(ctx);
    std::printf("\n%-9s %-10s %-24s %7s %10s %12s %11s\n", "suite", "name", "shape", "threads", "ms", "rate", "vs 1 rank");
    for (const auto &r : rows)
        std::printf("%-9s %-10s %-24s %7d %10.3f %7.2f GF/s %10.2fx   %s\n", r.suite.c_str(), r.name.c_str(), r.shape.c_str(),
                    r.threads, r.ms, r.rate, r.vs[0].second, r.note.c_str());
    std::printf("\nms = one sharded forward, the slowest rank's time (runs started together), median of the runs;\n"
                "threads = per rank; vs 1 rank = the unsharded layer's time on one rank of as many threads / ms (the\n"
                "speed-up); communication = the share of the forward spent in MPI calls on rank 0, of which waiting =\n"
                "the status agreement, the first call after its heads are done (mostly waiting for the slowest rank:\n"
                "imbalance, not the exchange), and the largest share over the ranks. GF/s counts the whole layer's work.\n");
    return 0;
}
#endif

} // namespace

int main(int argc, char **argv) {
    bench::ensure_anchor_environment(argv);
    Context ctx;
    try {
        ctx.opt = cli::parse_bench_args(cli::args_of(argc, argv));
        if (ctx.opt.help) {
            std::fputs(cli::kBenchUsage, stdout);
            return 0;
        }
        gemm::apply_transpose_env();  // the runtimes would; read now, so the output names it whatever runs
        // Under mpirun (or with --mpi) the mpi suite runs alone: the other suites on every rank at
        // once would measure nothing but the ranks' contention.
        const bool launched = std::getenv("OMPI_COMM_WORLD_SIZE") || std::getenv("PMI_SIZE") || std::getenv("PMIX_RANK");
        if (ctx.opt.mpi || launched) {
#ifdef MHA_WITH_MPI
            std::unique_ptr<std::regex> filter;
            if (!ctx.opt.filter.empty()) filter = std::make_unique<std::regex>(ctx.opt.filter);
            MPI_Init(&argc, &argv);
            int code = 0;
            try {
                describe_machine(ctx);  // after MPI_Init, which may pin the rank (TBB reads the mask once)
                code = run_mpi_suite(ctx, filter.get());
            } catch (const std::exception &e) {
                std::fprintf(stderr, "mha-bench: %s\n", e.what());
                code = 1;
            }
            MPI_Finalize();
            return code;
#else
            throw cli::UsageError("the mpi suite needs an mha-bench built with MPI (meson -Dmpi=enabled, OpenMPI)");
#endif
        }
        describe_machine(ctx);
        std::unique_ptr<std::regex> filter;
        if (!ctx.opt.filter.empty()) filter = std::make_unique<std::regex>(ctx.opt.filter);
        std::fprintf(stderr, "measuring the FMA peak and the read bandwidth...\n");
        for (int t : ctx.opt.threads) {
            ctx.peak[t] = bench::measure_fma_peak_gflops(t);
            ctx.bandwidth[t] = bench::measure_read_bandwidth_gbs(t);
        }
        std::vector<Row> rows;
        suite_gemm(ctx, filter.get(), rows);
        suite_softmax(ctx, filter.get(), rows);
        suite_attention(ctx, filter.get(), rows);
        suite_decode(ctx, filter.get(), rows);
        suite_layer(ctx, filter.get(), rows);
        suite_serving(ctx, filter.get(), rows);
        suite_encoder(ctx, filter.get(), rows);
        suite_variants(ctx, filter.get(), rows);
        suite_threads(ctx, filter.get(), rows);
        if (ctx.opt.json)
            print_json(ctx, rows);
        else
            print_table(ctx, rows);
    } catch (const std::exception &e) {
        std::fprintf(stderr, "mha-bench: %s\n\n%s", e.what(), cli::kBenchUsage);
        return 2;
    }
    return 0;
}
