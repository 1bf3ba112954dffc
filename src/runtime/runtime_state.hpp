// What a Runtime owns: its thread arena, its resolved tiles and kernels, and its scratch.
#pragma once

#include <tbb/task_arena.h>

#include <algorithm>
#include <cstddef>
#include <memory>
#include <mutex>
#include <vector>

#include "gemm/sgemm_kernels.hpp"
#include "runtime/memory.hpp"
#include "softmax/softmax_table.hpp"
#include "mha/runtime.hpp"

namespace mha::detail {

// A 64-byte aligned float buffer.
class AlignedBuffer {
public:
    AlignedBuffer() = default;
    explicit AlignedBuffer(size_t count);
    float *data() const { return data_.get(); }
    size_t size() const { return size_; }
    // Grows (never shrinks) to at least count floats; the contents are not kept.
    void reserve(size_t count);

private:
    AlignedPtr<float> data_;
    size_t size_ = 0;
};

// Buffers lent to one call at a time, so concurrent calls from many host threads never share one.
class BufferPool {
public:
    class Lease {
    public:
        Lease(BufferPool &pool, std::unique_ptr<AlignedBuffer> buf) : pool_(pool), buf_(std::move(buf)) {}
        ~Lease() { pool_.give_back(std::move(buf_)); }
        Lease(const Lease &) = delete;
        Lease &operator=(const Lease &) = delete;
        float *data() const { return buf_->data(); }

    private:
        BufferPool &pool_;
        std::unique_ptr<AlignedBuffer> buf_;
    };
    Lease borrow(size_t count);
    // MHA_POISON_SCRATCH=1 (the tests): every buffer lent is first filled with NaN, so a kernel that
    // reads scratch it has not written shows it in its output.
    bool poison = false;
    // Of every buffer the pool holds, lent out now or not: a query from one host thread must not
    // depend on which calls other threads have running at that moment.
    size_t bytes();

private:
    void give_back(std::unique_ptr<AlignedBuffer> buf);
    std::mutex mutex_;
    std::vector<std::unique_ptr<AlignedBuffer>> free_;
    size_t lent_ = 0;  // buffers out on loan
    size_t held_ = 0;  // bytes of all the pool's buffers, free and lent
};

// Whether `floats` read once are more than the packed GEMM's KC x NC block (half of L2), so they
// come from past L2 on every call.
inline bool past_packed_block(const TileConfig &t, double floats) {
    return floats >= static_cast<double>(t.kc) * static_cast<double>(t.nc);
}

struct RuntimeState {
    int num_threads = 1;
    Isa isa = Isa::avx2;
    TileConfig tiles;
    const gemm::SgemmKernel *sgemm = nullptr;
    bool inserts = false;  // tiles.transpose is "inserts" (the kernels' argument; see gemm/transpose_variant.hpp)
    const softmax_detail::SoftmaxKernels *softmax_kernels = nullptr;
    // Runtimes of one thread count share one arena (see shared_arena in runtime.cpp): separate
    // arenas of a size compete for TBB's few worker threads.
    std::shared_ptr<tbb::task_arena> arena;
    // Scratch is borrowed per call, all of it before the call writes anything, so running out of
    // memory never leaves an output half written. A call splits its per-thread part by arena slot:
    // threads inside one arena have distinct slots, and task bodies never block inside TBB.
    BufferPool pool;
    int slots = 1;  // arena slots, including the host thread's

    static int this_thread_slot();

    // How many of the arena's threads `work` pays for: one per full share of `min_per_thread`
    // (the tile config's parallel_min_flops or parallel_min_elems), at least 1, at most all.
    int threads_for(double work, int64_t min_per_thread) const {
        if (min_per_thread <= 0) return num_threads;
        const double t = work / static_cast<double>(min_per_thread);
        return t >= num_threads ? num_threads : t < 1 ? 1 : static_cast<int>(t);
    }

    // The work of a call, in FLOPs for threads_for(work, tiles.parallel_min_flops), that does
    // `flops` of arithmetic on `floats` (4-byte units) it reads once each: where they are more than
    // the packed GEMM's KC x NC block (half of L2), they come from past L2 on every call, and the
    // work is the larger of the arithmetic and the time of that stream, kStreamFlops a float. A
    // call doing little arithmetic on each float it reads (a few rows against a large B; decode
    // over a KV cache) then takes a second thread, whose core doubles the stream, as 8 MFLOP a
    // thread do. On the Xeon (model 207) one core takes such a stream at 25-30 GB/s, the time of
    // about 25 FLOPs a float at its FMA peak (1x1536x512 NT: 110-130 us on one thread, where its
    // 1.6 MFLOP take 9 us). Measurements: gemm::product_threads, and the attention's scheduler.
    static constexpr double kStreamFlops = 24.0;
    double work_with_stream(double flops, double floats) const {
        return past_packed_block(tiles, floats) ? std::max(flops, kStreamFlops * floats) : flops;
    }
};

} // namespace mha::detail
