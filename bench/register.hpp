// Registering the Google Benchmark runs of one shape: one benchmark per implementation, named
// "<suite>/<impl>/<shape>/threads:<n>", so the suites read alike and filter alike.
#pragma once

#include <benchmark/benchmark.h>

#include <string>
#include <utility>
#include <vector>

namespace mha::bench {

// run(state, impl) is one benchmark's body.
template <class Impl, class Run>
void register_impls(const std::string &suite, const std::string &shape, int threads,
                    const std::vector<std::pair<const char *, Impl>> &impls, const Run &run,
                    benchmark::TimeUnit unit = benchmark::kMillisecond) {
    for (const auto &[name, impl] : impls) {
        const std::string id = suite + "/" + name + "/" + shape + "/threads:" + std::to_string(threads);
        benchmark::RegisterBenchmark(id.c_str(), [run, impl = impl](benchmark::State &st) { run(st, impl); })
            ->UseRealTime()
            ->Unit(unit);
    }
}

} // namespace mha::bench
