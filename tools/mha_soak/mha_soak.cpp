// mha-soak: many host threads call every entry point of one runtime for a fixed time, in a seeded
// random mix of shapes and bad input, and every result is checked against the bits a lone caller
// got for the same call. Memory must stay flat after a warm-up in which every thread has made
// every call once. Run through tools/soak; `mha-soak --help` lists the flags.
//
// The run alternates one-second windows with and without the checks (the same calls, only the
// comparison skipped), so the cost of checking is measured on the same machine at the same time.
#include <malloc.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "soak_cases.hpp"

namespace {

using Clock = std::chrono::steady_clock;

struct Options {
    double seconds = 60;
    int host_threads = 32, runtime_threads = 2;
    uint64_t seed = 1;
    size_t cases = 220;
    double max_growth_percent = 5;  // < 0: report the growth, never fail on it
};

[[noreturn]] void usage(const char *msg) {
    if (msg) std::fprintf(stderr, "mha-soak: %s\n", msg);
    std::fprintf(stderr,
                 "usage: mha-soak [--seconds S (60)] [--host-threads N (32)] [--runtime-threads N (2)] [--seed N (1)]\n"
                 "                [--cases N (220)] [--max-growth-percent P (5; negative: do not check)]\n");
    std::exit(msg ? 2 : 0);
}

Options parse(int argc, char **argv) {
    Options o;
    for (int i = 1; i < argc; ++i) {
        const std::string a = argv[i];
        if (a == "--help" || a == "-h") usage(nullptr);
        if (i + 1 >= argc) usage(("missing value after " + a).c_str());
        const char *v = argv[++i];
        char *end = nullptr;
        const double x = std::strtod(v, &end);
        if (!*v || *end) usage(("not a number: " + a + " " + v).c_str());
        if (a == "--seconds" && x > 0) o.seconds = x;
        else if (a == "--host-threads" && x >= 1 && x <= 1024) o.host_threads = static_cast<int>(x);
        else if (a == "--runtime-threads" && x >= 1 && x <= 1024) o.runtime_threads = static_cast<int>(x);
        else if (a == "--seed" && x >= 0) o.seed = static_cast<uint64_t>(x);
        else if (a == "--cases" && x >= 11) o.cases = static_cast<size_t>(x);
        else if (a == "--max-growth-percent") o.max_growth_percent = x;
        else usage(("unknown flag or value out of range: " + a + " " + v).c_str());
    }
    return o;
}

double resident_mib() {
    FILE *f = std::fopen("/proc/self/statm", "r");
    long size = 0, resident = 0;
    if (f) {
        if (std::fscanf(f, "%ld %ld", &size, &resident) != 2) resident = 0;
        std::fclose(f);
    }
    return static_cast<double>(resident) * static_cast<double>(sysconf(_SC_PAGESIZE)) / (1024.0 * 1024.0);
}

double heap_in_use_mib() { return static_cast<double>(mallinfo2().uordblks) / (1024.0 * 1024.0); }

bool same_bits(const std::vector<float> &a, const std::vector<float> &b) {
    return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// A call's sequence ids: the lone caller uses base 0, host thread t its own range.
int64_t seq_base(int thread, uint64_t call) {
    return (int64_t{thread} + 1) * (int64_t{1} << 40) + static_cast<int64_t>(call) * mha::soak::kSeqsPerCall;
}

struct Totals {
    std::atomic<uint64_t> calls{0}, checked{0}, wrong{0};
    std::atomic<uint64_t> window_calls[2] = {0, 0};  // calls finished in unchecked / checked windows
};

} // namespace

int main(int argc, char **argv) {
    using namespace mha::soak;
    const Options o = parse(argc, argv);
    Shared shared = make_shared_objects(o.runtime_threads, o.seed);
    std::vector<Case> cases = make_cases(shared, o.cases, o.seed);

    // The lone caller's bits: each case run alone, twice (the second run checks the first, so a
    // call that is not deterministic even alone is reported as such rather than blamed on load).
    size_t failing = 0;
    for (Case &c : cases) {
        c.expected.assign(c.out_size, kSentinel);
        c.expected_status = c.call(c.expected, 0);
        std::vector<float> again(c.out_size, kSentinel);
        if (c.call(again, 0) != c.expected_status || !same_bits(again, c.expected)) {
            std::fprintf(stderr, "mha-soak: case %s differs between two lone calls\n", c.name.c_str());
            return 1;
        }
        failing += c.expected_status != MHA_OK;
    }
    std::printf("mha-soak: %zu cases (%zu expected to fail), %d host threads on one runtime of %d threads, %.0f s, seed %llu\n",
                cases.size(), failing, o.host_threads, o.runtime_threads, o.seconds,
                static_cast<unsigned long long>(o.seed));

    Totals totals;
    std::atomic<int> warmed{0};
    std::atomic<bool> stop{false};
    double warm_rss = 0, warm_heap = 0;
    std::atomic<int64_t> start_ns{0};  // of the timed part, once every thread has warmed up
    auto worker = [&](int t) {
        std::mt19937_64 g(o.seed * 7919 + static_cast<uint64_t>(t));
        std::vector<float> out;
        uint64_t call = 0;
        auto run = [&](const Case &c, bool check) {
            out.assign(c.out_size, kSentinel);
            const mha_status st = c.call(out, seq_base(t, call++));
            totals.calls.fetch_add(1, std::memory_order_relaxed);
            if (!check) return;
            totals.checked.fetch_add(1, std::memory_order_relaxed);
            if (st != c.expected_status || !same_bits(out, c.expected)) {
                if (totals.wrong.fetch_add(1) < 10) {
                    size_t at = 0;  // the first element that differs, so a report can be traced
                    while (at < out.size() && at < c.expected.size() &&
                           std::memcmp(&out[at], &c.expected[at], sizeof(float)) == 0)
                        ++at;
                    std::fprintf(stderr,
                                 "mha-soak: WRONG: %s (status %d, the lone caller's %d; first difference at "
                                 "element %zu of %zu: %.9g, the lone caller's %.9g)\n",
                                 c.name.c_str(), static_cast<int>(st), static_cast<int>(c.expected_status), at,
                                 out.size(), at < out.size() ? out[at] : 0.0, at < c.expected.size() ? c.expected[at] : 0.0);
                }
            }
        };
        // Warm-up: every case once, in an order of this thread's own, checked.
        std::vector<size_t> order(cases.size());
        for (size_t i = 0; i < order.size(); ++i) order[i] = i;
        std::shuffle(order.begin(), order.end(), g);
        for (size_t i : order) run(cases[i], true);
        if (warmed.fetch_add(1) + 1 == o.host_threads) {
            start_ns = Clock::now().time_since_epoch().count();
        }
        while (start_ns.load() == 0) std::this_thread::sleep_for(std::chrono::milliseconds(1));
        std::uniform_int_distribution<size_t> pick(0, cases.size() - 1);
        while (!stop.load(std::memory_order_relaxed)) {
            const int64_t now = Clock::now().time_since_epoch().count();
            const bool check = ((now - start_ns.load()) / 1'000'000'000) % 2 == 1;  // odd seconds check
            run(cases[pick(g)], check);
            totals.window_calls[check].fetch_add(1, std::memory_order_relaxed);
        }
    };
    std::vector<std::thread> threads;
    for (int t = 0; t < o.host_threads; ++t) threads.emplace_back(worker, t);
    while (start_ns.load() == 0) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    const auto start = Clock::time_point(Clock::duration(start_ns.load()));
    // The resident set every tenth of the run, to tell a plateau from a leak. The first fifth of the
    // run (about 4 s of a short one, at most half) ends the warm-up: the scratch buffers and the
    // allocator's per-thread arenas reach the sizes the mix needs. Growth is the largest sample
    // after it less the sample that ends it, all taken while the calls run.
    std::vector<double> rss_series;
    double end_rss = 0, end_heap = 0;
    const int warm_tenths = o.seconds >= 20 ? 2 : o.seconds >= 8 ? 4 : 5;  // at least about 4 s of it, at most half
    for (int tenth = 1; tenth <= 10; ++tenth) {
        std::this_thread::sleep_until(start + std::chrono::duration<double>(o.seconds * tenth / 10));
        rss_series.push_back(resident_mib());
        if (tenth == warm_tenths) {
            warm_rss = rss_series.back();
            warm_heap = heap_in_use_mib();
        }
        if (tenth > warm_tenths) end_rss = std::max(end_rss, rss_series.back());
    }
    end_heap = heap_in_use_mib();
    stop = true;
    for (auto &th : threads) th.join();
    const double elapsed = std::chrono::duration<double>(Clock::now() - start).count();
    const double growth = end_rss - warm_rss;

    // Every sequence a call created was released: the cache is as empty as it started.
    int64_t free_tokens = -1, capacity = 0;
    mha_kv_cache_config cfg{};
    mha_kv_cache_free_tokens(shared.cache, &free_tokens);
    mha_kv_cache_get_config(shared.cache, &cfg);
    capacity = (cfg.max_tokens + cfg.block_tokens - 1) / cfg.block_tokens * cfg.block_tokens;
    const bool cache_whole = free_tokens == capacity;
    destroy_shared_objects(shared);

    // Calls per second in the windows with and without the checks (odd and even seconds).
    double window_seconds[2] = {0, 0};
    for (int k = 0; k < elapsed; ++k) window_seconds[k % 2] += std::min(1.0, elapsed - k);
    const double unchecked_rate = static_cast<double>(totals.window_calls[0].load()) / std::max(window_seconds[0], 1e-9),
                 checked_rate = static_cast<double>(totals.window_calls[1].load()) / std::max(window_seconds[1], 1e-9);
    std::printf("resident: %.1f MiB after warm-up, at most %.1f MiB after (%+.1f%%)\n", warm_rss, end_rss,
                100.0 * growth / warm_rss);
    std::printf("resident through the run (MiB, every tenth):");
    for (double r : rss_series) std::printf(" %.1f", r);
    std::printf("\n");
    std::printf("malloc'd and not freed: %.1f MiB after warm-up, %.1f MiB at the end\n", warm_heap, end_heap);
    std::printf("calls per second: %.0f with the checks, %.0f without (%.2fx)\n", checked_rate, unchecked_rate,
                unchecked_rate > 0 ? checked_rate / unchecked_rate : 0.0);
    std::printf("kv cache after the run: %lld of %lld tokens free%s\n", static_cast<long long>(free_tokens),
                static_cast<long long>(capacity), cache_whole ? "" : " (blocks leaked!)");
    const bool grew = o.max_growth_percent >= 0 && growth > warm_rss * o.max_growth_percent / 100.0;
    if (grew) std::printf("resident memory grew by more than %.0f%%\n", o.max_growth_percent);
    std::printf("soak: %llu calls, %llu checked, %llu wrong, %.1f MiB resident growth\n",
                static_cast<unsigned long long>(totals.calls.load()), static_cast<unsigned long long>(totals.checked.load()),
                static_cast<unsigned long long>(totals.wrong.load()), growth);
    return totals.wrong.load() == 0 && !grew && cache_whole ? 0 : 1;
}
