// The layer's cached forward with its append left undoable, for a caller that may still have to
// take the step back after it succeeded (src/dist's sharded layer, when another rank failed).
#pragma once

#include "mha/layer.hpp"
#include "serving/kv_cache_impl.hpp"

namespace mha::layer_detail {

// Layer::forward_cached; on success `appended` holds what KVCache::Impl::undo() needs to take the
// append back (the caller must do so before anyone writes those sequences again). On failure the
// append is already undone, as in forward_cached.
void forward_cached_undoable(const Layer &layer, Runtime &rt, KVCache &cache, const LayerCachedForward &p,
                             const float *x, float *out, KVCache::Impl::AppendUndo &appended);

} // namespace mha::layer_detail
