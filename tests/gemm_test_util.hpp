// The GEMM tests' runtimes: every microkernel the host can run, at its default tiles or at tiles
// small enough that modest sizes cross every block boundary.
#pragma once

#include <algorithm>
#include <cstddef>
#include <thread>
#include <vector>

#include "gemm/sgemm_kernels.hpp"
#include "mha/isa.hpp"
#include "mha/runtime.hpp"
#include "mha/tile_config.hpp"

namespace mha::test {

// Every microkernel this CPU can run, with its ISA.
inline std::vector<const gemm::SgemmKernel *> host_kernels() {
    std::vector<const gemm::SgemmKernel *> v;
    for (const auto &k : gemm::all_sgemm_kernels())
        if (cpu_supports(k.isa)) v.push_back(&k);
    return v;
}

// A runtime of `threads` on this kernel, at its default tiles as adjust(tiles) leaves them.
template <class Adjust>
RuntimeOptions kernel_runtime(const gemm::SgemmKernel &uk, int threads, const Adjust &adjust) {
    RuntimeOptions o;
    o.num_threads = threads;
    o.isa = uk.isa;
    TileConfig t = default_tile_config(uk.isa, detect_cache_sizes());
    t.gemm_ukernel = uk.name;
    adjust(t);
    o.tiles = t;
    return o;
}

// A runtime on this kernel with small blocks, so modest sizes cross every MC/KC/NC boundary.
inline RuntimeOptions small_tiles(const gemm::SgemmKernel &uk, int threads = 1) {
    return kernel_runtime(uk, threads, [&](TileConfig &t) {
        t.mc = 2 * uk.mr;
        t.kc = 16;
        t.nc = 2 * uk.nr;
        t.sup_max_n = uk.nr;
        t.sup_max_k = 8;
    });
}

// The defaults, MC and NC rounded to the kernel's MR and NR.
inline RuntimeOptions default_tiles(const gemm::SgemmKernel &uk, int threads = 1) {
    return kernel_runtime(uk, threads, [&](TileConfig &t) {
        t.mc = std::max<int64_t>(t.mc / uk.mr * uk.mr, uk.mr);
        t.nc = std::max<int64_t>(t.nc / uk.nr * uk.nr, uk.nr);
    });
}

// Runs call(out) `reps` times on each of 8 host threads at once, each thread into an output of
// its own (size floats), and returns the outputs, to compare with one call's bits.
template <class Call>
std::vector<std::vector<float>> on_host_threads(size_t size, int reps, const Call &call) {
    std::vector<std::vector<float>> got(8, std::vector<float>(size));
    std::vector<std::thread> threads;
    for (size_t t = 0; t < got.size(); ++t)
        threads.emplace_back([&, t] {
            for (int rep = 0; rep < reps; ++rep) call(got[t].data());
        });
    for (auto &th : threads) th.join();
    return got;
}

} // namespace mha::test
