// The soak's work: a seeded catalogue of calls through the C ABI, each with the status and output
// bits a lone caller got for it before the soak began.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "mha/mha.h"

namespace mha::soak {

// The objects every case shares: one runtime, one layer, one encoder layer, one KV cache large
// enough for every host thread's sequences, and a tiny cache that an oversized append overflows.
struct Shared {
    mha_runtime *rt = nullptr;
    mha_layer *layer = nullptr;
    mha_encoder_layer *encoder = nullptr;
    mha_kv_cache *cache = nullptr, *tiny_cache = nullptr;
    std::vector<std::shared_ptr<void>> keep;  // the weights and inputs the cases point into
};

// A case's call writes its outputs into out (out_size floats, which arrive filled with a
// sentinel) and returns its status. seq_base gives the call sequence ids of its own in the cache:
// seq_base, seq_base + 1, ... (the lone caller and every host thread pass distinct bases).
struct Case {
    std::string name;
    size_t out_size = 0;
    std::function<mha_status(std::vector<float> &out, int64_t seq_base)> call;
    mha_status expected_status = MHA_OK;  // the lone caller's
    std::vector<float> expected;          // the lone caller's output bits
};

constexpr float kSentinel = -31415.5f;
constexpr int64_t kSeqsPerCall = 4;  // sequence ids a call may use from its base

// Creates the shared objects on a runtime of runtime_threads threads (exits on failure).
Shared make_shared_objects(int runtime_threads, uint64_t seed);
void destroy_shared_objects(Shared &s);

// count cases of every kind, shapes drawn from seed; their expectations still to be filled.
std::vector<Case> make_cases(Shared &s, size_t count, uint64_t seed);

} // namespace mha::soak
