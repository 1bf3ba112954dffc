// mha-bench --mpi: the layer's heads sharded over the ranks of mpirun -np N (mha::TpLayer).
// Per shape and threads per rank: the time of one sharded forward (the slowest rank's, every run
// started together after a barrier; the median of the runs), the share of it the ranks spent in MPI
// (the status agreement, the exchange of the partial sums and the all-gather; waiting for a slower
// rank counts), and the speed-up over one rank: the unsharded mha::Layer on rank 0 with as many
// threads, while the other ranks wait without spinning.
#ifdef MHA_WITH_MPI
#include <chrono>
#include <cmath>
#include <cstdio>
#include <thread>

#include "bench/layer_fixture.hpp"
#include "mha/tp_layer.hpp"

#include "bench_tool.hpp"

namespace mha::bench_tool {

namespace {

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

} // namespace

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
        if ((ctx.opt.quick && !s.quick) || !selected(filter, "mpi/forward/" + shape)) continue;
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

} // namespace mha::bench_tool
#endif
