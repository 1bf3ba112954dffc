// A GEMM operand packed once and used by many calls: the weights of a projection, packed when a
// layer is built (as oneDNN's and XNNPACK's packed weights are), so a forward pass packs only its
// activations.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>

#include "runtime/runtime_state.hpp"

namespace mha::gemm {

// op(B), k x n, in the layout sgemm's packed loops read: depth block pc (kc_p = min(kc, k - pc)
// deep) holds the NR-column panels of all n_padded columns, each panel kc_p x NR, at
// data + pc * n_padded. It is tied to the microkernel and KC it was packed for.
struct PackedB {
    std::string kernel;  // the microkernel's name
    int64_t kc = 0, k = 0, n = 0, n_padded = 0, nr = 0;
    detail::AlignedBuffer data;

    // The panels of columns [j, ...) in depth block pc; j is a multiple of NR.
    const float *block(int64_t pc, int64_t j) const { return data.data() + pc * n_padded + j * std::min(kc, k - pc); }
};

// Packs B (element (p, j) = b[p * rs + j * cs]) for the runtime's microkernel and KC; k or n may
// be 0 (nothing to pack).
PackedB pack_b(detail::RuntimeState &s, int64_t k, int64_t n, const float *b, int64_t rs, int64_t cs);

// C[0:m, 0:n] = A * B[:, j0:j0 + n] (+ bias[0:n] on every row, if not NULL), with A m x k at lda and
// B packed; j0 is a multiple of NR. Always the packed loops, so each row of C gets the same bits
// whatever m is (a sequence alone or inside a batch). Throws mha::Error if B was packed for another
// microkernel or KC than the runtime's. act: an activation applied to each block of C right after
// its last depth block, while it is in cache. one_thread: on the calling thread alone whatever the
// size (for callers that share the arena's threads out themselves; the same bits either way).
void sgemm_prepacked(detail::RuntimeState &s, int64_t m, int64_t n, const float *a, int64_t lda, const PackedB &b,
                     int64_t j0, const float *bias, float *c, int64_t ldc, Epilogue act = Epilogue::none,
                     bool one_thread = false);

} // namespace mha::gemm
