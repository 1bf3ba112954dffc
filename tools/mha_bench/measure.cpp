// mha-bench: the machine a run was measured on, and the timing of a row beside its anchors.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>

#include "mha/tile_config.hpp"

#include "bench_tool.hpp"

namespace mha::bench_tool {

void describe_machine(Context &ctx) {
    const Runtime probe(RuntimeOptions{1, {}, {}, {}});
    ctx.isa = probe.isa();
    ctx.tiles = probe.tiles();
    const char *path = std::getenv("MHA_TILE_CONFIG"), *always = std::getenv("MHA_PARALLEL_ALWAYS");
    ctx.tiles_source = path && *path ? path : "defaults";
    if (always && std::string(always) == "1") ctx.tiles_source += " + MHA_PARALLEL_ALWAYS";  // thresholds 0
    if (const char *t = std::getenv("MHA_TRANSPOSE"); t && *t) ctx.tiles_source += " + MHA_TRANSPOSE";  // the transpose
    ctx.machine = bench::machine();
}

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

void print_machine(const Context &ctx) {
    const bench::Machine &m = ctx.machine;
    const TileConfig &t = ctx.tiles;
    std::printf("machine: %s (%s family %d model %d), L1d %lld KiB, L2 %lld KiB, L3 %lld MiB, %u hardware threads; "
                "ISA %s\n",
                m.cpu.c_str(), m.vendor.c_str(), m.family, m.model, static_cast<long long>(m.caches.l1d >> 10),
                static_cast<long long>(m.caches.l2 >> 10), static_cast<long long>(m.caches.l3 >> 20), m.hardware_threads,
                std::string(isa_name(ctx.isa)).c_str());
    std::printf("tiles (%s): %s MC %lld KC %lld NC %lld, small problems to N %lld or K %lld, chain rows %lld; "
                "attention BQ %lld BK %lld chunk %lld; threads from %lld FLOP / %lld elements; transpose %s\n",
                ctx.tiles_source.c_str(), t.gemm_ukernel.c_str(), static_cast<long long>(t.mc),
                static_cast<long long>(t.kc), static_cast<long long>(t.nc), static_cast<long long>(t.sup_max_n),
                static_cast<long long>(t.sup_max_k), static_cast<long long>(t.sup_chain_rows),
                static_cast<long long>(t.attn_block_q), static_cast<long long>(t.attn_block_k),
                static_cast<long long>(t.attn_kv_chunk), static_cast<long long>(t.parallel_min_flops),
                static_cast<long long>(t.parallel_min_elems), t.transpose.c_str());
}

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

double median_of(std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
}

bool selected(const std::regex *filter, const std::string &row) { return !filter || std::regex_search(row, *filter); }

} // namespace mha::bench_tool
