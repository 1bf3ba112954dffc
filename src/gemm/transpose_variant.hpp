// Which 16 x 16 register transpose the AVX-512 packing uses (Transpose<avx512f>::columns, under
// every transposing pack: K^T in attention, B^T and A^T in the GEMM, the few-rows path against
// B^T). Both give the same bits (a transpose moves floats, it computes nothing); they differ in
// which execution ports they load.
//   shuffles: 16 full-row loads and 64 shuffles (unpack, then 128-bit lane shuffles).
//   inserts:  the cross-lane half done by the loads (64 128-bit loads, 48 of them inserted into
//             place), then 32 in-lane shuffles.
// Intel's cores run 512-bit shuffles on one port, so the 64 shuffles bound the first form there;
// AMD's run them on two. Measured, 16 x 16 blocks from L1, cycles of the 2.6 GHz TSC per block:
// Intel Xeon (AMX; family 6 model 167 under KVM) shuffles 112-129, inserts 61-72; AMD Zen 5 ran
// the inserts 15-20% slower than the shuffles. So AMD keeps the shuffles and every other x86 takes
// the inserts (Zen 4, unmeasured, keeps AMD's choice). MHA_TRANSPOSE=shuffles|inserts overrides
// the choice for the process (read when a Runtime is made).
#pragma once

#include <atomic>
#include <optional>
#include <string_view>

namespace mha::gemm {

enum class TransposeVariant : int { shuffles = 0, inserts = 1 };

// The process's choice, read on every block (relaxed: both forms give the same bits, so a change
// while calls run changes no result).
extern std::atomic<int> g_transpose_variant;

inline TransposeVariant transpose_variant() {
    return static_cast<TransposeVariant>(g_transpose_variant.load(std::memory_order_relaxed));
}
void set_transpose_variant(TransposeVariant v);
// The CPU's default (see the top): shuffles on AMD, inserts elsewhere.
TransposeVariant default_transpose_variant();
const char *transpose_variant_name(TransposeVariant v);
std::optional<TransposeVariant> parse_transpose_variant(std::string_view name);

} // namespace mha::gemm
