// Row softmax and the online (streaming) softmax that fused attention is built on.
//
// Semantics, for every entry point:
//   - each row is max-subtracted first, so logits up to +-3e38 never overflow;
//   - a -inf entry gets probability exactly 0;
//   - a row of only -inf entries gets all zeros (not NaN);
//   - a NaN anywhere in a row makes that whole row NaN, and no other row (a +inf entry does the
//     same, since +inf - +inf is NaN, as in PyTorch);
//   - each row is computed the same way whatever the thread count or the other rows.
#pragma once

#include <cstdint>

#include "mha/runtime.hpp"

namespace mha {

// y[r, :] = softmax(x[r, :]) for rows rows of cols values. x == y (with ldx == ldy) computes in
// place; other overlaps are refused. Throws mha::Error on bad arguments, before writing anything.
void softmax(Runtime &rt, int64_t rows, int64_t cols, const float *x, int64_t ldx, float *y, int64_t ldy);

// The online softmax (Milakov & Gimelshein 2018; Dao et al. 2022), for a block of `rows` rows whose
// scores arrive cols at a time. Start each row with running_max = -inf, running_sum = 0 and its
// accumulator acc (acc_cols wide) at 0. For each block of scores s:
//   online_softmax_fold(...)     // s becomes P = exp(s - new max); acc rows are rescaled
//   acc += P * V_block           // the caller's product
// and at the end online_softmax_finish divides acc by the running sums (rows that saw no visible
// score become zeros). Folding a row in blocks of any size matches the one-shot softmax.
void online_softmax_fold(Runtime &rt, int64_t rows, int64_t cols, float *s, int64_t lds, float *running_max,
                         float *running_sum, float *acc, int64_t ldacc, int64_t acc_cols);
void online_softmax_finish(Runtime &rt, int64_t rows, const float *running_sum, float *acc, int64_t ldacc,
                           int64_t acc_cols);

} // namespace mha
