#include "runtime/runtime_state.hpp"

#include <tbb/info.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <string>
#include <thread>

#include "gemm/transpose_variant.hpp"
#include "runtime/memory.hpp"

namespace mha {
namespace detail {

void *allocate_aligned(size_t bytes, size_t align, const char *what) {
    if (bytes > SIZE_MAX - align) throw Error(Status::out_of_memory, std::string(what) + ": size overflows");
    bytes = (bytes + align - 1) / align * align;
    try {
        return ::operator new(bytes, std::align_val_t(align));
    } catch (const std::bad_alloc &) {
        throw Error(Status::out_of_memory, "out of memory allocating " + std::to_string(bytes) + " bytes of " + what);
    }
}

AlignedBuffer::AlignedBuffer(size_t count) { reserve(count); }

void AlignedBuffer::reserve(size_t count) {
    if (count <= size_) return;
    if (count > SIZE_MAX / sizeof(float) - 64) throw Error(Status::out_of_memory, "scratch of " + std::to_string(count) + " floats is too large");
    data_ = make_aligned<float>(count, 64, "scratch");
    size_ = count;
}

BufferPool::Lease BufferPool::borrow(size_t count) {
    std::unique_ptr<AlignedBuffer> buf;
    {
        std::lock_guard lock(mutex_);
        // Room for every buffer to come back, made now: give_back runs in a destructor and must
        // not allocate.
        free_.reserve(free_.size() + lent_ + 1);
        // The smallest free buffer that holds count floats, else the largest (which then grows):
        // buffers only grow when no free one is large enough, so their total stays near what the
        // largest calls running at the same time need, however calls and buffers pair up.
        auto pick = free_.end();
        for (auto it = free_.begin(); it != free_.end(); ++it) {
            const bool fits = (*it)->size() >= count;
            if (pick == free_.end() || (fits && ((*pick)->size() < count || (*it)->size() < (*pick)->size())) ||
                (!fits && (*pick)->size() < count && (*it)->size() > (*pick)->size()))
                pick = it;
        }
        if (pick != free_.end()) {
            buf = std::move(*pick);
            free_.erase(pick);
        }
        ++lent_;
    }
    try {
        if (!buf) buf = std::make_unique<AlignedBuffer>();
        const size_t before = buf->size();
        buf->reserve(count);
        std::lock_guard lock(mutex_);
        held_ += (buf->size() - before) * sizeof(float);
    } catch (...) {
        std::lock_guard lock(mutex_);
        --lent_;
        if (buf) free_.push_back(std::move(buf));  // within the capacity reserved above
        throw;
    }
    if (poison) std::fill_n(buf->data(), count, std::numeric_limits<float>::quiet_NaN());
    return Lease(*this, std::move(buf));
}

size_t BufferPool::bytes() {
    std::lock_guard lock(mutex_);
    return held_;
}

void BufferPool::give_back(std::unique_ptr<AlignedBuffer> buf) {
    std::lock_guard lock(mutex_);
    --lent_;
    free_.push_back(std::move(buf));  // never reallocates: borrow reserved the room
}

int RuntimeState::this_thread_slot() { return tbb::this_task_arena::current_thread_index(); }

} // namespace detail

namespace {

Isa choose_isa(const RuntimeOptions &o) {
    Isa isa;
    if (o.isa) {
        isa = *o.isa;
    } else if (const char *env = std::getenv("MHA_ISA"); env && *env) {
        auto parsed = parse_isa(env);
        if (!parsed) invalid_argument(std::string("MHA_ISA='") + env + "' is not one of avx2, avx512");
        isa = *parsed;
    } else {
        return best_isa();
    }
    if (!cpu_supports(isa)) throw Error(Status::unsupported, "this CPU does not support " + std::string(isa_name(isa)));
    return isa;
}

// The arena of `threads` threads that every live runtime of that size uses. One per size, not one
// per runtime: TBB's market hands its workers (one fewer than the cores) to arenas that ask, and a
// worker stays in the arena it last worked in for a while after the work is done, so with two
// arenas of a size, calls on the second ran short of threads while the first kept the worker
// (Zen 5, two 2-thread runtimes calling L128 H8 D64 attention in turn: 93-98 us on the runtime
// made first, 120-151 us on the other; 177 us on one thread). Calls share an arena as the calls
// of many host threads into one runtime always have.
std::shared_ptr<tbb::task_arena> shared_arena(int threads) {
    static std::mutex mutex;
    static std::map<int, std::weak_ptr<tbb::task_arena>> arenas;
    std::lock_guard lock(mutex);
    std::weak_ptr<tbb::task_arena> &slot = arenas[threads];
    if (auto a = slot.lock()) return a;
    auto a = std::make_shared<tbb::task_arena>(threads);
    a->initialize();
    slot = a;
    return a;
}

} // namespace

Runtime::Runtime(const RuntimeOptions &o) : state_(std::make_unique<detail::RuntimeState>()) {
    if (o.num_threads < 0) invalid_argument("num_threads must be >= 0 (0 = all hardware threads), got " + std::to_string(o.num_threads));
    auto &s = *state_;
    s.num_threads = o.num_threads ? o.num_threads : std::max(1, tbb::info::default_concurrency());
    if (s.num_threads > 4096) invalid_argument("num_threads must be <= 4096, got " + std::to_string(o.num_threads));
    s.isa = choose_isa(o);
    std::string path = o.tile_config_path;
    if (path.empty() && !o.tiles)
        if (const char *env = std::getenv("MHA_TILE_CONFIG"); env && *env) path = env;
    if (o.tiles) {
        s.tiles = *o.tiles;
    } else if (!path.empty()) {
        const TileConfigFile f = load_tile_config(path);
        if (f.isa != s.isa)
            invalid_argument("tile config " + path + ": it is for " + std::string(isa_name(f.isa)) +
                             ", but this runtime uses " + std::string(isa_name(s.isa)) +
                             " (tune again with mha-tune, or set MHA_ISA)");
        s.tiles = f.tiles;
    } else {
        s.tiles = default_tile_config(s.isa, detect_cache_sizes());
    }
    // MHA_PARALLEL_ALWAYS=1: every call uses every thread whatever its size (the tests run so,
    // so that their same-bits-on-any-thread-count checks go through the parallel paths).
    if (const char *env = std::getenv("MHA_PARALLEL_ALWAYS"); env && std::string(env) == "1")
        s.tiles.parallel_min_flops = s.tiles.parallel_min_elems = 0;
    if (const char *env = std::getenv("MHA_POISON_SCRATCH"); env && std::string(env) == "1") s.pool.poison = true;
    s.tiles.validate(s.isa);
    // MHA_TRANSPOSE: the register transpose of the GEMM's few-rows path against B^T and of the
    // transposing packs, over the tiles' (see gemm/transpose_variant.hpp); both give the same bits.
    // (After validate: the tiles' own key must be good whatever the environment says.)
    gemm::apply_transpose_env(s.tiles.transpose);
    s.sgemm = gemm::find_sgemm_kernel(s.tiles.gemm_ukernel);
    s.inserts = gemm::parse_transpose_variant(s.tiles.transpose) == gemm::TransposeVariant::inserts;
    s.softmax_kernels = &softmax_detail::softmax_kernels(s.isa);
    s.arena = shared_arena(s.num_threads);
    s.slots = s.arena->max_concurrency();
}

Runtime::~Runtime() = default;

int Runtime::num_threads() const { return state_->num_threads; }
Isa Runtime::isa() const { return state_->isa; }
const TileConfig &Runtime::tiles() const { return state_->tiles; }
size_t Runtime::scratch_bytes() const { return state_->pool.bytes(); }

} // namespace mha
