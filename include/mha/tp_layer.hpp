// mha::TpLayer: a multi-head attention layer with its heads sharded across the ranks of an MPI
// communicator (tensor parallelism; built with -Dmpi, in libmha_tp). The contract (the head split,
// the rank-order sum and the bits it gives, collective calls, errors agreed by every rank) is
// mha_tp.h's; this is the C++ API it sits on.
#pragma once

#include <mpi.h>

#include <cstdint>
#include <memory>

#include "mha/error.hpp"
#include "mha/layer.hpp"
#include "mha/serving.hpp"

namespace mha {

// The heads rank `rank` of `size` holds: KV heads in equal contiguous runs, with their query groups.
struct TpShard {
    int rank = 0, size = 1;
    int64_t head_begin = 0, num_heads = 0;
    int64_t kv_head_begin = 0, num_kv_heads = 0;
};
// No MPI. Throws Error(invalid_argument) if size does not divide the config's KV heads, or rank is
// not in [0, size).
TpShard tp_shard_for(const LayerConfig &config, int rank, int size);

struct TpTiming {
    int64_t calls = 0;
    double seconds = 0, comm_seconds = 0;  // in the forward calls; the part of it in MPI
    double wait_seconds = 0;  // the part of comm_seconds in the status agreement: waiting for the slowest rank
};

class TpLayer {
public:
    enum class Weights { full, shard };  // what the weights passed to the constructor hold
    // Collective over comm (duplicated for the layer's own use). Every rank throws the same
    // status if any rank fails (see mha_tp.h for the message).
    TpLayer(Runtime &rt, MPI_Comm comm, const LayerConfig &config, const LayerWeights &weights,
            Weights from = Weights::full);
    ~TpLayer();  // collective (frees the communicator), unless MPI is finalized already
    TpLayer(const TpLayer &) = delete;
    TpLayer &operator=(const TpLayer &) = delete;

    // Collective; Layer's forward, forward_cached (cache: this rank's, with its KV heads only) and
    // forward_varlen, with the whole input and output on every rank.
    void forward(Runtime &rt, const LayerForward &p, const float *query, const float *key, const float *value,
                 float *out) const;
    void forward_cached(Runtime &rt, KVCache &cache, const LayerCachedForward &p, const float *x, float *out) const;
    void forward_varlen(Runtime &rt, const LayerVarlenForward &p, const float *x, float *out) const;

    // Collective: takes this rank's part in a forward call (of any form) that it cannot make, so the
    // other ranks' calls fail too rather than wait; throws the agreed error (e's, from this rank,
    // unless a lower rank failed as well).
    [[noreturn]] void fail_call(const Error &e) const;

    const LayerConfig &config() const;  // the full layer's, resolved
    const TpShard &shard() const;
    const Layer &local() const;         // this rank's heads: no output bias, no norm
    double flops(const LayerForward &p) const;  // of the whole layer (all ranks together)
    TpTiming timing() const;
    void reset_timing();

    struct Impl;

private:
    std::unique_ptr<Impl> impl_;
};

} // namespace mha
