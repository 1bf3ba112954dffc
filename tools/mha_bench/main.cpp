// mha-bench: the benchmark suite for people choosing hardware and settings. Every row is measured
// beside its anchors in the same run and reported against the FMA peak measured at start-up.
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <regex>
#include <vector>

#include "bench_tool.hpp"
#ifdef MHA_WITH_MPI
#include <mpi.h>
#endif

using namespace mha;
using namespace mha::bench_tool;

int main(int argc, char **argv) {
    bench::ensure_anchor_environment(argv);
    Context ctx;
    try {
        ctx.opt = cli::parse_bench_args(cli::args_of(argc, argv));
        if (ctx.opt.help) {
            std::fputs(cli::kBenchUsage, stdout);
            return 0;
        }
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
