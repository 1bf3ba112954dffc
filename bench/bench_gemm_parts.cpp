// The GEMM taken apart: where a product's time goes, for each ISA's default microkernel on this
// CPU, at the tiles the runtime picks for it, on one thread. Each part runs back to back, so its
// operands stay as warm as they can (the whole GEMM sees them colder):
//   gemm_parts/<kernel>/ukernel  one MR x KC micro-panel of A (in L1) against eight KC x NR
//                                micro-panels of B (in L2), C += A B: the microkernel alone
//   gemm_parts/<kernel>/k_loop   the microkernel's k loop alone, A and B in L1 (a depth that fills
//                                half of L1d with both) and no C traffic: the ceiling of its
//                                register shape on this core, which the rows above can only approach
//                                (the FMA probe does no loads; this loop does MR broadcasts and NV
//                                loads a step)
//   gemm_parts/<kernel>/macro    the macro loop over a packed 1024 x KC block of A (from L3) and a
//                                KC x NC block of B (in L2), into 1024 rows of a 1024-column C:
//                                the path of a transposed A
//   gemm_parts/<kernel>/macro_in_place  the same loop reading a row-major A (lda 1024) where it
//                                lies: the path of every A stored as is (the projections)
//   gemm_parts/<kernel>/pack_a   packing 1024 x KC of a row-major A (lda 1024) into MR-row panels
//                                (what a transposed A's block costs, in the gentler layout)
//   gemm_parts/<kernel>/pack_b   packing KC x NC of a row-major B (ldb 1024) into NR-column panels
// Counters: GFLOPS and peak_fraction (of the FMA probe measured here), or GBps of the operand read.
// Against the whole GEMM (bench_gemm, mha-bench), the gap between macro_in_place and the GEMM is
// B's packing. At lda 1024 (rows 4 KiB apart, a strip's rows on one L1 set) macro_in_place reads
// about one to two pack_a times below macro; at lda 1040 level with it (Xeon, 2026-11-26: 2761 vs
// 2601 us and 2935 vs 2648 us at 1024, pack_a 162 us; 2594 vs 2610 us at 1040). The whole GEMM
// packed A once per B block (n / NC times), which reading it in place saves.

#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstdio>
#include <new>
#include <string>
#include <vector>

#include "bench/bench_support.hpp"
#include "gemm/sgemm_kernels.hpp"
#include "gemm/transpose_variant.hpp"
#include "mha/isa.hpp"
#include "mha/tile_config.hpp"

using namespace mha;

namespace {

double g_peak = 0.0;

// 64-byte aligned, as the runtime's own scratch is: a packed panel at a malloc'd 16-byte offset
// splits every B vector load across two lines (Xeon: a 14x32 loop on such a panel ran at 0.62x
// of the aligned one, and these rows read 79.8% of the probe for the microkernel, not 83.1%).
template <class T>
struct Aligned64 {
    using value_type = T;
    Aligned64() = default;
    template <class U>
    Aligned64(const Aligned64<U> &) {}
    T *allocate(size_t n) { return static_cast<T *>(::operator new(n * sizeof(T), std::align_val_t(64))); }
    void deallocate(T *p, size_t) { ::operator delete(p, std::align_val_t(64)); }
    bool operator==(const Aligned64 &) const { return true; }
};
using Floats = std::vector<float, Aligned64<float>>;

struct Parts {
    const gemm::SgemmKernel &uk;
    int64_t kc, nc;
    bool inserts;  // the tiles' register transpose (pack_a's transposes)
    static constexpr int64_t kRows = 1024, kLd = 1024, kPanels = 8;
    Floats a, b, ap, bp, c;

    Parts(const gemm::SgemmKernel &k, const TileConfig &t)
        : uk(k), kc(t.kc), nc(std::min<int64_t>(t.nc, kLd)), inserts(t.transpose == "inserts"), a(static_cast<size_t>(kRows * kLd)), b(a.size()),
          ap(static_cast<size_t>((kRows + k.mr) * t.kc)), bp(static_cast<size_t>(std::max(kLd, kPanels * k.nr) * t.kc)),
          c(static_cast<size_t>(kRows * kLd), 0.0f) {
        bench::fill_hashed(a.data(), a.size(), 1, 1.0f);
        bench::fill_hashed(b.data(), b.size(), 2, 1.0f);
        uk.pack_a(kRows, kc, a.data(), kLd, 1, ap.data(), inserts);
        uk.pack_b(nc, kc, b.data(), 1, kLd, bp.data(), inserts);
    }
};

void flops_counters(benchmark::State &state, double flops_per_call) {
    const double flops = flops_per_call * static_cast<double>(state.iterations());
    state.counters["GFLOPS"] = benchmark::Counter(flops * 1e-9, benchmark::Counter::kIsRate);
    state.counters["peak_GFLOPS"] = g_peak;
}

void bytes_counter(benchmark::State &state, double bytes_per_call) {
    state.counters["GBps"] =
        benchmark::Counter(bytes_per_call * 1e-9 * static_cast<double>(state.iterations()), benchmark::Counter::kIsRate);
}

void register_parts(const gemm::SgemmKernel &uk, const TileConfig &t) {
    auto *p = new Parts(uk, t);  // lives as long as the benchmarks
    const std::string base = std::string("gemm_parts/") + uk.name + "/";
    const std::string tiles = "/kc:" + std::to_string(t.kc) + "/nc:" + std::to_string(t.nc);
    benchmark::RegisterBenchmark((base + "ukernel" + tiles).c_str(), [p](benchmark::State &st) {
        const int64_t n = Parts::kPanels * p->uk.nr;
        for (auto _ : st) {
            p->uk.macro_packed(p->uk.mr, n, p->kc, p->ap.data(), p->bp.data(), p->c.data(), n, 1.0f, 1.0f, nullptr);
            benchmark::DoNotOptimize(p->c.data());
        }
        flops_counters(st, 2.0 * static_cast<double>(p->uk.mr * n * p->kc));
    })->UseRealTime()->Unit(benchmark::kMicrosecond);
    benchmark::RegisterBenchmark((base + "macro" + tiles).c_str(), [p](benchmark::State &st) {
        for (auto _ : st) {
            p->uk.macro_packed(Parts::kRows, p->nc, p->kc, p->ap.data(), p->bp.data(), p->c.data(), Parts::kLd, 1.0f,
                               0.0f, nullptr);
            benchmark::DoNotOptimize(p->c.data());
        }
        flops_counters(st, 2.0 * static_cast<double>(Parts::kRows * p->nc * p->kc));
    })->UseRealTime()->Unit(benchmark::kMicrosecond);
    benchmark::RegisterBenchmark((base + "macro_in_place" + tiles).c_str(), [p](benchmark::State &st) {
        for (auto _ : st) {
            p->uk.macro_in_place(Parts::kRows, p->nc, p->kc, p->a.data(), Parts::kLd, 1, p->bp.data(), p->c.data(),
                                 Parts::kLd, 1.0f, 0.0f, nullptr);
            benchmark::DoNotOptimize(p->c.data());
        }
        flops_counters(st, 2.0 * static_cast<double>(Parts::kRows * p->nc * p->kc));
    })->UseRealTime()->Unit(benchmark::kMicrosecond);
    benchmark::RegisterBenchmark((base + "pack_a" + tiles).c_str(), [p](benchmark::State &st) {
        for (auto _ : st) {
            p->uk.pack_a(Parts::kRows, p->kc, p->a.data(), Parts::kLd, 1, p->ap.data(), p->inserts);
            benchmark::DoNotOptimize(p->ap.data());
        }
        bytes_counter(st, 4.0 * static_cast<double>(Parts::kRows * p->kc));
    })->UseRealTime()->Unit(benchmark::kMicrosecond);
    benchmark::RegisterBenchmark((base + "pack_b" + tiles).c_str(), [p](benchmark::State &st) {
        for (auto _ : st) {
            p->uk.pack_b(p->nc, p->kc, p->b.data(), 1, Parts::kLd, p->bp.data(), p->inserts);
            benchmark::DoNotOptimize(p->bp.data());
        }
        bytes_counter(st, 4.0 * static_cast<double>(p->nc * p->kc));
    })->UseRealTime()->Unit(benchmark::kMicrosecond);
}

// The k_loop row of a microkernel: its loop over a depth that fills half of L1d with one packed
// panel of A and one of B, 64 passes a call.
void register_k_loop(const gemm::SgemmKernel &uk, int64_t l1d) {
    const int64_t kc = std::clamp<int64_t>(l1d / 2 / ((uk.mr + uk.nr) * 4) / 16 * 16, 16, 1024);
    auto *ab = new Floats(static_cast<size_t>((uk.mr + uk.nr) * kc));  // lives as long as the benchmarks
    bench::fill_hashed(ab->data(), ab->size(), 3, 1.0f);
    const float *a = ab->data(), *b = a + uk.mr * kc;  // B 64-byte aligned: kc % 16 == 0
    benchmark::RegisterBenchmark((std::string("gemm_parts/") + uk.name + "/k_loop/kc:" + std::to_string(kc)).c_str(),
                                 [&uk, kc, a, b](benchmark::State &st) {
        constexpr int64_t kReps = 64;
        for (auto _ : st) benchmark::DoNotOptimize(bench::k_loop_gflops(uk.isa, uk.name, kReps, kc, a, b));
        flops_counters(st, 2.0 * static_cast<double>(uk.mr * uk.nr * kc * kReps));
    })->UseRealTime()->Unit(benchmark::kMicrosecond);
}

} // namespace

int main(int argc, char **argv) {
    g_peak = bench::measure_fma_peak_gflops(1);
    const CacheSizes caches = detect_cache_sizes();
    std::printf("FMA peak: %.1f GFLOP/s (1 thread); L1d %lld KiB, L2 %lld KiB\n", g_peak,
                static_cast<long long>(caches.l1d >> 10), static_cast<long long>(caches.l2 >> 10));
    for (Isa isa : supported_isas()) {
        TileConfig t = default_tile_config(isa, caches);
        gemm::apply_transpose_env(t.transpose);  // as a runtime would
        const gemm::SgemmKernel *uk = gemm::find_sgemm_kernel(t.gemm_ukernel);
        if (uk) register_parts(*uk, t);
    }
    for (const auto &uk : gemm::all_sgemm_kernels())
        if (cpu_supports(uk.isa)) register_k_loop(uk, caches.l1d);
    benchmark::Initialize(&argc, argv);
    benchmark::RunSpecifiedBenchmarks();
    benchmark::Shutdown();
}
