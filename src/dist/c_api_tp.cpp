// The C ABI of the sharded layer (mha_tp.h), over mha::TpLayer. A collective call whose C arguments
// fail on this rank still takes its part in the collective, as a failing rank, so no rank waits.
#include <string>

#include "dist/tp_internal.hpp"
#include "mha/mha_tp.h"
#include "mha/tp_layer.hpp"
#include "runtime/c_bridge.hpp"

struct mha_tp_layer {
    mha::TpLayer tp;
    template <class... Args>
    explicit mha_tp_layer(Args &&...args) : tp(std::forward<Args>(args)...) {}
};

namespace {

using mha::c_bridge::guarded;

void fill_shard(const mha::TpShard &s, mha_tp_shard *out) {
    out->rank = s.rank;
    out->size = s.size;
    out->head_begin = s.head_begin;
    out->num_heads = s.num_heads;
    out->kv_head_begin = s.kv_head_begin;
    out->num_kv_heads = s.num_kv_heads;
}

mha::Error invalid(const std::string &message) { return mha::Error(mha::Status::invalid_argument, message); }

mha_status create(mha_runtime *rt, MPI_Comm comm, const mha_layer_config *config, const mha_layer_weights *weights,
                  mha_tp_layer **out, mha::TpLayer::Weights from) {
    return guarded([&] {
        if (out) *out = nullptr;
        // What the C arguments lack, this rank reports through the collective, as a failing rank.
        mha::LayerConfig c;
        mha::LayerWeights w;
        try {
            if (!out) throw invalid("out is NULL");
            if (!rt) throw invalid("rt is NULL");
            c = mha::c_bridge::layer_config(config);
            w = mha::c_bridge::layer_weights(weights);
        } catch (const mha::Error &e) {
            mha::tp_detail::create_failed(comm, e);
        }
        *out = new mha_tp_layer(mha::c_bridge::runtime_of(rt), comm, c, w, from);
    });
}

// The layer for a collective call: a NULL one cannot take part (it holds the communicator).
const mha::TpLayer &tp_of(const mha_tp_layer *layer) {
    if (!layer) mha::invalid_argument("layer is NULL (this rank cannot take part in the collective call)");
    return layer->tp;
}

} // namespace

extern "C" {

mha_status mha_tp_shard_for(const mha_layer_config *config, int rank, int size, mha_tp_shard *out) {
    return guarded([&] {
        if (!out) mha::invalid_argument("out is NULL");
        fill_shard(mha::tp_shard_for(mha::c_bridge::layer_config(config), rank, size), out);
    });
}

mha_status mha_tp_layer_create(mha_runtime *rt, MPI_Comm comm, const mha_layer_config *config,
                               const mha_layer_weights *weights, mha_tp_layer **out) {
    return create(rt, comm, config, weights, out, mha::TpLayer::Weights::full);
}

mha_status mha_tp_layer_create_from_shard(mha_runtime *rt, MPI_Comm comm, const mha_layer_config *config,
                                          const mha_layer_weights *shard, mha_tp_layer **out) {
    return create(rt, comm, config, shard, out, mha::TpLayer::Weights::shard);
}

void mha_tp_layer_destroy(mha_tp_layer *layer) { delete layer; }

mha_status mha_tp_layer_get_shard(const mha_tp_layer *layer, mha_tp_shard *out) {
    return guarded([&] {
        if (!layer) mha::invalid_argument("layer is NULL");
        if (!out) mha::invalid_argument("out is NULL");
        fill_shard(layer->tp.shard(), out);
    });
}

mha_status mha_tp_layer_get_config(const mha_tp_layer *layer, mha_layer_config *out) {
    return guarded([&] {
        if (!layer) mha::invalid_argument("layer is NULL");
        if (!out) mha::invalid_argument("out is NULL");
        const mha::LayerConfig &c = layer->tp.config();
        *out = mha_layer_config{};
        out->embed_dim = c.embed_dim;
        out->num_heads = c.num_heads;
        out->num_kv_heads = c.num_kv_heads;
        out->head_dim = c.head_dim;
        out->value_dim = c.value_dim;
        out->kdim = c.kdim;
        out->vdim = c.vdim;
        out->weight_dtype = static_cast<mha_dtype>(c.weight_dtype);
        out->norm = static_cast<int>(c.norm);
        out->norm_eps = c.norm_eps;
    });
}

mha_status mha_tp_layer_forward(mha_runtime *rt, const mha_tp_layer *layer, const mha_layer_forward_params *p,
                                const float *query, const float *key, const float *value, float *out) {
    return guarded([&] {
        const mha::TpLayer &tp = tp_of(layer);
        if (!rt) tp.fail_call(invalid("rt is NULL"));
        if (!p) tp.fail_call(invalid("p is NULL"));
        tp.forward(mha::c_bridge::runtime_of(rt), mha::c_bridge::layer_forward_params(p), query, key, value, out);
    });
}

mha_status mha_tp_layer_forward_cached(mha_runtime *rt, const mha_tp_layer *layer, mha_kv_cache *cache,
                                       const mha_layer_cached_params *p, const float *x, float *out) {
    return guarded([&] {
        const mha::TpLayer &tp = tp_of(layer);
        if (!rt) tp.fail_call(invalid("rt is NULL"));
        if (!cache) tp.fail_call(invalid("cache is NULL"));
        if (!p) tp.fail_call(invalid("p is NULL"));
        mha::LayerCachedForward f;
        f.num_seqs = p->num_seqs;
        f.seq_ids = p->seq_ids;
        f.q_offsets = p->q_offsets;
        f.causal = p->causal != 0;
        tp.forward_cached(mha::c_bridge::runtime_of(rt), mha::c_bridge::cache_of(cache), f, x, out);
    });
}

mha_status mha_tp_layer_forward_varlen(mha_runtime *rt, const mha_tp_layer *layer, int64_t num_seqs,
                                       const int64_t *offsets, int causal, const float *x, float *out) {
    return guarded([&] {
        const mha::TpLayer &tp = tp_of(layer);
        if (!rt) tp.fail_call(invalid("rt is NULL"));
        mha::LayerVarlenForward f;
        f.num_seqs = num_seqs;
        f.offsets = offsets;
        f.causal = causal != 0;
        tp.forward_varlen(mha::c_bridge::runtime_of(rt), f, x, out);
    });
}

mha_status mha_tp_layer_timing(const mha_tp_layer *layer, mha_tp_timing *out) {
    return guarded([&] {
        if (!layer) mha::invalid_argument("layer is NULL");
        if (!out) mha::invalid_argument("out is NULL");
        const mha::TpTiming t = layer->tp.timing();
        out->calls = t.calls;
        out->seconds = t.seconds;
        out->comm_seconds = t.comm_seconds;
        out->wait_seconds = t.wait_seconds;
    });
}

mha_status mha_tp_layer_reset_timing(mha_tp_layer *layer) {
    return guarded([&] {
        if (!layer) mha::invalid_argument("layer is NULL");
        layer->tp.reset_timing();
    });
}

} // extern "C"
