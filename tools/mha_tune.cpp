// mha-tune: searches tile parameters on this machine and writes the tile config the runtime reads.
//
// Like Highway's auto_tune, it only tries candidates that fit the caches it detects, and measures
// each on the shapes that matter: the layer's projection GEMMs (E 512) and its attention. Each
// candidate is timed interleaved with the defaults (candidate, default, candidate, ...), so the
// noise of a shared machine falls on both alike, and scored by the geometric mean of its speedups.
// The GEMM blocking is searched first (microkernel, KC, NC, MC), then the attention tiles on the
// best GEMM blocking.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
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
#include "mha/tile_config.hpp"

using namespace mha;

namespace {

// One benchmark shape: runs the work on a runtime.
struct Shape {
    std::string name;
    bool gemm;  // a GEMM shape (else attention)
    std::function<void(Runtime &)> run;
};

// A candidate replaces the defaults only if it is this much faster: smaller gains are noise here.
constexpr double kMinGain = 1.02;

struct Measured {
    std::string phase;
    TileConfig tiles;
    std::vector<double> ms, default_ms;
    double score = 0;  // geometric mean of default_ms / ms
};

std::vector<Shape> make_shapes(bool quick, std::vector<std::vector<float>> &store) {
    std::vector<Shape> shapes;
    auto buffer = [&](size_t n, float v) -> float * {
        store.emplace_back(n, v);
        return store.back().data();
    };
    // Projections of an E = 512 layer: Q, K and V in one GEMM, and the output projection.
    struct G {
        int64_t m, n, k;
    };
    std::vector<G> gemms = {{2048, 1536, 512}, {1024, 512, 512}};
    if (!quick) gemms.push_back({512, 1536, 512});
    for (const G g : gemms) {
        const float *a = buffer(static_cast<size_t>(g.m * g.k), 0.5f), *b = buffer(static_cast<size_t>(g.n * g.k), 0.25f);
        float *c = buffer(static_cast<size_t>(g.m * g.n), 0.0f);
        shapes.push_back({"gemm " + std::to_string(g.m) + "x" + std::to_string(g.n) + "x" + std::to_string(g.k) + " NT", true,
                          [=](Runtime &rt) { sgemm(rt, Trans::N, Trans::T, g.m, g.n, g.k, 1.0f, a, g.k, b, g.k, 0.0f, c, g.n); }});
    }
    // Attention of the same layer: H 8, D 64.
    std::vector<std::pair<int64_t, bool>> attn = {{1024, false}};
    if (!quick) {
        attn.push_back({2048, false});
        attn.push_back({2048, true});
    }
    for (auto [len, causal] : attn) {
        const size_t n = static_cast<size_t>(len * 8 * 64);
        const float *q = buffer(n, 0.01f), *k = buffer(n, 0.02f), *v = buffer(n, 0.5f);
        float *o = buffer(n, 0.0f);
        AttentionParams p;
        p.batch = 1;
        p.q_len = p.kv_len = len;
        p.num_heads = p.num_kv_heads = 8;
        p.head_dim = p.value_dim = 64;
        p.causal = causal;
        shapes.push_back({"attention L" + std::to_string(len) + " H8 D64" + (causal ? " causal" : ""), false,
                          [=](Runtime &rt) { attention(rt, p, q, k, v, o); }});
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

std::vector<TileConfig> gemm_candidates(Isa isa, const CacheSizes &c, const TileConfig &def, bool quick) {
    std::vector<TileConfig> out;
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
                    t.sup_max_n = 2 * uk.nr;
                    t.attn_block_q = 8 * uk.mr;  // the default's rule for this kernel's MR
                    out.push_back(t);
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
            out.push_back(t);
        }
    return out;
}

std::string describe(const std::string &phase, const TileConfig &t) {
    char buf[160];
    if (phase == "gemm")
        std::snprintf(buf, sizeof buf, "%s mc=%ld kc=%ld nc=%ld", t.gemm_ukernel.c_str(), static_cast<long>(t.mc),
                      static_cast<long>(t.kc), static_cast<long>(t.nc));
    else
        std::snprintf(buf, sizeof buf, "block_q=%ld block_k=%ld", static_cast<long>(t.attn_block_q),
                      static_cast<long>(t.attn_block_k));
    return buf;
}

void progress(int done, int total, const std::string &what) {
    const int width = 30, filled = total ? done * width / total : width;
    std::fprintf(stderr, "\r[%s%s] %3d/%d %-60s", std::string(static_cast<size_t>(filled), '#').c_str(),
                 std::string(static_cast<size_t>(width - filled), '.').c_str(), done, total, what.substr(0, 60).c_str());
    if (done == total) std::fprintf(stderr, "\n");
    std::fflush(stderr);
}

// Times each candidate against the defaults on the shapes of its phase.
void search(const std::string &phase, const std::vector<TileConfig> &candidates, const std::vector<Shape> &shapes,
            const RuntimeOptions &base, const TileConfig &def, double budget,
            std::vector<Measured> &all, int &done, int total) {
    Runtime def_rt([&] { RuntimeOptions o = base; o.tiles = def; return o; }());
    for (const auto &t : candidates) {
        Measured m{phase, t, {}, {}, 0};
        RuntimeOptions o = base;
        o.tiles = t;
        Runtime rt(o);
        double log_sum = 0;
        int n = 0;
        for (const auto &s : shapes) {
            if (s.gemm != (phase == "gemm")) continue;
            const auto times = bench::time_interleaved({[&] { s.run(rt); }, [&] { s.run(def_rt); }}, budget);
            m.ms.push_back(times[0] * 1e3);
            m.default_ms.push_back(times[1] * 1e3);
            log_sum += std::log(times[1] / times[0]);
            ++n;
        }
        m.score = std::exp(log_sum / std::max(1, n));
        all.push_back(m);
        progress(++done, total, phase + " " + describe(phase, t) + " " + std::to_string(m.score).substr(0, 5) + "x");
    }
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
    std::vector<std::vector<float>> store;
    const auto shapes = make_shapes(o.quick, store);
    const double budget = o.quick ? 0.4 : 1.0;

    auto limit = [&](std::vector<TileConfig> v) {
        if (o.max_candidates > 0 && static_cast<int>(v.size()) > o.max_candidates) v.resize(static_cast<size_t>(o.max_candidates));
        return v;
    };
    const auto gc = limit(gemm_candidates(isa, caches, def, o.quick));
    // The attention candidates depend on the best GEMM kernel; count them for the progress bar
    // with the default's, which has the same number whenever MR is the same.
    const int total_guess = static_cast<int>(gc.size() + limit(attention_candidates(caches, def, o.quick)).size());
    std::vector<Measured> all;
    int done = 0;
    search("gemm", gc, shapes, base, def, budget, all, done, total_guess);
    const auto best_gemm = std::max_element(all.begin(), all.end(), [](auto &a, auto &b) { return a.score < b.score; });
    TileConfig best = best_gemm->score > kMinGain ? best_gemm->tiles : def;
    const auto ac = limit(attention_candidates(caches, best, o.quick));
    const size_t first_attn = all.size();
    search("attention", ac, shapes, base, def, budget, all, done, static_cast<int>(gc.size() + ac.size()));
    const auto best_attn = std::max_element(all.begin() + static_cast<std::ptrdiff_t>(first_attn), all.end(),
                                            [](auto &a, auto &b) { return a.score < b.score; });
    if (best_attn != all.end() && best_attn->score > kMinGain) {
        best.attn_block_q = best_attn->tiles.attn_block_q;
        best.attn_block_k = best_attn->tiles.attn_block_k;
        best.attn_kv_chunk = best_attn->tiles.attn_kv_chunk;
    }

    // The verdict: the best candidate against the defaults on every shape, measured once more.
    std::printf("mha-tune: best tiles for %s (%s), %d thread%s\n", cpu_model_name().c_str(), std::string(isa_name(isa)).c_str(),
                o.threads, o.threads > 1 ? "s" : "");
    std::printf("  default: %s %s\n  best:    %s %s\n\n", describe("gemm", def).c_str(), describe("attention", def).c_str(),
                describe("gemm", best).c_str(), describe("attention", best).c_str());
    std::printf("%-32s %12s %12s %9s\n", "shape", "default ms", "best ms", "speedup");
    {
        RuntimeOptions ob = base, od = base;
        ob.tiles = best;
        od.tiles = def;
        Runtime best_rt(ob), def_rt(od);
        for (const auto &s : shapes) {
            const auto t = bench::time_interleaved({[&] { s.run(best_rt); }, [&] { s.run(def_rt); }}, 2 * budget);
            std::printf("%-32s %12.3f %12.3f %8.2fx\n", s.name.c_str(), t[1] * 1e3, t[0] * 1e3, t[1] / t[0]);
        }
    }
    TileConfigFile f;
    f.isa = isa;
    f.cpu = cpu_model_name();
    f.date = now_utc();
    f.tiles = best;
    parse_tile_config(tile_config_json(f), "(tuned)");  // what we write must read back
    if (!o.out.empty()) {
        std::ofstream out(o.out);
        out << tile_config_json(f);
        if (!out) throw std::runtime_error(o.out + ": cannot write the tile config");
        std::printf("\nwrote %s; use it with MHA_TILE_CONFIG=%s\n", o.out.c_str(), o.out.c_str());
    }
    if (!o.csv.empty()) {
        std::ofstream csv(o.csv);
        csv << "phase,gemm_ukernel,mc,kc,nc,attn_block_q,attn_block_k,attn_kv_chunk,shape,ms,default_ms,speedup,score\n";
        for (const auto &m : all) {
            size_t i = 0;
            for (const auto &s : shapes) {
                if (s.gemm != (m.phase == "gemm")) continue;
                csv << m.phase << ',' << m.tiles.gemm_ukernel << ',' << m.tiles.mc << ',' << m.tiles.kc << ',' << m.tiles.nc
                    << ',' << m.tiles.attn_block_q << ',' << m.tiles.attn_block_k << ',' << m.tiles.attn_kv_chunk << ",\""
                    << s.name << "\"," << m.ms[i] << ',' << m.default_ms[i] << ',' << m.default_ms[i] / m.ms[i] << ','
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
