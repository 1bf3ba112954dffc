// mha-bench: the threads suite.
#include <algorithm>
#include <cstdio>

#include "mha/attention.hpp"
#include "mha/gemm.hpp"
#include "mha/softmax.hpp"

#include "bench_tool.hpp"

namespace mha::bench_tool {

// Threads only where they pay: small calls of each entry point on the most threads asked for,
// against the same call on one thread and on all threads whatever the size (the tile config's
// parallel_min_flops and parallel_min_elems at 0). Where "all threads" crosses "1 thread" is the
// break-even those defaults come from; "vs 1 thread" must stay at or above 1.00x. The stream rows
// are calls that read more than they compute (RuntimeState::work_with_stream): one row of A
// against B^T (n x 512) and a decode over Lk cached tokens, in GB/s of B or of K and V.
void suite_threads(Context &ctx, const std::regex *filter, std::vector<Row> &rows) {
    const int threads = *std::max_element(ctx.opt.threads.begin(), ctx.opt.threads.end());
    if (threads < 2) return;
    Runtime rt(RuntimeOptions{threads, {}, {}, {}}), rt1(RuntimeOptions{1, {}, {}, {}});
    TileConfig always = rt.tiles();
    always.parallel_min_flops = always.parallel_min_elems = 0;
    Runtime rt_all(RuntimeOptions{threads, {}, always, {}});
    auto row = [&](const char *name, const std::string &shape, const char *unit, double work, auto call) {
        if (!selected(filter, std::string("threads/") + name + "/" + shape)) return;
        std::fprintf(stderr, "threads %s %s threads=%d\n", name, shape.c_str(), threads);
        measure(ctx, Row{"threads", name, shape, threads, 0, 0, unit, -1, {}}, work, [&] { call(rt); },
                {{"1 thread", [&] { call(rt1); }, 1}, {"all threads", [&] { call(rt_all); }}}, rows);
    };
    for (int64_t n : {32, 64, 96, 128, 192, 256, 384}) {
        std::vector<float> a(static_cast<size_t>(n * n), 0.5f), c(a.size());
        row("sgemm", std::to_string(n) + "^3", "GFLOP/s", 2.0 * n * n * n,
            [&](Runtime &r) { sgemm(r, Trans::N, Trans::N, n, n, n, 1.0f, a.data(), n, a.data(), n, 0.0f, c.data(), n); });
    }
    for (int64_t n : {512, 768, 1024, 1536, 2048}) {
        std::vector<float> a(512, 0.5f), bt(static_cast<size_t>(n * 512)), c(static_cast<size_t>(n));
        bench::fill_hashed(bt.data(), bt.size(), 9, 1.0f);
        row("sgemm stream", "1x" + std::to_string(n) + "x512 NT", "GB/s", 4.0 * static_cast<double>(bt.size()),
            [&](Runtime &r) { sgemm(r, Trans::N, Trans::T, 1, n, 512, 1.0f, a.data(), 512, bt.data(), 512, 0.0f, c.data(), n); });
    }
    for (int64_t len : {256, 512, 1024, 2048}) {
        AttentionParams p;
        p.batch = 1;
        p.q_len = 1;
        p.kv_len = len;
        p.num_heads = p.num_kv_heads = 8;
        p.head_dim = p.value_dim = 64;
        std::vector<float> q(8 * 64), kv(static_cast<size_t>(len * 8 * 64)), out(q.size());
        bench::fill_hashed(q.data(), q.size(), 10, 1.0f);
        bench::fill_hashed(kv.data(), kv.size(), 11, 1.0f);
        row("decode stream", "B1 Lk" + std::to_string(len) + " H8 D64", "GB/s", 2.0 * 4.0 * static_cast<double>(kv.size()),
            [&](Runtime &r) { attention(r, p, q.data(), kv.data(), kv.data(), out.data()); });
    }
    for (int64_t rows_n : {32, 128, 256, 512, 1024, 2048, 8192}) {
        std::vector<float> x(static_cast<size_t>(rows_n * 128)), y(x.size());
        bench::fill_hashed(x.data(), x.size(), 7, 4.0f);
        row("softmax", std::to_string(rows_n) + "x128", "Gelem/s", static_cast<double>(x.size()),
            [&](Runtime &r) { softmax(r, rows_n, 128, x.data(), 128, y.data(), 128); });
    }
    for (int64_t len : {16, 32, 64, 128, 256}) {
        AttentionParams p;
        p.batch = 1;
        p.q_len = p.kv_len = len;
        p.num_heads = p.num_kv_heads = 8;
        p.head_dim = p.value_dim = 64;
        std::vector<float> q(static_cast<size_t>(len * 8 * 64)), out(q.size());
        bench::fill_hashed(q.data(), q.size(), 8, 1.0f);
        const std::string shape = "L" + std::to_string(len).append(" H8 D64");
        row("attention", shape, "GFLOP/s", 4.0 * len * len * 64 * 8,
            [&](Runtime &r) { attention(r, p, q.data(), q.data(), q.data(), out.data()); });
    }
}

} // namespace mha::bench_tool
