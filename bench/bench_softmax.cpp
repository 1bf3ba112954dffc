// Softmax throughput in Gelem/s: mha beside the plain scalar loop and oneDNN's softmax primitive,
// on the same shapes and thread counts.

#include <cstdio>
#include <memory>

#include "bench/bench_support.hpp"
#include "bench/register.hpp"
#include "mha/softmax.hpp"

using namespace mha;

namespace {

enum class Impl { mha, scalar, onednn };

void run(benchmark::State &state, const bench::SoftmaxShape &s, int threads, Impl impl) {
    std::vector<float> x(static_cast<size_t>(s.rows * s.cols)), y(x.size());
    for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(i % 97) * 0.1f - 5.0f;
    std::unique_ptr<Runtime> rt;
    std::unique_ptr<bench::DnnlSoftmax> dnnl;
    if (impl == Impl::mha) rt = std::make_unique<Runtime>(RuntimeOptions{threads, {}, {}, {}});
    if (impl == Impl::onednn) dnnl = std::make_unique<bench::DnnlSoftmax>(s.rows, s.cols, x.data(), y.data(), threads);
    for (auto _ : state) {
        switch (impl) {
        case Impl::mha: softmax(*rt, s.rows, s.cols, x.data(), s.cols, y.data(), s.cols); break;
        case Impl::scalar: bench::scalar_softmax(s.rows, s.cols, x.data(), y.data()); break;
        case Impl::onednn: dnnl->run(); break;
        }
        benchmark::DoNotOptimize(y.data());
    }
    state.counters["Gelem/s"] = benchmark::Counter(s.elems() * 1e-9 * static_cast<double>(state.iterations()),
                                                   benchmark::Counter::kIsRate);
}

} // namespace

int main(int argc, char **argv) {
    bench::ensure_anchor_environment(argv);
    std::printf("anchors: scalar loop (1 thread), oneDNN softmax primitive %s; %s\n", bench::has_dnnl() ? "yes" : "no",
                bench::anchor_environment().c_str());
    for (const auto &s : bench::softmax_shapes())
        for (int threads : {1, 2}) {
            std::vector<std::pair<const char *, Impl>> impls = {{"mha", Impl::mha}};
            if (threads == 1) impls.push_back({"scalar", Impl::scalar});
            if (bench::has_dnnl()) impls.push_back({"onednn", Impl::onednn});
            bench::register_impls("softmax", s.str(), threads, impls,
                                  [s, threads](benchmark::State &st, Impl impl) { run(st, s, threads, impl); },
                                  benchmark::kNanosecond);
        }
    benchmark::Initialize(&argc, argv);
    benchmark::RunSpecifiedBenchmarks();
    benchmark::Shutdown();
}
