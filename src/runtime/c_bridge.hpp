// What the C ABI's other facades (libmha_tp, src/dist/c_api_tp.cpp) share with c_api.cpp: the guard
// that keeps exceptions out of C and records mha_last_error(), and the translations of its handles
// and structs. Internal: not installed.
#pragma once

#include <type_traits>
#include <utility>

#include "mha/layer.hpp"
#include "mha/mha.h"
#include "mha/serving.hpp"

namespace mha::c_bridge {

// Runs fn(ctx) as every C entry point runs its body: any exception becomes a status, and its message
// mha_last_error()'s on this thread.
mha_status guarded_call(void (*fn)(void *), void *ctx) noexcept;
template <class Fn>
mha_status guarded(Fn &&fn) noexcept {
    return guarded_call([](void *f) { (*static_cast<std::remove_reference_t<Fn> *>(f))(); }, &fn);
}

Runtime &runtime_of(mha_runtime *rt);             // throws for NULL
KVCache &cache_of(const mha_kv_cache *cache);     // throws for NULL
LayerConfig layer_config(const mha_layer_config *c);
LayerWeights layer_weights(const mha_layer_weights *w);
LayerForward layer_forward_params(const mha_layer_forward_params *p);

} // namespace mha::c_bridge
