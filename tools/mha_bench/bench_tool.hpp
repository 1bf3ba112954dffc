// mha-bench's pieces: the run's context, a row of the report and its anchors, the timing of a row
// beside them (measure.cpp), the suites (suite_*.cpp), and the report (report.cpp). Every row is
// measured beside its anchors in the same run and reported against the FMA peak measured at
// start-up.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <regex>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "bench/bench_support.hpp"
#include "cli_args.hpp"
#include "mha/runtime.hpp"

namespace mha::bench_tool {

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

// Fills ctx's machine, ISA and tiles (a broken MHA_TILE_CONFIG stops the run here, naming it).
void describe_machine(Context &ctx);
// The report's "machine" and "tiles" objects.
void json_machine(const Context &ctx, nlohmann::json &j);
// The same for the table's header: two lines.
void print_machine(const Context &ctx);

// Times `ours`, every anchor and a probe of the machine's peak in turn, and appends the row: the
// FMA probe for GFLOP/s rows, the read-bandwidth probe for GB/s rows. The share of the peak
// compares the row with the probe's median over the same window: on a shared machine the
// start-up peak can be 10-15% off by the time a row runs.
void measure(const Context &ctx, Row r, double work, const std::function<void()> &ours,
             const std::vector<Anchor> &anchors, std::vector<Row> &rows);

// Whether the row named `row` ("suite/name/shape") runs: there is no filter, or it matches.
bool selected(const std::regex *filter, const std::string &row);

// The median of v (of an even count, the upper of the middle two).
double median_of(std::vector<double> v);

// The largest tokens a cache block can hold on this runtime (block_tokens divides attn_block_k), so
// a capacity of round_up(len, this) per sequence always suffices.
int64_t cache_tokens_for(const Runtime &rt, int64_t len);

// The suites, in the order they run; each appends its rows (those `filter` matches, when set).
using Suite = void(Context &ctx, const std::regex *filter, std::vector<Row> &rows);
Suite suite_gemm, suite_softmax, suite_attention, suite_decode, suite_layer;  // suites_kernels.cpp
Suite suite_serving, suite_encoder, suite_variants, suite_threads;

void print_table(const Context &ctx, const std::vector<Row> &rows);
void print_json(const Context &ctx, const std::vector<Row> &rows);

#ifdef MHA_WITH_MPI
// The mpi suite (mpirun -np N mha-bench --mpi): prints its own table; returns the exit code.
int run_mpi_suite(const Context &ctx, const std::regex *filter);
#endif

} // namespace mha::bench_tool
