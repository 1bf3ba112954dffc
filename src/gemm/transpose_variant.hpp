// Which register transpose the few-rows path against B^T (sgemm_bt_rows.hpp: 5 to 9 rows on
// AVX-512, 5 to 8 on AVX2) and the transposing packs (sgemm_pack.hpp: B^T's panels, A^T's strips,
// the attention's K^T) transpose their blocks with. Both forms give the same registers (a
// transpose moves floats, it computes nothing); they differ in which execution ports they load.
//   shuffles (Transpose::columns): a load per row, then log2(L) rounds of L shuffles (in-lane
//             unpacks, then the 128-bit lanes exchanged): 64 shuffles a 16 x 16 block on AVX-512,
//             24 an 8 x 8 block on AVX2.
//   inserts (Transpose::columns_by_inserts): the cross-lane half done by the loads (each row's
//             128-bit chunks loaded into the lane they end in, by inserts that need not use the
//             shuffle port), then the in-lane 4 x 4 transposes: 32 shuffles a block on AVX-512,
//             16 on AVX2, and four times the loads (twice on AVX2).
// Intel's cores run these shuffles on one port, which the FMAs share; AMD's run them on two.
// Measured, blocks from L1, cycles of the 2.6 GHz TSC per block: Intel Xeon (AMX; family 6 model
// 167 under KVM) AVX-512 shuffles 112-129, inserts 61-72; AVX2 shuffles 38-39, inserts 20. AMD
// Zen 5 (2026-11-24) ran the same inserts 7-20% slower in macro_bt_rows itself (1-8 rows NT; 8
// rows 1.36-1.38x -> 1.12-1.15x dnnl_sgemm) and 15-20% slower as a packing transpose. So AMD's
// cores (AMD's and Hygon's) keep the shuffles and every other x86 takes the inserts (Zen 3 and
// Zen 4, unmeasured, keep Zen 5's choice). The packing's transposes (K^T in attention, B^T and
// A^T in the GEMM) take the same choice. They had measured level or slower with the inserts on
// this Xeon (2048x2048x64 NT 0.991x, 4096x1536x512 NT 0.996x, 1024^3 TN 0.999x, attention
// L128-L512 H8 D64/D128 0.993-1.008x) while the pack stalled on its prefetches; once it walked 16
// rows at a time through the depth (model-207 Xeon, 2026-11-27, 1 thread, inserts against
// shuffles, the same bits): attention L128 H8 D128 1.022-1.036x, D64 1.040-1.054x, causal 1.011x,
// B8 L128 D64 1.034x, L512 level; GEMM NT and TN level to +0.7%; AVX2 level.
// The choice is a tile config key (TileConfig::transpose: the defaults above, or what mha-tune
// measured), so each runtime packs with its own; MHA_TRANSPOSE=shuffles|inserts overrides it for
// every runtime made while it is set (a value that is neither is refused).
#pragma once

#include <optional>
#include <string>
#include <string_view>

namespace mha::gemm {

enum class TransposeVariant : int { shuffles = 0, inserts = 1 };

const char *transpose_variant_name(TransposeVariant v);
std::optional<TransposeVariant> parse_transpose_variant(std::string_view name);
// MHA_TRANSPOSE, if set, overrides a runtime's `transpose` (its tile config's key; every Runtime's
// constructor calls this); a value that is neither form throws mha::Error (invalid argument) with
// a message and changes nothing.
void apply_transpose_env(std::string &transpose);

} // namespace mha::gemm
