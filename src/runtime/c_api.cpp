// The C ABI: a thin layer over the C++ API. Every entry catches everything, so no exception
// crosses into C, and records the message for mha_last_error() on the calling thread.
#include <new>
#include <string>

#include "mha/attention.hpp"
#include "mha/gemm.hpp"
#include "mha/mha.h"
#include "mha/runtime.hpp"
#include "mha/softmax.hpp"

struct mha_runtime {
    mha::Runtime rt;
    explicit mha_runtime(const mha::RuntimeOptions &o) : rt(o) {}
};

namespace {

thread_local std::string g_last_error;

template <class Fn>
mha_status guarded(Fn &&fn) noexcept {
    try {
        fn();
        return MHA_OK;
    } catch (const mha::Error &e) {
        g_last_error = e.what();
        return static_cast<mha_status>(e.status());
    } catch (const std::bad_alloc &) {
        g_last_error = "out of memory";
        return MHA_OUT_OF_MEMORY;
    } catch (const std::exception &e) {
        g_last_error = std::string("internal error: ") + e.what();
        return MHA_INTERNAL;
    } catch (...) {
        g_last_error = "internal error: unknown exception";
        return MHA_INTERNAL;
    }
}

mha::Runtime &runtime_of(mha_runtime *rt) {
    if (!rt) mha::invalid_argument("rt is NULL");
    return rt->rt;
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

void mha_runtime_destroy(mha_runtime *rt) { delete rt; }

mha_status mha_sgemm(mha_runtime *rt, char transa, char transb, int64_t m, int64_t n, int64_t k,
                     float alpha, const float *a, int64_t lda, const float *b, int64_t ldb, float beta,
                     float *c, int64_t ldc) {
    return guarded([&] {
        mha::sgemm(runtime_of(rt), static_cast<mha::Trans>(transa), static_cast<mha::Trans>(transb), m, n, k,
                   alpha, a, lda, b, ldb, beta, c, ldc);
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
        mha::attention(r, a, q, k, v, out);
    });
}

} // extern "C"
