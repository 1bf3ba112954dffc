// Fused attention beside two unfused compositions on oneDNN's sgemm (the full Lq x Lk matrix, as
// PyTorch does it, and 256-row blocks that skip the keys past a causal diagonal), and decode
// (one query, long KV cache) against the machine's read bandwidth.

#include <cstdio>
#include <map>
#include <memory>

#include "bench/bench_support.hpp"
#include "bench/register.hpp"
#include "mha/attention.hpp"

using namespace mha;

namespace {

std::map<int, double> g_peak;
double g_bandwidth[3] = {};  // read GB/s of 1 and 2 threads

enum class Impl { mha, full, blocked };

void run(benchmark::State &state, const bench::AttentionShape &s, int threads, Impl impl) {
    const size_t n = static_cast<size_t>(s.batch * s.len * s.heads * s.dim);
    std::vector<float> q(n, 0.01f), k(n, 0.02f), v(n, 0.5f), out(n), scores;
    Runtime rt(RuntimeOptions{threads, {}, {}, {}});
    AttentionParams p;
    p.batch = s.batch; p.q_len = p.kv_len = s.len; p.num_heads = p.num_kv_heads = s.heads;
    p.head_dim = p.value_dim = s.dim; p.causal = s.causal;
    for (auto _ : state) {
        if (impl == Impl::mha) attention(rt, p, q.data(), k.data(), v.data(), out.data());
        else
            bench::dnnl_attention(threads, impl == Impl::full ? 0 : 256, s.batch, s.len, s.heads, s.dim, s.causal, q.data(),
                                  k.data(), v.data(), out.data(), scores);
        benchmark::DoNotOptimize(out.data());
    }
    state.counters["GFLOPS"] = benchmark::Counter(s.flops() * 1e-9 * static_cast<double>(state.iterations()),
                                                  benchmark::Counter::kIsRate);
    state.counters["peak_GFLOPS"] = g_peak[threads];
}

void run_decode(benchmark::State &state, const bench::DecodeShape &s, int threads) {
    const int64_t B = s.batch, H = s.heads, Hkv = s.kv_heads, D = s.dim, L = s.kv_len;
    std::vector<float> q(static_cast<size_t>(B * H * D), 0.01f), k(static_cast<size_t>(B * L * Hkv * D), 0.02f),
        v(k.size(), 0.5f), out(q.size());
    Runtime rt(RuntimeOptions{threads, {}, {}, {}});
    AttentionParams p;
    p.batch = B; p.q_len = 1; p.kv_len = L; p.num_heads = H; p.num_kv_heads = Hkv; p.head_dim = p.value_dim = D;
    for (auto _ : state) {
        attention(rt, p, q.data(), k.data(), v.data(), out.data());
        benchmark::DoNotOptimize(out.data());
    }
    state.counters["GB/s"] = benchmark::Counter(s.kv_bytes() * 1e-9 * static_cast<double>(state.iterations()),
                                                benchmark::Counter::kIsRate);
    state.counters["read_GB/s"] = g_bandwidth[threads];
}

} // namespace

int main(int argc, char **argv) {
    bench::ensure_anchor_environment(argv);
    for (int threads : {1, 2}) g_peak[threads] = bench::measure_fma_peak_gflops(threads);
    for (int threads : {1, 2}) g_bandwidth[threads] = bench::measure_read_bandwidth_gbs(threads);
    std::printf("FMA peak %.1f / %.1f GFLOP/s (1 / 2 threads), read bandwidth %.1f / %.1f GB/s; %s\n", g_peak[1],
                g_peak[2], g_bandwidth[1], g_bandwidth[2], bench::anchor_environment().c_str());
    for (const auto &s : bench::attention_shapes())
        for (int threads : {1, 2}) {
            std::vector<std::pair<const char *, Impl>> impls = {{"mha", Impl::mha}};
            if (bench::has_dnnl()) {
                impls.push_back({"onednn_blocked", Impl::blocked});
                if (s.len <= 4096) impls.push_back({"onednn_full", Impl::full});
            }
            bench::register_impls("attention", s.str(), threads, impls,
                                  [s, threads](benchmark::State &st, Impl impl) { run(st, s, threads, impl); });
        }
    for (const auto &s : bench::decode_shapes())
        for (int threads : {1, 2}) {
            bench::register_impls("decode", s.str(), threads, std::vector<std::pair<const char *, int>>{{"mha", 0}},
                                  [s, threads](benchmark::State &st, int) { run_decode(st, s, threads); });
        }
    benchmark::Initialize(&argc, argv);
    benchmark::RunSpecifiedBenchmarks();
    benchmark::Shutdown();
}
