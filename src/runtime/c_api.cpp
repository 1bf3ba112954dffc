// The C ABI: a thin layer over the C++ API. Every entry catches everything, so no exception
// crosses into C, and records the message for mha_last_error() on the calling thread.
#include <pthread.h>

#include <cstring>
#include <new>
#include <string>
#include <type_traits>
#include <utility>

#include "mha/attention.hpp"
#include "mha/encoder.hpp"
#include "mha/gemm.hpp"
#include "mha/layer.hpp"
#include "mha/mha.h"
#include "mha/runtime.hpp"
#include "mha/serving.hpp"
#include "mha/softmax.hpp"
#include "runtime/c_bridge.hpp"

struct mha_runtime {
    mha::Runtime rt;
    explicit mha_runtime(const mha::RuntimeOptions &o) : rt(o) {}
};

struct mha_packed_b {
    mha::SgemmPackedB b;
    explicit mha_packed_b(mha::SgemmPackedB &&p) : b(std::move(p)) {}
};

struct mha_layer {
    mha::Layer layer;
    mha_layer(mha::Runtime &rt, const mha::LayerConfig &c, const mha::LayerWeights &w) : layer(rt, c, w) {}
};

struct mha_encoder_layer {
    mha::EncoderLayer layer;
    mha_encoder_layer(mha::Runtime &rt, const mha::EncoderConfig &c, const mha::EncoderWeights &w) : layer(rt, c, w) {}
};

struct mha_kv_cache {
    mha::KVCache cache;
    mha_kv_cache(mha::Runtime &rt, const mha::KVCacheConfig &c) : cache(rt, c) {}
};

namespace {

thread_local std::string g_last_error;

// Keeping the message may itself need memory; when it cannot, a short message that fits the
// string's inline buffer (no allocation) says what happened instead, so no error path throws.
void record_error(const char *prefix, const char *what) noexcept {
    try {
        g_last_error = prefix;
        g_last_error += what;
    } catch (...) {
        g_last_error = "out of memory";
    }
}

// A call runs to its end even when its host thread is cancelled meanwhile: cancellation is held
// off for the call (a deferred cancel then acts at the caller's next cancellation point), as no
// cancellation may unwind through the runtime's locks and arena.
class CancellationHeldOff {
public:
    CancellationHeldOff() noexcept { pthread_setcancelstate(PTHREAD_CANCEL_DISABLE, &old_); }
    ~CancellationHeldOff() { pthread_setcancelstate(old_, &old_); }
    CancellationHeldOff(const CancellationHeldOff &) = delete;
    CancellationHeldOff &operator=(const CancellationHeldOff &) = delete;

private:
    int old_ = PTHREAD_CANCEL_ENABLE;
};

template <class Fn>
mha_status guarded(Fn &&fn) noexcept {
    const CancellationHeldOff no_cancel;
    try {
        fn();
        return MHA_OK;
    } catch (const mha::Error &e) {
        record_error("", e.what());
        return static_cast<mha_status>(e.status());
    } catch (const std::bad_alloc &) {
        record_error("", "out of memory");
        return MHA_OUT_OF_MEMORY;
    } catch (const std::exception &e) {
        record_error("internal error: ", e.what());
        return MHA_INTERNAL;
    } catch (...) {
        record_error("internal error: ", "unknown exception");
        return MHA_INTERNAL;
    }
}

mha::Runtime &runtime_of(mha_runtime *rt) {
    if (!rt) mha::invalid_argument("rt is NULL");
    return rt->rt;
}

mha::KVCache &cache_of(const mha_kv_cache *cache) {
    if (!cache) mha::invalid_argument("cache is NULL");
    return const_cast<mha_kv_cache *>(cache)->cache;
}

// The cache's getters: *out = fn(cache), after checking cache and out.
template <class T, class Fn>
mha_status cache_query(const mha_kv_cache *cache, T *out, const char *out_name, Fn fn) {
    return guarded([&] {
        const mha::KVCache &c = cache_of(cache);
        if (!out) mha::invalid_argument(std::string(out_name) + " is NULL");
        *out = fn(c);
    });
}

// A C caller may store any int in an mha_dtype field: read it as its integer (loading an enum out
// of its range is undefined in C++); the layer and the cache refuse unknown values.
mha::DType dtype_of(const mha_dtype *field) {
    std::underlying_type_t<mha_dtype> v;
    std::memcpy(&v, field, sizeof v);
    return static_cast<mha::DType>(v);
}

mha::AttentionVariant variant_of(const mha_attention_variant &v) {
    return mha::AttentionVariant{v.window, v.softcap, v.alibi_slopes, v.sink_logits};
}

mha::LayerConfig layer_config(const mha_layer_config *c) {
    if (!c) mha::invalid_argument("config is NULL");
    mha::LayerConfig l;
    l.embed_dim = c->embed_dim;
    l.num_heads = c->num_heads;
    l.num_kv_heads = c->num_kv_heads;
    l.head_dim = c->head_dim;
    l.value_dim = c->value_dim;
    l.kdim = c->kdim;
    l.vdim = c->vdim;
    l.weight_dtype = dtype_of(&c->weight_dtype);
    l.norm = static_cast<mha::Norm>(c->norm);
    l.norm_eps = c->norm_eps;
    l.variant = variant_of(c->variant);
    if (c->rope.interleaved != 0 && c->rope.interleaved != 1)
        mha::invalid_argument("rope.interleaved = " + std::to_string(c->rope.interleaved) +
                              " must be 0 (pairs x[d], x[d + dims/2]) or 1 (adjacent pairs)");
    l.rope = mha::Rope{c->rope.dims, c->rope.theta, c->rope.interleaved == 1, c->rope.position_scale};
    return l;
}

mha::LayerWeights layer_weights(const mha_layer_weights *weights) {
    if (!weights) mha::invalid_argument("weights is NULL");
    mha::LayerWeights w;
    w.q_weight = weights->q_weight;
    w.k_weight = weights->k_weight;
    w.v_weight = weights->v_weight;
    w.out_weight = weights->out_weight;
    w.q_bias = weights->q_bias;
    w.k_bias = weights->k_bias;
    w.v_bias = weights->v_bias;
    w.out_bias = weights->out_bias;
    w.norm_weight = weights->norm_weight;
    w.norm_bias = weights->norm_bias;
    return w;
}

mha::LayerForward layer_forward_params(const mha_layer_forward_params *p) {
    if (!p) mha::invalid_argument("p is NULL");
    mha::LayerForward f;
    f.batch = p->batch;
    f.q_len = p->q_len;
    f.kv_len = p->kv_len;
    f.causal = p->causal != 0;
    f.kv_valid_lens = p->kv_valid_lens;
    f.mask = p->mask;
    f.mask_batch_stride = p->mask_batch_stride;
    f.mask_row_stride = p->mask_row_stride;
    f.weights = p->weights;
    return f;
}

} // namespace

extern "C" {

const char *mha_last_error(void) { return g_last_error.c_str(); }

mha_status mha_runtime_create(int num_threads, mha_runtime **out) {
    return guarded([&] {
        if (!out) mha::invalid_argument("out is NULL");
        *out = nullptr;
        mha::RuntimeOptions o;
        o.num_threads = num_threads;
        *out = new mha_runtime(o);
    });
}

mha_status mha_runtime_create_with_config(int num_threads, const char *tile_config_path, mha_runtime **out) {
    return guarded([&] {
        if (!out) mha::invalid_argument("out is NULL");
        *out = nullptr;
        mha::RuntimeOptions o;
        o.num_threads = num_threads;
        if (tile_config_path) o.tile_config_path = tile_config_path;
        *out = new mha_runtime(o);
    });
}

void mha_runtime_destroy(mha_runtime *rt) { delete rt; }

mha_status mha_runtime_scratch_bytes(const mha_runtime *rt, uint64_t *bytes) {
    return guarded([&] {
        if (!rt) mha::invalid_argument("rt is NULL");
        if (!bytes) mha::invalid_argument("bytes is NULL");
        *bytes = rt->rt.scratch_bytes();
    });
}

mha_status mha_sgemm(mha_runtime *rt, char transa, char transb, int64_t m, int64_t n, int64_t k,
                     float alpha, const float *a, int64_t lda, const float *b, int64_t ldb, float beta,
                     float *c, int64_t ldc) {
    return guarded([&] {
        mha::sgemm(runtime_of(rt), static_cast<mha::Trans>(transa), static_cast<mha::Trans>(transb), m, n, k,
                   alpha, a, lda, b, ldb, beta, c, ldc);
    });
}

mha_status mha_sgemm_pack_b(mha_runtime *rt, char transb, int64_t k, int64_t n, const float *b, int64_t ldb,
                            mha_packed_b **out) {
    return guarded([&] {
        if (!out) mha::invalid_argument("out is NULL");
        *out = nullptr;
        mha::SgemmPackedB packed(runtime_of(rt), static_cast<mha::Trans>(transb), k, n, b, ldb);
        *out = new mha_packed_b(std::move(packed));
    });
}

void mha_packed_b_destroy(mha_packed_b *b) { delete b; }

mha_status mha_packed_b_bytes(const mha_packed_b *b, uint64_t *bytes) {
    return guarded([&] {
        if (!b) mha::invalid_argument("b is NULL");
        if (!bytes) mha::invalid_argument("bytes is NULL");
        *bytes = b->b.bytes();
    });
}

mha_status mha_sgemm_packed_b(mha_runtime *rt, char transa, int64_t m, float alpha, const float *a, int64_t lda,
                              const mha_packed_b *b, float beta, float *c, int64_t ldc) {
    return guarded([&] {
        mha::Runtime &r = runtime_of(rt);
        if (!b) mha::invalid_argument("b is NULL");
        mha::sgemm(r, static_cast<mha::Trans>(transa), m, alpha, a, lda, b->b, beta, c, ldc);
    });
}

mha_status mha_softmax(mha_runtime *rt, int64_t rows, int64_t cols, const float *x, int64_t ldx, float *y,
                       int64_t ldy) {
    return guarded([&] { mha::softmax(runtime_of(rt), rows, cols, x, ldx, y, ldy); });
}

mha_status mha_attention(mha_runtime *rt, const mha_attention_params *p, const float *q, const float *k,
                         const float *v, float *out) {
    return guarded([&] {
        mha::Runtime &r = runtime_of(rt);
        if (!p) mha::invalid_argument("p is NULL");
        mha::AttentionParams a;
        a.batch = p->batch;
        a.q_len = p->q_len;
        a.kv_len = p->kv_len;
        a.num_heads = p->num_heads;
        a.num_kv_heads = p->num_kv_heads;
        a.head_dim = p->head_dim;
        a.value_dim = p->value_dim;
        a.scale = p->scale;
        a.causal = p->causal != 0;
        a.kv_valid_lens = p->kv_valid_lens;
        a.mask = p->mask;
        a.mask_batch_stride = p->mask_batch_stride;
        a.mask_row_stride = p->mask_row_stride;
        a.weights = p->weights;
        a.variant = variant_of(p->variant);
        mha::attention(r, a, q, k, v, out);
    });
}

mha_status mha_layer_weights_from_in_proj(const mha_layer_config *config, const float *in_proj_weight,
                                          const float *in_proj_bias, const float *out_proj_weight,
                                          const float *out_proj_bias, mha_layer_weights *out) {
    return guarded([&] {
        if (!out) mha::invalid_argument("out is NULL");
        const auto w = mha::LayerWeights::from_in_proj(layer_config(config), in_proj_weight, in_proj_bias,
                                                       out_proj_weight, out_proj_bias);
        *out = mha_layer_weights{w.q_weight, w.k_weight, w.v_weight, w.out_weight,
                                 w.q_bias,   w.k_bias,   w.v_bias,   w.out_bias, w.norm_weight, w.norm_bias};
    });
}

mha_status mha_layer_create(mha_runtime *rt, const mha_layer_config *config, const mha_layer_weights *weights,
                            mha_layer **out) {
    return guarded([&] {
        if (!out) mha::invalid_argument("out is NULL");
        *out = nullptr;
        mha::Runtime &r = runtime_of(rt);
        const mha::LayerWeights w = layer_weights(weights);
        *out = new mha_layer(r, layer_config(config), w);
    });
}

void mha_layer_destroy(mha_layer *layer) { delete layer; }

mha_status mha_layer_forward(mha_runtime *rt, const mha_layer *layer, const mha_layer_forward_params *p,
                             const float *query, const float *key, const float *value, float *out) {
    return guarded([&] {
        mha::Runtime &r = runtime_of(rt);
        if (!layer) mha::invalid_argument("layer is NULL");
        layer->layer.forward(r, layer_forward_params(p), query, key, value, out);
    });
}

mha_status mha_encoder_layer_create(mha_runtime *rt, const mha_encoder_config *config,
                                    const mha_encoder_weights *weights, mha_encoder_layer **out) {
    return guarded([&] {
        if (!out) mha::invalid_argument("out is NULL");
        *out = nullptr;
        mha::Runtime &r = runtime_of(rt);
        if (!config) mha::invalid_argument("config is NULL");
        if (!weights) mha::invalid_argument("weights is NULL");
        mha::EncoderConfig c;
        c.attention = layer_config(&config->attention);
        c.ffn_dim = config->ffn_dim;
        c.activation = static_cast<mha::Activation>(config->activation);
        mha::EncoderWeights w;
        w.attention = layer_weights(&weights->attention);
        w.linear1_weight = weights->linear1_weight;
        w.linear1_bias = weights->linear1_bias;
        w.linear2_weight = weights->linear2_weight;
        w.linear2_bias = weights->linear2_bias;
        w.norm2_weight = weights->norm2_weight;
        w.norm2_bias = weights->norm2_bias;
        *out = new mha_encoder_layer(r, c, w);
    });
}

void mha_encoder_layer_destroy(mha_encoder_layer *layer) { delete layer; }

mha_status mha_encoder_layer_forward(mha_runtime *rt, const mha_encoder_layer *layer,
                                     const mha_layer_forward_params *p, const float *x, float *out) {
    return guarded([&] {
        mha::Runtime &r = runtime_of(rt);
        if (!layer) mha::invalid_argument("layer is NULL");
        layer->layer.forward(r, layer_forward_params(p), x, out);
    });
}

mha_status mha_layer_forward_varlen(mha_runtime *rt, const mha_layer *layer, int64_t num_seqs, const int64_t *offsets,
                                    int causal, const float *x, float *out) {
    return guarded([&] {
        mha::Runtime &r = runtime_of(rt);
        if (!layer) mha::invalid_argument("layer is NULL");
        layer->layer.forward_varlen(r, mha::LayerVarlenForward{num_seqs, offsets, causal != 0}, x, out);
    });
}

mha_status mha_encoder_layer_forward_varlen(mha_runtime *rt, const mha_encoder_layer *layer, int64_t num_seqs,
                                            const int64_t *offsets, int causal, const float *x, float *out) {
    return guarded([&] {
        mha::Runtime &r = runtime_of(rt);
        if (!layer) mha::invalid_argument("layer is NULL");
        layer->layer.forward_varlen(r, mha::LayerVarlenForward{num_seqs, offsets, causal != 0}, x, out);
    });
}

mha_status mha_attention_varlen(mha_runtime *rt, const mha_varlen_params *p, const float *q, const float *k,
                                const float *v, float *out) {
    return guarded([&] {
        mha::Runtime &r = runtime_of(rt);
        if (!p) mha::invalid_argument("p is NULL");
        mha::VarlenParams a;
        a.num_seqs = p->num_seqs;
        a.q_offsets = p->q_offsets;
        a.kv_offsets = p->kv_offsets;
        a.num_heads = p->num_heads;
        a.num_kv_heads = p->num_kv_heads;
        a.head_dim = p->head_dim;
        a.value_dim = p->value_dim;
        a.scale = p->scale;
        a.causal = p->causal != 0;
        a.variant = variant_of(p->variant);
        mha::attention_varlen(r, a, q, k, v, out);
    });
}

mha_status mha_kv_cache_create(mha_runtime *rt, const mha_kv_cache_config *config, mha_kv_cache **out) {
    return guarded([&] {
        if (!out) mha::invalid_argument("out is NULL");
        *out = nullptr;
        mha::Runtime &r = runtime_of(rt);
        if (!config) mha::invalid_argument("config is NULL");
        mha::KVCacheConfig c;
        c.num_kv_heads = config->num_kv_heads;
        c.head_dim = config->head_dim;
        c.value_dim = config->value_dim;
        c.block_tokens = config->block_tokens;
        c.max_tokens = config->max_tokens;
        c.dtype = dtype_of(&config->dtype);
        c.window = config->window;
        *out = new mha_kv_cache(r, c);
    });
}

void mha_kv_cache_destroy(mha_kv_cache *cache) { delete cache; }

mha_status mha_kv_cache_append(mha_runtime *rt, mha_kv_cache *cache, int64_t seq_id, int64_t n_tokens,
                               const float *k, const float *v) {
    return guarded([&] {
        runtime_of(rt);
        cache_of(cache).append(seq_id, n_tokens, k, v);
    });
}

mha_status mha_kv_cache_fork(mha_kv_cache *cache, int64_t src_seq, int64_t dst_seq) {
    return guarded([&] { cache_of(cache).fork(src_seq, dst_seq); });
}

mha_status mha_kv_cache_release(mha_kv_cache *cache, int64_t seq_id) {
    return guarded([&] { cache_of(cache).release(seq_id); });
}

mha_status mha_kv_cache_seq_len(const mha_kv_cache *cache, int64_t seq_id, int64_t *len) {
    return cache_query(cache, len, "len", [&](const mha::KVCache &c) { return c.seq_len(seq_id); });
}

mha_status mha_kv_cache_free_tokens(const mha_kv_cache *cache, int64_t *tokens) {
    return cache_query(cache, tokens, "tokens", [](const mha::KVCache &c) { return c.free_tokens(); });
}

mha_status mha_kv_cache_bytes(const mha_kv_cache *cache, uint64_t *bytes) {
    return cache_query(cache, bytes, "bytes", [](const mha::KVCache &c) { return static_cast<uint64_t>(c.bytes()); });
}

mha_status mha_kv_cache_get_config(const mha_kv_cache *cache, mha_kv_cache_config *config) {
    return cache_query(cache, config, "config", [](const mha::KVCache &c) {
        const mha::KVCacheConfig &r = c.config();
        return mha_kv_cache_config{r.num_kv_heads, r.head_dim,   r.value_dim,
                                   r.block_tokens, r.max_tokens, static_cast<mha_dtype>(r.dtype), r.window};
    });
}

mha_status mha_kv_cache_read(const mha_kv_cache *cache, int64_t seq_id, int64_t start, int64_t n_tokens, float *k,
                             float *v) {
    return guarded([&] { cache_of(cache).read(seq_id, start, n_tokens, k, v); });
}

mha_status mha_attention_cached(mha_runtime *rt, const mha_kv_cache *cache, const mha_cached_params *p,
                                const float *q, float *out) {
    return guarded([&] {
        mha::Runtime &r = runtime_of(rt);
        const mha::KVCache &c = cache_of(cache);
        if (!p) mha::invalid_argument("p is NULL");
        mha::CachedParams a;
        a.num_seqs = p->num_seqs;
        a.seq_ids = p->seq_ids;
        a.q_offsets = p->q_offsets;
        a.num_heads = p->num_heads;
        a.scale = p->scale;
        a.causal = p->causal != 0;
        a.variant = variant_of(p->variant);
        mha::attention_cached(r, c, a, q, out);
    });
}

mha_status mha_layer_forward_cached(mha_runtime *rt, const mha_layer *layer, mha_kv_cache *cache,
                                    const mha_layer_cached_params *p, const float *x, float *out) {
    return guarded([&] {
        mha::Runtime &r = runtime_of(rt);
        if (!layer) mha::invalid_argument("layer is NULL");
        mha::KVCache &c = cache_of(cache);
        if (!p) mha::invalid_argument("p is NULL");
        mha::LayerCachedForward f;
        f.num_seqs = p->num_seqs;
        f.seq_ids = p->seq_ids;
        f.q_offsets = p->q_offsets;
        f.causal = p->causal != 0;
        layer->layer.forward_cached(r, c, f, x, out);
    });
}

} // extern "C"

// For the C facades built apart from libmha (src/dist's libmha_tp): see runtime/c_bridge.hpp.
namespace mha::c_bridge {
mha_status guarded_call(void (*fn)(void *), void *ctx) noexcept { return ::guarded([&] { fn(ctx); }); }
Runtime &runtime_of(mha_runtime *rt) { return ::runtime_of(rt); }
KVCache &cache_of(const mha_kv_cache *cache) { return ::cache_of(cache); }
LayerConfig layer_config(const mha_layer_config *c) { return ::layer_config(c); }
LayerWeights layer_weights(const mha_layer_weights *w) { return ::layer_weights(w); }
LayerForward layer_forward_params(const mha_layer_forward_params *p) { return ::layer_forward_params(p); }
} // namespace mha::c_bridge
