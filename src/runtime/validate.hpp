// Argument checks shared by the public entry points.
#pragma once

#include <cstdint>
#include <string>

#include "mha/error.hpp"

namespace mha::detail {

// Checks a stored rows x cols matrix with leading dimension ld: ld >= max(1, cols), the extent
// (rows - 1) * ld + cols fits in int64 and in the address space, and data is not NULL when the
// call reads or writes it (used). name is the argument's name in messages ("a", "lda", ...).
inline void check_matrix(const char *name, const char *ld_name, const void *data, int64_t rows,
                         int64_t cols, int64_t ld, bool used = true) {
    const int64_t min_ld = cols > 1 ? cols : 1;
    if (ld < min_ld)
        invalid_argument(std::string(ld_name) + " = " + std::to_string(ld) + " is too small: it must be >= " +
                         std::to_string(min_ld));
    if (rows == 0 || cols == 0) return;
    int64_t extent;
    if (__builtin_mul_overflow(rows - 1, ld, &extent) || __builtin_add_overflow(extent, cols, &extent) ||
        extent > INT64_MAX / 4)
        invalid_argument(std::string(name) + ": " + std::to_string(rows) + " rows with " + ld_name + " = " +
                         std::to_string(ld) + " overflow the address space");
    if (used && !data) invalid_argument(std::string(name) + " is NULL but holds " + std::to_string(rows) + " x " +
                                std::to_string(cols) + " elements");
}

inline void check_size(const char *name, int64_t v) {
    if (v < 0) invalid_argument(std::string(name) + " = " + std::to_string(v) + " is negative");
}

inline void check_not_null(const char *name, const void *p) {
    if (!p) invalid_argument(std::string(name) + " is NULL");
}

// Checks the row offsets of a ragged batch, offsets[0..num_seqs] (named `name`): num_seqs >= 0,
// offsets[0] == 0, never decreasing (NULL only for an empty batch). Returns the total row count.
inline int64_t check_offsets(const char *name, const int64_t *offsets, int64_t num_seqs) {
    if (num_seqs < 0) invalid_argument("num_seqs = " + std::to_string(num_seqs) + " is negative");
    // No array of num_seqs + 1 int64 (8 bytes each) fits in the address space beyond this: refuse it
    // before reading one past what the caller can have passed.
    if (num_seqs > INT64_MAX / 8 - 1)
        invalid_argument("num_seqs = " + std::to_string(num_seqs) + " is too large: " + name +
                         " [num_seqs + 1] overflows the address space");
    if (!offsets && num_seqs == 0) return 0;
    check_not_null(name, offsets);
    if (offsets[0] != 0) invalid_argument(std::string(name) + "[0] = " + std::to_string(offsets[0]) + " must be 0");
    for (int64_t s = 0; s < num_seqs; ++s)
        if (offsets[s + 1] < offsets[s])
            invalid_argument(std::string(name) + " decreases: [" + std::to_string(s + 1) + "] = " +
                             std::to_string(offsets[s + 1]) + " < [" + std::to_string(s) + "] = " +
                             std::to_string(offsets[s]));
    return offsets[num_seqs];
}

} // namespace mha::detail
