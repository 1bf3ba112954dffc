// The multi-head attention layer (E 512, H 8, self-attention) beside the same layer composed from
// oneDNN's sgemm, with its attention step timed as the layer runs it (right after a QKV projection
// wrote its input) to show the split of the time. PyTorch's nn.MultiheadAttention, timed by
// bench/torch_layer.py, is printed in the header.

#include <cstdio>
#include <map>

#include "bench/layer_fixture.hpp"
#include "bench/register.hpp"

using namespace mha;

namespace {

std::map<int, double> g_peak;

enum class Impl { mha, attention_part, onednn };

void run(benchmark::State &state, const bench::LayerShape &s, int threads, Impl impl) {
    Runtime rt(RuntimeOptions{threads, {}, {}, {}});
    bench::LayerFixture f(rt, s);
    for (auto _ : state) {
        if (impl == Impl::mha) f.forward(rt);
        else if (impl == Impl::attention_part) {  // as the layer runs it: right after the QKV projection
            state.PauseTiming();
            f.project_qkv(rt);
            state.ResumeTiming();
            f.attention_in_layer(rt);
        }
        else f.onednn(threads);
        benchmark::DoNotOptimize(f.out.data());
    }
    if (impl != Impl::attention_part)
        state.counters["GFLOPS"] = benchmark::Counter(s.flops() * 1e-9 * static_cast<double>(state.iterations()),
                                                      benchmark::Counter::kIsRate);
    state.counters["peak_GFLOPS"] = g_peak[threads];
}

} // namespace

int main(int argc, char **argv) {
    bench::ensure_anchor_environment(argv);
    for (int threads : {1, 2}) g_peak[threads] = bench::measure_fma_peak_gflops(threads);
    std::printf("FMA peak %.1f / %.1f GFLOP/s (1 / 2 threads); %s\n", g_peak[1], g_peak[2],
                bench::anchor_environment().c_str());
    for (int threads : {1, 2}) {
        std::string why;
        const auto ms = bench::torch_layer_ms(threads, bench::layer_shapes(), 1.0, &why);
        for (size_t i = 0; i < ms.size(); ++i)
            std::printf("PyTorch nn.MultiheadAttention %s threads:%d: %.3f ms\n", bench::layer_shapes()[i].str().c_str(),
                        threads, ms[i]);
        if (ms.empty()) std::printf("PyTorch anchor skipped: %s\n", why.c_str());
    }
    for (const auto &s : bench::layer_shapes())
        for (int threads : {1, 2}) {
            std::vector<std::pair<const char *, Impl>> impls = {{"mha", Impl::mha}, {"mha_attention_part", Impl::attention_part}};
            if (bench::has_dnnl()) impls.push_back({"onednn", Impl::onednn});
            bench::register_impls("layer", s.str(), threads, impls,
                                  [s, threads](benchmark::State &st, Impl impl) { run(st, s, threads, impl); });
        }
    benchmark::Initialize(&argc, argv);
    benchmark::RunSpecifiedBenchmarks();
    benchmark::Shutdown();
    return 0;
}
