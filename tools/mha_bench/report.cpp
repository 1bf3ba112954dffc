// mha-bench: the report, as a table or as JSON.
#include <cstdio>

#include "bench_tool.hpp"

namespace mha::bench_tool {

void print_table(const Context &ctx, const std::vector<Row> &rows) {
    std::printf("mha-bench%s: FMA peak", ctx.opt.quick ? " --quick" : "");
    for (auto [t, g] : ctx.peak) std::printf(" %.1f GFLOP/s (%d thread%s)", g, t, t > 1 ? "s" : "");
    std::printf(", read bandwidth");
    for (auto [t, b] : ctx.bandwidth) std::printf(" %.1f GB/s (%d thread%s)", b, t, t > 1 ? "s" : "");
    std::printf("\n");
    std::printf("anchors: oneDNN %s, OpenBLAS %s; environment: %s\n", bench::has_dnnl() ? "yes" : "not built",
                bench::has_openblas() ? "yes" : "not built", bench::anchor_environment().c_str());
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
    j["gemm_transpose"] = ctx.tiles.transpose;
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

} // namespace mha::bench_tool
