// mha-tune: searches tile parameters on this machine and writes the tile config the runtime reads.
//
// Like Highway's auto_tune, it only tries candidates that fit the caches it detects, and measures
// each on the shapes that matter: the layer's projection GEMMs (E 512) and its attention, a decode
// step, few-row products, small calls. Each candidate is timed interleaved with the tiles it would
// replace (candidate, baseline, candidate, ...), so the noise of a shared machine falls on both
// alike, and scored by the geometric mean of its speedups.
// The GEMM blocking is searched first (microkernel, KC, NC, MC), then the attention tiles on the
// best GEMM blocking, then the per-CPU choices on the tiles found so far: the rows a strip must
// have at most to walk a B past L2 8 rows at a time (sup_chain_rows, on few-row products); the
// register transpose of the transposing packs and of few rows against B^T (transpose, on the
// products and attention that transpose); and,
// tuning for more than one thread, the work from which a call takes the arena's other threads
// (parallel_min_flops on small GEMM and attention calls and on one row against a large B^T,
// parallel_min_elems on softmax calls, each made after the workers have gone to sleep).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <fstream>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "bench/bench_support.hpp"
#include "cli_args.hpp"
#include "gemm/sgemm_kernels.hpp"
#include "mha/attention.hpp"
#include "mha/gemm.hpp"
#include "mha/softmax.hpp"
#include "mha/tile_config.hpp"

using namespace mha;

namespace {

// One benchmark shape: runs the work on a runtime, in the search phase it belongs to.
struct Shape {
    std::string name;
    std::string phase;  // "gemm", "attention", "rows", "transpose", "threads" or "elems"
    std::function<void(Runtime &)> run;
    // Scored in the gemm phase too: the microkernel found there also runs the attention (with
    // 8x48, the attention ran 0.62-0.84x the default's on Zen 5 while the projections gained).
    bool kernel_probe = false;
    // Scored in the transpose phase too: the call transposes in registers (B^T's or K^T's pack).
    bool transposes = false;
};

bool scored_in(const Shape &s, const std::string &phase) {
    return s.phase == phase || (phase == "gemm" && s.kernel_probe) || (phase == "transpose" && s.transposes);
}

// The threads and elems phases time each call after this much work on the calling thread, so the arena's
// workers have gone to sleep as between a server's calls (they sleep after about 100 us idle on
// the machines measured; see tile_config.cpp).
constexpr auto kIdleGap = std::chrono::microseconds(300);

void busy_gap() {
    const auto until = std::chrono::steady_clock::now() + kIdleGap;
    while (std::chrono::steady_clock::now() < until) {
    }
}

// A candidate replaces the defaults only if it is this much faster: smaller gains are noise here.
constexpr double kMinGain = 1.02;

struct Measured {
    std::string phase;
    TileConfig tiles;
    std::vector<double> ms, baseline_ms;  // the candidate's, and the tiles' it would replace
    double score = 0;  // geometric mean of baseline_ms / ms
};

std::vector<Shape> make_shapes(bool quick, int threads, std::vector<std::vector<float>> &store) {
    std::vector<Shape> shapes;
    auto buffer = [&](size_t n, float v) -> float * {
        store.emplace_back(n, v);
        return store.back().data();
    };
    // C = A op(B) (B^T with transposed_b), named "gemm MxNxK NT" unless named.
    auto gemm_shape = [&](int64_t m, int64_t n, int64_t k, bool transposed_b, const char *phase, bool transposes = false,
                          std::string name = "") {
        const float *a = buffer(static_cast<size_t>(m * k), 0.5f), *b = buffer(static_cast<size_t>(k * n), 0.25f);
        float *c = buffer(static_cast<size_t>(m * n), 0.0f);
        if (name.empty())
            name = "gemm " + std::to_string(m) + "x" + std::to_string(n) + "x" + std::to_string(k) + (transposed_b ? " NT" : " NN");
        const Trans tb = transposed_b ? Trans::T : Trans::N;
        const int64_t ldb = transposed_b ? k : n;
        shapes.push_back({name, phase, [=](Runtime &rt) { sgemm(rt, Trans::N, tb, m, n, k, 1.0f, a, k, b, ldb, 0.0f, c, n); },
                          false, transposes});
    };
    // Attention over one sequence (q_len queries, kv_len keys), its name given.
    auto attention_shape = [&](std::string name, const char *phase, int64_t q_len, int64_t kv_len, int64_t heads,
                               int64_t kv_heads, int64_t dim, bool causal, bool kernel_probe, bool transposes) {
        const float *q = buffer(static_cast<size_t>(q_len * heads * dim), 0.01f);
        const float *k = buffer(static_cast<size_t>(kv_len * kv_heads * dim), 0.02f);
        const float *v = buffer(static_cast<size_t>(kv_len * kv_heads * dim), 0.5f);
        float *o = buffer(static_cast<size_t>(q_len * heads * dim), 0.0f);
        AttentionParams p;
        p.batch = 1;
        p.q_len = q_len;
        p.kv_len = kv_len;
        p.num_heads = heads;
        p.num_kv_heads = kv_heads;
        p.head_dim = p.value_dim = dim;
        p.causal = causal;
        shapes.push_back({std::move(name), phase, [=](Runtime &rt) { attention(rt, p, q, k, v, o); }, kernel_probe, transposes});
    };
    // Self-attention at H 8, D 64 over one sequence of len tokens.
    auto layer_attention = [&](int64_t len, bool causal, const char *phase, bool probe_and_transposes) {
        attention_shape("attention L" + std::to_string(len) + " H8 D64" + (causal ? " causal" : ""), phase, len, len, 8, 8,
                        64, causal, probe_and_transposes, probe_and_transposes);
    };
    // Projections of an E = 512 layer: Q, K and V in one GEMM, and the output projection.
    struct G {
        int64_t m, n, k;
    };
    std::vector<G> gemms = {{2048, 1536, 512}, {1024, 512, 512}};
    if (!quick) gemms.push_back({512, 1536, 512});
    for (const G g : gemms) gemm_shape(g.m, g.n, g.k, true, "gemm", true);
    // Attention of the same layer.
    std::vector<std::pair<int64_t, bool>> attn = {{1024, false}};
    if (!quick) {
        attn.push_back({2048, false});
        attn.push_back({2048, true});
    }
    for (auto [len, causal] : attn) layer_attention(len, causal, "attention", len == 1024);
    // And a decode step (one query over 4096 cached tokens, H32 over 8 KV heads, D128), whose tiles
    // follow the same attn_block_k (a row's bits depend on the tile boundaries, so prefill and decode
    // share it). Xeon (model 207), 1 thread, BK 512 against 256: prefill L1024-2048 D64 1.01-1.03x,
    // this step 0.99x, the paged-cache decode of mha-bench's serving suite (B16) 0.96-0.99x.
    attention_shape("decode Lk4096 H32/8 D128", "attention", 1, 4096, 32, 8, 128, false, false, false);
    // Few rows (decode's projections) against a B past L2, its rows not a multiple of 4 KiB apart
    // (where sup_chain_rows decides between the chain and the tiles; 4 KiB strides always chain).
    std::vector<G> rows = {{1, 2000, 2000}, {2, 3000, 768}, {4, 1500, 1000}};
    if (!quick) {
        rows.push_back({3, 2000, 2000});
        rows.push_back({6, 2000, 1000});
    }
    for (const G g : rows) gemm_shape(g.m, g.n, g.k, false, "rows");
    // Few rows against B^T, each row count transposing its blocks in registers (macro_bt_rows: 5 to 9
    // rows on AVX-512, 5 to 8 on AVX2): decode's projections, B^T from L3.
    for (const int64_t m : quick ? std::vector<int64_t>{8} : std::vector<int64_t>{6, 8}) gemm_shape(m, 1536, 512, true, "transpose");
    if (threads == 1) return shapes;
    // Small calls around the break-even of a second thread: sgemm n^3 (4.2 to 33.5 MFLOP) and
    // attention H8 D64 (4.7 to 18.9 MFLOP).
    for (const int64_t n : quick ? std::vector<int64_t>{128, 192} : std::vector<int64_t>{128, 160, 192, 256})
        gemm_shape(n, n, n, false, "threads", false, "gemm " + std::to_string(n) + "^3 NN");
    for (const int64_t len : quick ? std::vector<int64_t>{64} : std::vector<int64_t>{48, 64, 96})
        layer_attention(len, false, "threads", false);
    // Calls that read more than they compute, whose stream the same key prices
    // (RuntimeState::work_with_stream): one row against B^T n x 512, 0.5 to 1 million floats.
    for (const int64_t n : quick ? std::vector<int64_t>{1536} : std::vector<int64_t>{1024, 1536, 2048})
        gemm_shape(1, n, 512, true, "threads");
    // Elementwise work around its break-even: softmax over 128 columns, 64K to 1M elements.
    for (const int64_t rows : quick ? std::vector<int64_t>{1024, 4096} : std::vector<int64_t>{512, 1024, 2048, 4096, 8192}) {
        const float *x = buffer(static_cast<size_t>(rows * 128), 0.5f);
        float *y = buffer(static_cast<size_t>(rows * 128), 0.0f);
        shapes.push_back({"softmax " + std::to_string(rows) + "x128", "elems",
                          [=](Runtime &rt) { softmax(rt, rows, 128, x, 128, y, 128); }});
    }
    return shapes;
}

// GEMM blocking candidates that fit the caches: KC so the MR x KC and KC x NR micro-panels fill
// 1/2 to 5/4 of L1, or so the MR x KC micro-panel alone fills 1/2 or 3/4 of it (B streaming from
// L2 beside it, where the AVX-512 defaults were measured best: see tile_config.cpp); NC so the
// KC x NC block takes 1/4 to 3/4 of L2, MC a quarter or an eighth of L3.
std::vector<int64_t> kc_candidates(const gemm::SgemmKernel &uk, int64_t l1d, bool quick) {
    std::vector<int64_t> kcs;
    auto add = [&](double share, int64_t floats_per_step) {  // KC 768 at most: deeper was no better where measured
        const int64_t kc = std::clamp<int64_t>(static_cast<int64_t>(share * static_cast<double>(l1d)) / (floats_per_step * 4) / 8 * 8, 32, 768);
        if (std::find(kcs.begin(), kcs.end(), kc) == kcs.end()) kcs.push_back(kc);
    };
    for (double l1 : quick ? std::vector<double>{0.5, 0.75, 1.0} : std::vector<double>{0.5, 0.75, 1.0, 1.25}) add(l1, uk.mr + uk.nr);
    for (double l1 : quick ? std::vector<double>{0.75} : std::vector<double>{0.5, 0.75}) add(l1, uk.mr);
    return kcs;
}

// Where caches are large several of the sizes above clamp to one value (Xeon model 207, L3 260
// MiB: MC 4088 for a quarter and an eighth of L3 alike, half of the list twice), so a candidate
// joins the list only once.
void add_unique(std::vector<TileConfig> &out, const TileConfig &t) {
    if (std::find(out.begin(), out.end(), t) == out.end()) out.push_back(t);
}

std::vector<TileConfig> gemm_candidates(Isa isa, const CacheSizes &c, const TileConfig &def, bool quick) {
    std::vector<TileConfig> out;
    const int64_t def_nr = gemm::find_sgemm_kernel(def.gemm_ukernel)->nr;
    for (const auto &uk : gemm::all_sgemm_kernels()) {
        if (uk.isa != isa) continue;
        for (const int64_t kc : kc_candidates(uk, c.l1d, quick)) {
            for (double l2 : quick ? std::vector<double>{0.5} : std::vector<double>{0.25, 0.5, 0.75}) {
                TileConfig t = def;
                t.gemm_ukernel = uk.name;
                t.kc = kc;
                t.nc = std::max<int64_t>(uk.nr, static_cast<int64_t>(l2 * static_cast<double>(c.l2)) / (kc * 4) / uk.nr * uk.nr);
                for (int l3_div : quick ? std::vector<int>{4} : std::vector<int>{4, 8}) {
                    t.mc = std::clamp<int64_t>(c.l3 / l3_div / (kc * 4) / uk.mr * uk.mr, uk.mr, 4096 / uk.mr * uk.mr);
                    t.sup_max_k = kc;
                    t.sup_max_n = def.sup_max_n / def_nr * uk.nr;  // the default's panels (AVX-512 2, AVX2 16)
                    t.attn_block_q = 8 * uk.mr;  // the default's rule for this kernel's MR
                    add_unique(out, t);
                }
            }
        }
    }
    return out;
}

// Attention tiles that fit L2: a (group x BQ) x BK score tile plus BK x D packed K and V tiles.
std::vector<TileConfig> attention_candidates(const CacheSizes &c, const TileConfig &best_gemm, bool quick) {
    const auto *uk = gemm::find_sgemm_kernel(best_gemm.gemm_ukernel);
    std::vector<TileConfig> out;
    for (int64_t q_panels : quick ? std::vector<int64_t>{4, 8, 16} : std::vector<int64_t>{2, 4, 6, 8, 12, 16})
        for (int64_t bk : quick ? std::vector<int64_t>{128, 256} : std::vector<int64_t>{64, 128, 256, 512}) {
            const int64_t bq = q_panels * uk->mr, d = 128;  // size the fit for D up to 128
            if ((bq * bk + 2 * bk * d + bq * d) * 4 > c.l2) continue;
            TileConfig t = best_gemm;
            t.attn_block_q = bq;
            t.attn_block_k = bk;
            t.attn_kv_chunk = std::max<int64_t>(1024, bk) / bk * bk;
            add_unique(out, t);
        }
    return out;
}

// Candidates that set one key of `base` to each of `values` (leaving out the value it has).
std::vector<TileConfig> key_candidates(const TileConfig &base, int64_t TileConfig::*key, const std::vector<int64_t> &values) {
    std::vector<TileConfig> out;
    for (const int64_t v : values) {
        if (v == base.*key) continue;
        TileConfig t = base;
        t.*key = v;
        out.push_back(t);
    }
    return out;
}

// The register transpose other than base's (transpose_variant.hpp: shuffles or inserts).
std::vector<TileConfig> transpose_candidates(const TileConfig &base) {
    TileConfig t = base;
    t.transpose = base.transpose == "inserts" ? "shuffles" : "inserts";
    return {t};
}

// The threshold steps' candidates: the rows that take sup_chain_rows' walk (none, or up to 6);
// the work (flops) from which a GEMM or attention call takes the arena's other threads (2 to 32
// MFLOP); the elements from which elementwise work (softmax, LayerNorm) does (64K to 1M).
std::vector<TileConfig> rows_candidates(const TileConfig &base, bool quick) {
    return key_candidates(base, &TileConfig::sup_chain_rows, quick ? std::vector<int64_t>{0, 1, 2, 4} : std::vector<int64_t>{0, 1, 2, 3, 4, 6});
}
std::vector<TileConfig> threads_candidates(const TileConfig &base, bool quick) {
    std::vector<int64_t> flops;
    for (const int64_t mflop : quick ? std::vector<int64_t>{4, 16} : std::vector<int64_t>{2, 4, 8, 16, 32}) flops.push_back(mflop << 20);
    return key_candidates(base, &TileConfig::parallel_min_flops, flops);
}
std::vector<TileConfig> elems_candidates(const TileConfig &base, bool quick) {
    std::vector<int64_t> elems;
    for (const int64_t k : quick ? std::vector<int64_t>{128, 512} : std::vector<int64_t>{64, 128, 256, 512, 1024}) elems.push_back(k << 10);
    return key_candidates(base, &TileConfig::parallel_min_elems, elems);
}

std::string describe(const std::string &phase, const TileConfig &t) {
    char buf[160];
    if (phase == "gemm")
        std::snprintf(buf, sizeof buf, "%s mc=%ld kc=%ld nc=%ld", t.gemm_ukernel.c_str(), static_cast<long>(t.mc),
                      static_cast<long>(t.kc), static_cast<long>(t.nc));
    else if (phase == "attention")
        std::snprintf(buf, sizeof buf, "block_q=%ld block_k=%ld", static_cast<long>(t.attn_block_q),
                      static_cast<long>(t.attn_block_k));
    else if (phase == "rows")
        std::snprintf(buf, sizeof buf, "sup_chain_rows=%ld", static_cast<long>(t.sup_chain_rows));
    else if (phase == "transpose")
        std::snprintf(buf, sizeof buf, "transpose=%s", t.transpose.c_str());
    else if (phase == "threads")
        std::snprintf(buf, sizeof buf, "parallel_min_flops=%ld", static_cast<long>(t.parallel_min_flops));
    else
        std::snprintf(buf, sizeof buf, "parallel_min_elems=%ld", static_cast<long>(t.parallel_min_elems));
    return buf;
}

// Times the shape on two runtimes, interleaved; the threads and elems phases after an idle gap each call.
std::vector<double> time_pair(const Shape &s, Runtime &a, Runtime &b, double budget) {
    const bool gap = s.phase == "threads" || s.phase == "elems";
    return bench::time_interleaved({[&] { s.run(a); }, [&] { s.run(b); }}, budget, 3, nullptr,
                                   gap ? std::function<void()>(busy_gap) : nullptr);
}

void progress(int done, int total, const std::string &what) {
    const int width = 30, filled = total ? done * width / total : width;
    std::fprintf(stderr, "\r[%s%s] %3d/%d %-60s", std::string(static_cast<size_t>(filled), '#').c_str(),
                 std::string(static_cast<size_t>(width - filled), '.').c_str(), done, total, what.substr(0, 60).c_str());
    if (done == total) std::fprintf(stderr, "\n");
    std::fflush(stderr);
}

// Times each candidate against `baseline` (the tiles it would replace: the defaults for the GEMM
// blocking, the tiles found before them for the later steps) on the shapes its phase scores.
void search(const std::string &phase, const std::vector<TileConfig> &candidates, const std::vector<Shape> &shapes,
            const RuntimeOptions &base, const TileConfig &baseline, double budget,
            std::vector<Measured> &all, int &done, int total) {
    Runtime baseline_rt([&] { RuntimeOptions o = base; o.tiles = baseline; return o; }());
    for (const auto &t : candidates) {
        Measured m{phase, t, {}, {}, 0};
        RuntimeOptions o = base;
        o.tiles = t;
        Runtime rt(o);
        double log_sum = 0;
        int n = 0;
        for (const auto &s : shapes) {
            if (!scored_in(s, phase)) continue;
            const auto times = time_pair(s, rt, baseline_rt, budget);
            m.ms.push_back(times[0] * 1e3);
            m.baseline_ms.push_back(times[1] * 1e3);
            log_sum += std::log(times[1] / times[0]);
            ++n;
        }
        m.score = std::exp(log_sum / std::max(1, n));
        all.push_back(m);
        progress(++done, total, phase + " " + describe(phase, t) + " " + std::to_string(m.score).substr(0, 5) + "x");
    }
}

// --list: each search's candidates (the later searches' as they would be on the defaults) and the
// shapes that score them, and about how long measuring them all would take: each candidate times
// each of its shapes for `budget` seconds, the verdict every shape for twice that (a shape of short
// calls after an idle gap may stop sooner, at time_interleaved's 1000 rounds).
void list_searches(const std::vector<Shape> &shapes, double budget,
                   const std::vector<std::pair<std::string, std::vector<TileConfig>>> &searches) {
    double seconds = 0;
    for (const auto &[phase, candidates] : searches) {
        std::vector<std::string> names;
        for (const auto &s : shapes)
            if (scored_in(s, phase)) names.push_back(s.name);
        if (candidates.empty() || names.empty()) continue;
        std::printf("%s: %zu candidate%s, each timed on", phase.c_str(), candidates.size(), candidates.size() == 1 ? "" : "s");
        for (size_t i = 0; i < names.size(); ++i) std::printf("%s %s", i ? "," : "", names[i].c_str());
        std::printf("\n");
        for (const auto &t : candidates) std::printf("  %s\n", describe(phase, t).c_str());
        seconds += static_cast<double>(candidates.size() * names.size()) * budget;
    }
    seconds += static_cast<double>(shapes.size()) * 2 * budget;
    if (seconds < 120)
        std::printf("about %.0f seconds of measuring\n", seconds);
    else
        std::printf("about %.0f minutes of measuring\n", seconds / 60);
}

std::string now_utc() {
    const std::time_t t = std::time(nullptr);
    char buf[32];
    std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&t));
    return buf;
}

int tune(const cli::TuneOptions &o) {
    RuntimeOptions base;
    base.num_threads = o.threads;
    const Runtime probe(base);  // the ISA (MHA_ISA respected) and the defaults, or the config in force
    const Isa isa = probe.isa();
    const CacheSizes caches = detect_cache_sizes();
    const TileConfig def = default_tile_config(isa, caches);
    std::fprintf(stderr, "mha-tune: %s, %s, L1d %ld KiB, L2 %ld KiB, L3 %ld MiB, %d thread%s%s\n", cpu_model_name().c_str(),
                 std::string(isa_name(isa)).c_str(), static_cast<long>(caches.l1d >> 10), static_cast<long>(caches.l2 >> 10),
                 static_cast<long>(caches.l3 >> 20), o.threads, o.threads > 1 ? "s" : "", o.quick ? ", quick" : "");
    // MHA_TRANSPOSE overrides the transpose of every runtime: nothing to choose between, and the
    // shapes timed for that choice alone are left out.
    const char *forced = std::getenv("MHA_TRANSPOSE");
    const bool transposes = !(forced && *forced);
    if (!transposes)
        std::fprintf(stderr, "mha-tune: MHA_TRANSPOSE=%s overrides the tiles' transpose: not searching it (the config "
                             "written records %s)\n", forced, forced);
    std::vector<std::vector<float>> store;
    auto shapes = make_shapes(o.quick, o.threads, store);
    if (!transposes) std::erase_if(shapes, [](const Shape &s) { return s.phase == "transpose"; });
    const double budget = o.quick ? 0.4 : 1.0;

    auto limit = [&](std::vector<TileConfig> v) {
        if (o.max_candidates > 0 && static_cast<int>(v.size()) > o.max_candidates) v.resize(static_cast<size_t>(o.max_candidates));
        return v;
    };
    const auto gc = limit(gemm_candidates(isa, caches, def, o.quick));
    // The later phases' candidates depend on the tiles found before them; count them for the
    // progress bar with the defaults', which give as many whenever MR is the same.
    // MHA_PARALLEL_ALWAYS=1 zeroes both thresholds in every runtime: nothing to measure.
    const char *always = std::getenv("MHA_PARALLEL_ALWAYS");
    const bool thresholds = o.threads > 1 && !(always && std::string(always) == "1");
    if (o.threads > 1 && !thresholds)
        std::fprintf(stderr, "mha-tune: MHA_PARALLEL_ALWAYS=1 overrides parallel_min_flops and parallel_min_elems: "
                             "not searching them\n");
    auto later = [&](const TileConfig &t) {
        return limit(attention_candidates(caches, t, o.quick)).size() + limit(rows_candidates(t, o.quick)).size() +
               (transposes ? limit(transpose_candidates(t)).size() : 0) +
               (thresholds ? limit(threads_candidates(t, o.quick)).size() + limit(elems_candidates(t, o.quick)).size() : 0);
    };
    if (o.list) {
        list_searches(shapes, budget, {{"gemm", gc},
                                       {"attention", limit(attention_candidates(caches, def, o.quick))},
                                       {"rows", limit(rows_candidates(def, o.quick))},
                                       {"transpose", transposes ? limit(transpose_candidates(def)) : std::vector<TileConfig>{}},
                                       {"threads", thresholds ? limit(threads_candidates(def, o.quick)) : std::vector<TileConfig>{}},
                                       {"elems", thresholds ? limit(elems_candidates(def, o.quick)) : std::vector<TileConfig>{}}});
        return 0;
    }
    const int total_guess = static_cast<int>(gc.size() + later(def));
    std::vector<Measured> all;
    int done = 0;
    search("gemm", gc, shapes, base, def, budget, all, done, total_guess);
    const auto best_gemm = std::max_element(all.begin(), all.end(), [](auto &a, auto &b) { return a.score < b.score; });
    TileConfig best = best_gemm->score > kMinGain ? best_gemm->tiles : def;
    const auto ac = limit(attention_candidates(caches, best, o.quick));
    const size_t first_attn = all.size();
    const int total = static_cast<int>(gc.size() + later(best));
    search("attention", ac, shapes, base, best, budget, all, done, total);
    auto best_of = [&](size_t first) {
        const auto it = std::max_element(all.begin() + static_cast<std::ptrdiff_t>(first), all.end(),
                                         [](auto &a, auto &b) { return a.score < b.score; });
        return it != all.end() && it->score > kMinGain ? &it->tiles : nullptr;
    };
    if (const TileConfig *t = best_of(first_attn)) {
        best.attn_block_q = t->attn_block_q;
        best.attn_block_k = t->attn_block_k;
        best.attn_kv_chunk = t->attn_kv_chunk;
    }
    // The per-CPU choices, each against the tiles found so far (the defaults, unless a step above
    // changed them), so a score is the key's own effect.
    const size_t first_rows = all.size();
    search("rows", limit(rows_candidates(best, o.quick)), shapes, base, best, budget, all, done, total);
    if (const TileConfig *t = best_of(first_rows)) best.sup_chain_rows = t->sup_chain_rows;
    if (transposes) {
        const size_t first_transpose = all.size();
        search("transpose", limit(transpose_candidates(best)), shapes, base, best, budget, all, done, total);
        if (const TileConfig *t = best_of(first_transpose)) best.transpose = t->transpose;
    }
    if (thresholds) {
        const size_t first_threads = all.size();
        search("threads", limit(threads_candidates(best, o.quick)), shapes, base, best, budget, all, done, total);
        if (const TileConfig *t = best_of(first_threads)) best.parallel_min_flops = t->parallel_min_flops;
        const size_t first_elems = all.size();
        search("elems", limit(elems_candidates(best, o.quick)), shapes, base, best, budget, all, done, total);
        if (const TileConfig *t = best_of(first_elems)) best.parallel_min_elems = t->parallel_min_elems;
    }

    // The verdict: the best candidate against the defaults on every shape, measured once more. The
    // phases each judged their keys on their own shapes; the whole set must also beat the defaults
    // over all of them (the geometric mean), or the defaults are written.
    std::printf("mha-tune: best tiles for %s (%s), %d thread%s\n", cpu_model_name().c_str(), std::string(isa_name(isa)).c_str(),
                o.threads, o.threads > 1 ? "s" : "");
    auto all_keys = [&](const TileConfig &t) {
        std::string d = describe("gemm", t) + " " + describe("attention", t) + " " + describe("rows", t) + " " +
                        describe("transpose", t);
        return o.threads > 1 ? d + " " + describe("threads", t) + " " + describe("elems", t) : d;
    };
    std::printf("  default: %s\n  best:    %s\n\n", all_keys(def).c_str(), all_keys(best).c_str());
    std::printf("%-32s %12s %12s %9s\n", "shape", "default ms", "best ms", "speedup");
    {
        RuntimeOptions ob = base, od = base;
        ob.tiles = best;
        od.tiles = def;
        Runtime best_rt(ob), def_rt(od);
        double log_sum = 0;
        for (const auto &s : shapes) {
            const auto t = time_pair(s, best_rt, def_rt, 2 * budget);
            std::printf("%-32s %12.3f %12.3f %8.2fx\n", s.name.c_str(), t[1] * 1e3, t[0] * 1e3, t[1] / t[0]);
            log_sum += std::log(t[1] / t[0]);
        }
        const double overall = std::exp(log_sum / static_cast<double>(shapes.size()));
        std::printf("%-32s %12s %12s %8.2fx\n", "all shapes (geometric mean)", "", "", overall);
        if (overall < 1.0 && !(best == def)) {
            std::printf("\nthe tuned set is slower than the defaults over all shapes: keeping the defaults\n");
            best = def;
        }
    }
    TileConfigFile f;
    f.isa = isa;
    f.cpu = cpu_model_name();
    f.date = now_utc();
    f.tiles = best;
    if (!transposes) f.tiles.transpose = forced;  // what every measurement ran under
    parse_tile_config(tile_config_json(f), "(tuned)");  // what we write must read back
    if (!o.out.empty()) {
        std::ofstream out(o.out);
        out << tile_config_json(f);
        if (!out) throw std::runtime_error(o.out + ": cannot write the tile config");
        std::printf("\nwrote %s; use it with MHA_TILE_CONFIG=%s\n", o.out.c_str(), o.out.c_str());
    }
    if (!o.csv.empty()) {
        std::ofstream csv(o.csv);
        csv << "phase,gemm_ukernel,mc,kc,nc,attn_block_q,attn_block_k,attn_kv_chunk,sup_chain_rows,parallel_min_flops,"
               "parallel_min_elems,transpose,shape,ms,baseline_ms,speedup,score\n";
        for (const auto &m : all) {
            size_t i = 0;
            for (const auto &s : shapes) {
                if (!scored_in(s, m.phase)) continue;
                csv << m.phase << ',' << m.tiles.gemm_ukernel << ',' << m.tiles.mc << ',' << m.tiles.kc << ',' << m.tiles.nc
                    << ',' << m.tiles.attn_block_q << ',' << m.tiles.attn_block_k << ',' << m.tiles.attn_kv_chunk << ','
                    << m.tiles.sup_chain_rows << ',' << m.tiles.parallel_min_flops << ',' << m.tiles.parallel_min_elems << ','
                    << m.tiles.transpose << ",\""
                    << s.name << "\"," << m.ms[i] << ',' << m.baseline_ms[i] << ',' << m.baseline_ms[i] / m.ms[i] << ','
                    << m.score << '\n';
                ++i;
            }
        }
        if (!csv) throw std::runtime_error(o.csv + ": cannot write the CSV");
        std::printf("wrote %s (%zu candidates)\n", o.csv.c_str(), all.size());
    }
    return 0;
}

} // namespace

int main(int argc, char **argv) {
    bench::ensure_anchor_environment(argv);
    try {
        const cli::TuneOptions o = cli::parse_tune_args(cli::args_of(argc, argv));
        if (o.help) {
            std::fputs(cli::kTuneUsage, stdout);
            return 0;
        }
        return tune(o);
    } catch (const cli::UsageError &e) {
        std::fprintf(stderr, "mha-tune: %s\n\n%s", e.what(), cli::kTuneUsage);
        return 2;
    } catch (const Error &e) {
        std::fprintf(stderr, "mha-tune: %s\n", e.what());
        return 2;
    } catch (const std::exception &e) {
        std::fprintf(stderr, "mha-tune: %s\n", e.what());
        return 1;
    }
}
