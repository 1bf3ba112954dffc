// Every large buffer mha owns (scratch, packed weights, the KV cache's pool) comes from here: an
// aligned operator new, so a failed allocation throws, and every C entry point turns that into
// MHA_OUT_OF_MEMORY with a message. Allocating through operator new also lets the tests fail any
// chosen allocation by replacing it (tests/test_oom.cpp).
#pragma once

#include <cstddef>
#include <memory>
#include <new>

namespace mha::detail {

// The block's alignment travels in its deleter, so any alignment frees correctly.
struct AlignedDelete {
    size_t align = 64;
    void operator()(void *p) const noexcept { ::operator delete(p, std::align_val_t(align)); }
};
template <class T>
using AlignedPtr = std::unique_ptr<T, AlignedDelete>;

// bytes rounded up to a multiple of align (a power of two); throws Error(out_of_memory) naming
// what on failure.
void *allocate_aligned(size_t bytes, size_t align, const char *what);

template <class T>
AlignedPtr<T> make_aligned(size_t count, size_t align, const char *what) {
    return AlignedPtr<T>(static_cast<T *>(allocate_aligned(count * sizeof(T), align, what)), AlignedDelete{align});
}

} // namespace mha::detail
