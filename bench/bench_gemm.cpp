// GEMM throughput: mha beside oneDNN's dnnl_sgemm and OpenBLAS's cblas_sgemm on the same shapes and
// thread counts, each reported as GFLOP/s and as a fraction of the FMA peak measured here.

#include <cstdio>
#include <map>
#include <memory>

#include "bench/bench_support.hpp"
#include "bench/register.hpp"
#include "mha/gemm.hpp"

using namespace mha;

namespace {

struct Operands {
    std::vector<float> a, b, c;
    explicit Operands(const bench::GemmShape &s)
        : a(static_cast<size_t>(s.m * s.k), 0.5f), b(static_cast<size_t>(s.k * s.n), 0.25f),
          c(static_cast<size_t>(s.m * s.n), 0.0f) {}
    int64_t lda(const bench::GemmShape &s) const { return s.ta == 'N' ? s.k : s.m; }
    int64_t ldb(const bench::GemmShape &s) const { return s.tb == 'N' ? s.n : s.k; }
};

std::map<int, double> g_peak;  // threads -> GFLOP/s

enum class Impl { mha, onednn, openblas };

void run(benchmark::State &state, const bench::GemmShape &s, int threads, Impl impl) {
    Operands x(s);
    std::unique_ptr<Runtime> rt;
    std::unique_ptr<SgemmPackedB> packed;  // a weight's way: B packed once, outside the timed calls
    if (impl == Impl::mha) rt = std::make_unique<Runtime>(RuntimeOptions{threads, {}, {}, {}});
    if (rt && s.packed_b) packed = std::make_unique<SgemmPackedB>(*rt, static_cast<Trans>(s.tb), s.k, s.n, x.b.data(), x.ldb(s));
    for (auto _ : state) {
        switch (impl) {
        case Impl::mha:
            if (packed)
                sgemm(*rt, static_cast<Trans>(s.ta), s.m, 1.0f, x.a.data(), x.lda(s), *packed, 0.0f, x.c.data(), s.n);
            else
                sgemm(*rt, static_cast<Trans>(s.ta), static_cast<Trans>(s.tb), s.m, s.n, s.k, 1.0f, x.a.data(),
                      x.lda(s), x.b.data(), x.ldb(s), 0.0f, x.c.data(), s.n);
            break;
        case Impl::onednn:
            bench::dnnl_sgemm(threads, s.ta, s.tb, s.m, s.n, s.k, 1.0f, x.a.data(), x.lda(s), x.b.data(), x.ldb(s),
                              0.0f, x.c.data(), s.n);
            break;
        case Impl::openblas:
            bench::openblas_sgemm(threads, s.ta, s.tb, s.m, s.n, s.k, 1.0f, x.a.data(), x.lda(s), x.b.data(),
                                  x.ldb(s), 0.0f, x.c.data(), s.n);
            break;
        }
        benchmark::DoNotOptimize(x.c.data());
    }
    const double flops = s.flops() * static_cast<double>(state.iterations());
    state.counters["GFLOPS"] = benchmark::Counter(flops * 1e-9, benchmark::Counter::kIsRate);
    state.counters["peak_GFLOPS"] = g_peak[threads];
}

} // namespace

int main(int argc, char **argv) {
    bench::ensure_anchor_environment(argv);
    for (int threads : {1, 2}) g_peak[threads] = bench::measure_fma_peak_gflops(threads);
    std::printf("FMA peak: %.1f GFLOP/s (1 thread), %.1f GFLOP/s (2 threads); anchors: oneDNN %s, OpenBLAS %s; %s\n",
                g_peak[1], g_peak[2], bench::has_dnnl() ? "yes" : "no", bench::has_openblas() ? "yes" : "no",
                bench::anchor_environment().c_str());
    for (const auto &s : bench::gemm_shapes())
        for (int threads : {1, 2}) {
            std::vector<std::pair<const char *, Impl>> impls = {{"mha", Impl::mha}};
            if (bench::has_dnnl()) impls.push_back({"onednn", Impl::onednn});
            if (bench::has_openblas()) impls.push_back({"openblas", Impl::openblas});
            bench::register_impls("gemm", s.str(), threads, impls,
                                  [s, threads](benchmark::State &st, Impl impl) { run(st, s, threads, impl); });
        }
    benchmark::Initialize(&argc, argv);
    benchmark::RunSpecifiedBenchmarks();
    benchmark::Shutdown();
}
