#include "mha/tile_config.hpp"

#include <cpuid.h>
#include <unistd.h>

#include <algorithm>

#include "gemm/sgemm_kernels.hpp"
#include "gemm/transpose_variant.hpp"
#include "mha/error.hpp"
#include "runtime/cpu_vendor.hpp"

namespace mha {

CacheSizes detect_cache_sizes() {
    CacheSizes c;
    // sysconf reads cpuid leaf 4 on glibc; a 0 or -1 (unknown, e.g. in some VMs) keeps the default.
    if (long v = sysconf(_SC_LEVEL1_DCACHE_SIZE); v > 0) c.l1d = v;
    if (long v = sysconf(_SC_LEVEL2_CACHE_SIZE); v > 0) c.l2 = v;
    if (long v = sysconf(_SC_LEVEL3_CACHE_SIZE); v > 0) c.l3 = v;
    unsigned a = 0, b = 0, cx = 0, d = 0;
    c.amd = detail::amd_cores();
    if (__get_cpuid(1, &a, &b, &cx, &d)) {
        const int base = static_cast<int>((a >> 8) & 0xf), ext = static_cast<int>((a >> 20) & 0xff);
        c.family = base == 0xf ? base + ext : base;
    }
    return c;
}

namespace {
int64_t round_down(int64_t x, int64_t m) { return std::max(m, x / m * m); }
} // namespace

TileConfig default_tile_config(Isa isa, const CacheSizes &caches) {
    const auto &uk = gemm::default_sgemm_kernel(isa);
    constexpr int64_t f = sizeof(float);
    TileConfig t;
    t.gemm_ukernel = uk.name;
    // The microkernel broadcasts A and loads B vectors, so (as in BLIS for the transposed product)
    // the A micro-panel is reused from L1 while B micro-panels stream in from L2 (Low et al. 2016).
    // KC: an MR x KC micro-panel of A and a KC x NR micro-panel of B fill L1 together, so A is
    // still in L1 when the next B panel comes. 48 KiB L1, 14x32 -> KC = 264. Measured at 1024^3
    // and 2048^3: KC 256 beat 176 by 3-5% and 320-432 by 2-4% (A starts to be evicted).
    t.kc = std::clamp<int64_t>(round_down(caches.l1d / ((uk.mr + uk.nr) * f), 8), 64, 1024);
    // AMD Zen 5 (family 0x1A: AVX-512 on a full 512-bit datapath, 48 KiB L1d, 1 MiB L2): a deeper
    // block, KC = 512, one pass over C where K <= 512 (the projections) and half as many
    // elsewhere; its B micro-panel (64 KiB) streams through L1 from L2 and the A micro-panel
    // (28 KiB) stays. MC: the A block within 4x L2 (2044 rows; 1022 lost 2-4% at 1024^3, 4088 3-6%
    // at 2048^3, two runs each at KC 512). NC follows (256). Against
    // oneDNN, 1 thread, three interleaved runs each, defaults (KC 264, NC 480, MC 4088) -> these:
    // 1024^3 0.91-0.98x -> 0.95-1.00x, 2048^3 0.86-0.92x -> 0.88-0.98x, 512x512x64 NT
    // 0.96-0.97x -> 1.03-1.08x, 512x64x512 0.96-1.01x -> 1.02-1.22x, 4096x1536x512 NT
    // 0.87-0.93x -> 0.92-0.98x, 4096x512x512 NT 0.87-0.96x -> 0.96-0.98x. Rejected: KC 384
    // (NC 320) and KC 768 (NC 160), within noise of 512 or below it at 2048^3.
    // Intel Xeon with AMX and avx512_fp16 (2026-11-24: 48 KiB L1d, 2 MiB L2, 480 MiB L3, FMA probe
    // 246 GFLOP/s a core), the same: KC 512 and the formulas' NC 512 and MC 4088 against the
    // formulas' KC 264 (NC 992), vs oneDNN, 1 thread, two interleaved runs each: 1024^3 0.985x ->
    // 1.005x, 2048^3 0.95-0.98x -> 1.01-1.02x, 4096x1536x512 NT 0.96x -> 1.00-1.01x, 4096x512x512
    // NT 0.95x -> 1.04x, 1024x512x512 NT 0.96x -> 1.04x, 2048x1536x512 NT 0.97x -> 1.01-1.02x,
    // 512^3 1.00-1.03x -> 1.06-1.10x, 256^3 level. Rejected there: NC 256 (0.93-1.03x), NC 1024
    // (0.94x at 1024^3 and 2048^3), MC 2044 (level, 0.985x at 2048^3), KC 768 NC 320 (0.99-1.02x),
    // KC 384 NC 672 (0.95-0.99x). (An older, slower Xeon, 2026-11-22, had put KC 256 ahead of
    // 320-432, before the microkernel asked for B ahead.) So every AVX-512 core with 48 KiB of L1d
    // or more takes KC 512: its A micro-panel (28 KiB at 14 rows) stays in L1 beside B's stream.
    // The same Xeon on 2026-11-25 (after A's strip packing), mha-tune --quick, 1 thread: the
    // defaults stayed best; against them KC 128-264 (the formula's NC) scored 0.94-0.96x, 6x64
    // 0.88-0.93x, 8x48 0.91-0.93x. And on 2026-11-26, mha-tune's full search (96 candidates, 1
    // thread): the defaults best again; 14x32 KC 128-328 NC 384-3072 0.92-0.97x, 8x48 KC 104-272
    // 0.89-0.95x, 6x64 KC 80-216 0.87-0.93x. bench_gemm_parts' k_loop rows put the three shapes'
    // loops (A and B in L1, no C) level with each other, at 83-98% of the start-up FMA probe as the
    // host's load came and went, and the 14x32 microkernel at KC 512 at 86-99% of its loop in the
    // same run: no shape has room that 14x32 lacks.
    // As a rule of L1d: the A micro-panel takes 7/12 of it (28 KiB of 48 at KC 512), up to KC 512
    // (768 rejected above). A 32 KiB L1d (Zen 4, Skylake-X and Cascade Lake) so gets KC 336 (an
    // 18.4 KiB A micro-panel), not the first formula's 176 (9.6 KiB), which both 48 KiB cores had
    // beaten by 1-5%. Not measured on such a core; BLIS's tuned blockings for the two point the
    // same way: its sgemm keeps a 12 x KC micro-panel of the broadcast operand in L1 beside a
    // 32-wide one from L2, as this kernel does with A, at KC 384 on Skylake-X (18 KiB, 56% of L1d)
    // and KC 480 on Zen 4 (22.5 KiB, 70%). mha-tune searches this range on the machine
    // (tools/mha_tune.cpp: A micro-panels of 1/2 and 3/4 of L1d). On the 48 KiB Xeon (2026-11-26,
    // 1 thread, against dnnl_sgemm, one interleaved run each), KC 176 / 336 / 512 with the
    // formula's NC: 1024^3 0.99 / 1.04 / 1.07x, 1024x1536x512 NT 0.95 / 1.05 / 1.07x, 1024x512x512
    // NT 1.00 / 1.03 / 1.07x, 2048x1536x512 0.96 / 0.98 / 0.99x; mha-tune --quick with the deeper
    // candidates: 14x32 KC 656 0.985x, 6x64 and 8x48 KC 768 0.987x, the defaults best again. Its
    // full search (1 thread, the GEMM candidates scored on the attention at L1024 too): 14x32 KC
    // 656 0.981-0.988x, KC 128-432 0.938-0.980x; 6x64 KC 768 0.977-0.986x, KC 80-216 0.902-0.957x;
    // 8x48 KC 768 0.969-0.980x, KC 104-272 0.911-0.964x: the defaults best of 96.
    // A newer Xeon (2026-11-26 evening; cpuid family 6 model 207, Emerald Rapids as the guest
    // reports it; 48 KiB L1d, 2 MiB L2, 260 MiB L3, FMA probe 178-179 GFLOP/s), mha-tune's full
    // search: 1 thread, the defaults best of 96 (14x32 KC 128-656 0.956-0.993x, its best KC 656 NC
    // 384-576; 6x64 0.921-0.986x; 8x48 0.931-0.977x); 2 threads, 14x32 KC 656 NC 384-576
    // 1.000-1.007x, 6x64 KC 768 0.996-1.002x, the rest 0.849-0.99x: under the tuner's 2% bar, the
    // defaults kept. In mha-bench there (1 thread, against dnnl_sgemm): 1024^3 1.01-1.02x at 91-92%
    // of the probe, 2048^3 1.00x (90%), 4096x1536x512 NT 1.02x, 512x512x64 NT 0.96x.
    // (Those 96 held each candidate twice: MC clamps to 4088 for a quarter and an eighth of the
    // 260 MiB L3. mha-tune now measures each once.) The same model on 2026-11-28, full search of the
    // 48, 1 thread (5.3 minutes): 14x32 0.945-0.993x, 6x64 0.927-1.014x (KC 768 NC 512), 8x48
    // 0.954-1.003x; 2 threads (6 minutes): 14x32 0.924-1.000x (KC 656 NC 576), 6x64 0.860-0.994x,
    // 8x48 0.888-0.965x. Under the 2% bar both times: the defaults stand. Again at 11:22 that day
    // (the searches with the transpose step and the decode shape), 1 / 2 threads: 14x32
    // 0.959-0.992x / 0.924-0.999x, 6x64 0.932-0.982x / 0.864-1.018x, 8x48 0.937-0.971x /
    // 0.889-0.968x.
    const bool zen5 = caches.amd && caches.family >= 0x1a && uk.isa == Isa::avx512;
    if (uk.isa == Isa::avx512) t.kc = std::clamp<int64_t>(round_down(caches.l1d * 7 / 12 / (uk.mr * f), 8), 64, 512);
    // NC: the KC x NC block of B, packed per thread, takes half of that core's L2.
    // 2 MiB L2, KC = 264 -> NC = 992 (a multiple of NR = 32). 256 to 1024 measured within noise.
    // AMD EPYC Zen 3 (AVX2, 32 KiB L1d, 512 KiB L2) gives KC = 368, NC = 176 for avx2_6x16; the
    // full mha-tune search there (1 thread, 2026-11-23) scored every other KC (184, 272, 464) and
    // NC (64 to 528) within 0.97-1.01x of these, so they stay.
    // AMD EPYC Zen 5 (AVX-512, 48 KiB L1d, 1 MiB L2) gives avx512_14x32 KC = 264, NC = 480; its full
    // mha-tune search (1 thread, 2026-11-23) scored 14x32 KC 128-328 / NC 192-1536 at 0.98-1.01x,
    // 6x64 KC 80-216 at 0.97-1.02x and 8x48 KC 104-272 at 0.99-1.03x on the projection shapes
    // (best 8x48 KC 160 NC 384: 1.08x at 2048x1536x512, 0.98x at 1024x512x512), while the attention
    // ran 0.62-0.84x of the default tiles with 8x48: the defaults stay. Again with KC 512
    // (2026-11-24, vs oneDNN, 1 thread, 1024^3 / 2048^3 / 4096x1536x512 NT / 4096x512x512 NT):
    // 14x32 KC 512 NC 256 MC 2044 0.94-0.96 / 0.94-0.97 / 0.95-0.97 / 1.00-1.02x; 6x64 KC 512
    // NC 256 0.97 / 0.98-0.99 / 0.94-0.95 / 0.99x; 6x64 KC 768 NC 192 0.98 / 0.98 / 0.95 /
    // 1.02x; 6x64 KC 512 NC 512 0.94 / 0.94 / 0.94 / 1.01x; 8x48 KC 512 NC 240 0.93 / 0.90 /
    // 0.94 / 0.96x; 8x48 KC 384 NC 336 0.93 / 0.97 / 0.91 / 0.90x. Rejected: 6x64 gains on the
    // squares what it loses on the projections (and in the attention), so 14x32 stays.
    t.nc = std::clamp<int64_t>(round_down(caches.l2 / 2 / (t.kc * f), uk.nr), uk.nr, 8192 / uk.nr * uk.nr);
    // MC: the MC x KC block of A is shared by all threads from L3; a quarter of L3, capped so the
    // packing buffer stays a few MiB (4088 rows x KC = 264 is 4 MiB).
    t.mc = std::clamp<int64_t>(round_down((zen5 ? 4 * caches.l2 : caches.l3 / 4) / (t.kc * f), uk.mr), uk.mr,
                               4096 / uk.mr * uk.mr);
    // Small problems: with few columns (P.V with Dv <= 64) or a short depth (Q.K^T with Dqk <= KC),
    // packing A costs as much as the product itself, so A is read in place. AVX2 (6x16), Zen 3,
    // 1 thread, against the packed path: n = 64 1.3-1.45x (512x64x512, 2048x64x2048), n = 128
    // 1.1-1.3x (1024x128x1024, 4096x128x512), n = 256 1.05-1.17x (512, 1024 and 4096 rows),
    // n = 512 0.9-1.0x (rejected), so up to 16 NR = 256 columns. AVX-512 keeps 2 NR = 64,
    // measured on Xeon and Zen 5 before the small-problem path packed B and blocked K.
    t.sup_max_n = (uk.isa == Isa::avx2 ? 16 : 2) * uk.nr;
    t.sup_max_k = t.kc;
    // One strip against a B from memory (larger than L2), at a stride that is not a multiple of
    // 4 KiB, takes its depth tile by tile or 8 rows at a time across the columns (sgemm_sup's
    // chain, which every 4 KiB stride takes). Intel Xeon (AMX), 1 thread, NN, tile by tile ->
    // chained, the same bits: 1x768x3072 1.16x, 1x768x2048 1.15x, 1x1280x1280 1.11x, 1x2000x2000
    // 1.08x, 1x1536x512 1.09x, 1x768x768 1.04x, 1x512x4096 1.07x, 2x768x3072 1.21x, 2x1536x512
    // 1.12x; but 3 rows 0.89-0.90x (3x1536x512, 3x2000x2000), 4-6 rows 0.82-0.99x, and B in L2
    // 0.82-0.94x (1x520x520, 2x512x512, 1x512x256), so 2 rows, B past 2 KC x NC (about L2). AVX2
    // (6x16) there: 1x2000x2000 1.18x, 1x768x3072 1.16x, 2x768x3072 1.47x, 4x1536x512 1.99x, 6 rows
    // 0.97x: 4 rows. Zen 5 had lost by it at such strides (1x2000x2000 0.86x, 1x2560x1024 0.88x,
    // 1x512x4096 0.90x against dnnl_sgemm's ratios, see sgemm_sup): AMD's cores keep to 4 KiB.
    // mha-tune searches this key (its rows phase). On the Xeon, 2026-11-26, full search, 1 thread,
    // against 2 (1x2000x2000, 2x3000x768, 4x1500x1000, 3x2000x2000, 6x2000x1000 NN): 0 0.989x
    // (1x2000x2000 0.921x), 1 1.004x, 3 0.978x, 4 0.948x (4x1500x1000 0.864x), 6 0.921x: 2 stays.
    // The newer Xeon (model 207, 2026-11-26 evening), full search, 1 / 2 threads: 0 0.993x /
    // 0.989x, 1 1.014x / 1.012x, 3 0.963x / 0.939x, 4 0.936x / 0.913x, 6 0.895x / 0.791x: 2 stays.
    // Again on 2026-11-28, 1 / 2 threads: 0 0.989x / 0.996x, 1 1.016x / 1.011x, 3 0.961x / 0.954x,
    // 4 0.926x / 0.925x, 6 0.883x / 0.908x; at 11:22: 0 0.989x / 1.003x, 1 1.014x / 1.014x, 3
    // 0.968x / 0.953x, 4 0.926x / 0.927x, 6 0.890x / 0.897x.
    t.sup_chain_rows = caches.amd ? 0 : uk.isa == Isa::avx512 ? 2 : 4;
    // The register transpose: shuffles on AMD's cores (two shuffle pipes; Zen 5 ran the inserts
    // 7-20% slower), inserts on Intel's (one shuffle port, which the FMAs share; model 207: the
    // attention's K^T 2-5% faster). The measurements are in gemm/transpose_variant.hpp; mha-tune
    // searches this key (its transpose step). Its full search on the Xeon (model 207, 2026-11-28),
    // 1 / 2 threads, the shuffles against the inserts: 0.900x / 0.894x (8x1536x512 NT 0.710x /
    // 0.692x, 6x1536x512 NT 0.770x / 0.749x, attention L1024 H8 D64 0.989x / 0.987x, the NT
    // projections 0.991-1.003x): the inserts stay.
    t.transpose = gemm::transpose_variant_name(caches.amd ? gemm::TransposeVariant::shuffles
                                                          : gemm::TransposeVariant::inserts);
    // Attention (FlashAttention's loop): a key step takes the item's rows one register panel at a
    // time through Q K^T, the fold and P V, so the panel's MR x BK scores (14 KiB at BK = 256)
    // stay in L1, while the packed K and V tiles (BK x D each: 128 KiB at D = 64) and the item's
    // accumulator stay in L2 for all its panels. K and V tiles are packed once per item and key
    // step (once per strip when it caches them), so a taller BQ spreads that cost over more
    // rows; a multiple of MR leaves no edge tiles. BQ = 8 MR = 112, BK = 256. Measured at
    // L = 2048, H = 8, D = 64 on one thread: BQ 112-224 ran 15-25% faster than 56 (before the
    // panel order; after it, 56-224 and BK 256-512 were all within noise).
    // Zen 3 (AVX2, BQ = 48): mha-tune's full search put BQ 12-96 with BK 256 within 0.98-1.03x of
    // the default and rejected BK 64 (0.83-0.87x) and BK 128 (0.93-0.98x).
    // AMD EPYC Zen 5 again (2026-11-24, a faster host: FMA probe 283 GFLOP/s), mha-tune's full
    // search, 1 thread: every other GEMM candidate 0.93-0.97x the defaults (14x32 KC 128-328 NC
    // 192-1536 MC 4088 0.95-0.97x, 6x64 0.93-0.96x, 8x48 0.93-0.95x; in mha-bench, MC 4088 at
    // 2048^3, one A block and B packed once, read 0.97-0.98x oneDNN as the defaults did); BK 512
    // 1.3-2.1% ahead of 256 at L1024/L2048 D64 for every BQ from 28 to 224 (BK 64 0.90x, 128
    // 0.95-0.96x). Against the
    // defaults in mha-bench (two runs each): L2048-4096 attention 1.00-1.04x, decode B1 1.02-1.05x,
    // B16 0.99x, but the paged-cache decode of the serving suite (B16 Lk4096) 0.97x; one BK serves
    // prefill and decode (their bits must match), so it stays 256.
    // Zen 5 once more (2026-11-24 07:57, after the GEMM's balanced row strips and narrow edge
    // tiles), mha-tune --quick, 1 thread: GEMM candidates 0.94-0.97x the defaults (14x32 KC
    // 128-264 NC 480-1024 MC 4088, 6x64 KC 80-168, 8x48 KC 104-216), attention BQ 56-224 with BK
    // 256 0.99-1.00x and BK 128 0.96x: the defaults stay.
    // Intel Xeon (AMX, avx512_fp16; 48 KiB L1d, 2 MiB L2; 2026-11-24), mha-tune's full search, 1
    // thread, before KC 512: the formulas' GEMM tiles best of 72 (14x32 KC 128-328 NC 384-3072
    // 0.96-1.00x, 6x64 0.90-0.96x, 8x48 0.93-0.99x); attention BK 512 1.02-1.03x at L1024/L2048 D64
    // for every BQ (28-224), BK 128 0.95x, BK 64 0.87-0.88x. BK 512 against 256 there (mha-bench,
    // 1 thread): L512 D64/D128 1.02x, serving prefill 1.01-1.03x, but decode B1-B4 Lk4096 0.95-0.98x
    // and the paged-cache decode (B16 Lk4096) 0.92x, as on Zen 5: BK stays 256. BQ 56/168/224
    // against 112 at L128/L512 D64/D128: 0.98-1.00x. The same Xeon's full search on 2026-11-26:
    // BK 512 1.013-1.018x for BQ 28-224 (under mha-tune's 2% bar, and decode's case above stands),
    // BK 256 with BQ 28-224 0.99-1.00x, BK 128 0.94-0.95x, BK 64 0.87-0.88x. Again at 14:41 that
    // day: BK 512 1.004-1.027x, BK 256 0.992-1.008x, BK 128 0.940-0.972x, BK 64 0.873-0.904x.
    // The newer Xeon (model 207, 2026-11-26 evening), full search, 1 / 2 threads, BQ 28-224: BK 512
    // 1.025-1.038x / 1.017-1.046x, BK 256 0.992-1.004x / 0.997-1.015x, BK 128 0.945-0.964x /
    // 0.949-0.964x, BK 64 0.874-0.892x / 0.872-0.882x. BK 512 is the tuner's pick there (L1024-2048
    // prefill only); the default stays 256 for decode's sake, as above. Again on 2026-11-28, 1 / 2
    // threads: BK 512 1.010-1.021x / 1.014-1.025x, BK 256 0.989-1.008x / 0.995-1.027x (BQ 224 the
    // 2-thread step's pick, then level with the defaults over all shapes, 1.00x: kept). Since
    // then the tuner's attention step also times a decode step (one query, Lk 4096, H32/8, D128;
    // there BK 512 0.99x, and the paged cache's decode of mha-bench's serving suite, B16, 0.96-0.99x):
    // at 11:22, 1 / 2 threads, BK 512 1.006-1.012x / 0.999-1.018x (decode 0.991-0.993x /
    // 0.991-0.999x), BK 256 0.993-0.999x / 0.992-0.999x, BK 128 0.968-0.978x / 0.970-0.977x, BK 64
    // 0.915-0.935x / 0.926-0.934x: the tuner keeps 256 on its own now.
    // A sequence's last block under BQ / 2 rows shares the last two blocks evenly (Shape::block_start:
    // L128 as 64 + 64, not 112 + 16): Xeon, 1 thread, H8 D64, L128 +2.7-2.9%, causal +5.7%.
    t.attn_block_q = 8 * uk.mr;
    t.attn_block_k = 256;
    // Chunks of 1024 keys: long enough that the per-chunk merge is noise, short enough to give two
    // threads work at Lk = 2048 in decode.
    t.attn_kv_chunk = 1024;
    // Threads only where they pay (mha-bench --filter threads --threads 2: each row's call on
    // every thread against one thread). AMD EPYC Zen 3, 2 threads: sgemm n^3 broke even at
    // n = 192-256 (14-34 MFLOP; 0.78x at 128^3, 1.16x at 384^3), the attention between L 32 and 64
    // at H8 D64 (2-8 MFLOP; 1.34x at L 128), softmax over 128 columns between 512 and 1024 rows
    // (0.58x at 64K elements, 1.41x at 128K). So a second thread from 16 MFLOP (rejected: 4 MFLOP
    // per thread, 0.8x on sgemm 128^3; 16 MFLOP keeps L 128 attention on one thread, 1.3x slower)
    // and from 128K elements.
    // AMD EPYC Zen 5 (AVX-512), 2 threads, each call after 300 us of other work on the calling
    // thread, so the arena's workers have gone to sleep (as between a server's calls; mha-bench's
    // interleaved rows see the same): sgemm n^3 0.69x at 128^3, 1.11x at 192^3, 1.30x at 256^3;
    // attention H8 D64 0.80x at L 32, 1.30x at L 64; softmax x128 0.88x at 128K elements, 0.98x at
    // 256K, 1.08x at 512K, 1.28x at 1M. The flops threshold holds; the softmax one (64K per thread
    // from Zen 3's back-to-back calls, where the workers were still awake) put the --quick softmax
    // rows at 0.81-0.93x of 1 thread, so elementwise work takes a second thread from 512K
    // elements (256K per thread; rejected: 128K, 0.98x at 256K elements).
    // Zen 5 again (2026-11-24 12:05), finer steps around the break-even, 2 threads forced against
    // 1, each call after 300 us (and 1 ms) of other work, medians: sgemm 144^3 (6.0 MFLOP) 0.88x,
    // 160^3 (8.2) 0.98-1.02x, 168^3 (9.5) 1.11-1.12x, 176^3 (10.9) 1.13-1.17x; attention H8 D64 L48
    // (4.7) 0.76x, L56 (6.4) 1.04x, L64 (8.4) 1.08-1.11x, L72 (10.6) 1.28-1.31x. So on Zen 5 a
    // second thread from 9.4 MFLOP (4.5 MFLOP a thread): at that size every entry point measured
    // gains (sgemm 6x1536x512 NT 1.09x, 300x64x256 1.08x, 64x300x256 NT 1.11x, 16x512x640 NT
    // 1.03x, 12x1024x512 1.06x, 8x1536x512 NT 1.40x; attention B2 L48 1.24x, L48 D128 1.26x, L72
    // 1.29x), where 16 MFLOP had left them on one thread. Intel Xeon (AMX, avx512_fp16; 2026-11-24,
    // mha-bench's threads rows, 2 threads forced against the default, two runs): sgemm 128^3 (4.2
    // MFLOP) 1.04-1.06x slower forced, 192^3 (14.2) 1.02-1.04x slower, 256^3 (33.5) 1.00x (the default
    // takes 2 threads there, 1.02-1.08x faster than 1); attention H8 D64 L32 (2.1) 1.38-1.51x
    // slower forced, L64 (8.4) 0.90-0.98x (2-10% faster forced), L128 1.43-1.44x faster than 1
    // thread. Softmax x128 there depends on whether the workers are awake: mha-bench's rows (back to
    // back) had 2 threads forced faster at 64K-128K elements (0.65-0.89x the time) but slower at
    // 256K (1.03-1.14x); a driver timing the three runtimes in shuffled order, 2 threads forced
    // against 1: after 300 us of other work (workers asleep, as between a server's calls) 0.38x at
    // 32K, 0.52x at 64K, 0.67x at 128K, 0.92x at 256K, 2.2x at 512K; back to back 1.13x at 64K,
    // 1.44x at 128K, 0.91x at 256K. So 256K a thread stays (a second thread from 512K elements).
    // The GEMM's break-even lies above 14 MFLOP there, the attention's at about 8: 16 MFLOP (8 a
    // thread) stays for both. Elsewhere (Zen 3 above; Zen 4 unmeasured) 8 MFLOP a thread too.
    // mha-tune searches both keys on more than one thread (its threads and elems steps, each call
    // after 300 us of work on the calling thread). The Xeon, 2026-11-26, 2 threads, full search,
    // against 8 MFLOP (sgemm 128^3-256^3, attention H8 D64 L48-L96): 2 MFLOP 0.852x (128^3 0.564x,
    // 160^3 0.767x, L48 0.852x), 4 MFLOP 0.994x, 16 MFLOP 0.955x (L96 0.733x), 32 MFLOP 0.924x
    // (256^3 0.774x); quick search, against 256K elements (softmax x128): 128K 1.001x, 512K 0.734x
    // (4096 rows, 512K elements, left on one thread: 0.538x). Both stay.
    // The newer Xeon (model 207, 2026-11-26 evening), 2 threads, full search: 2 MFLOP 0.895x (128^3
    // 0.695x, L48 0.824x), 4 MFLOP 1.004x, 16 MFLOP 0.955x (L96 0.739x), 32 MFLOP 0.917x (256^3
    // 0.742x): 8 stays. Elements: 64K 0.969x (1024x128 0.810x), 128K 1.041x (2048x128 1.216x), 512K
    // 0.927x, 1M 0.840x. A driver timing softmax x128 on 1 thread against 2 forced (shuffled, each
    // call after 300 us of other work): 256 rows 0.53x, 512 0.68x, 1024 (128K elements) 0.99x,
    // 2048 (256K) 1.21x, 4096 1.45x; back to back 1.55x from 1024 rows. So this host wakes a
    // worker for less than the other Xeon's (256K elements 0.92x there): the break-even follows the
    // hypervisor more than the core. 256K a thread stays; mha-tune --threads 2 finds 128K on such
    // a host and writes it. Again on 2026-11-28 (2 threads, full search): 2 MFLOP 0.862x, 4 MFLOP
    // 0.956x, 16 MFLOP 0.997x, 32 MFLOP 0.982x; elements 64K 0.949x, 128K 1.016x, 512K 0.962x, 1M
    // 0.847x: both stay. At 11:22: 2 MFLOP 0.878x, 4 MFLOP 0.958x, 16 MFLOP 0.944x, 32 MFLOP
    // 0.930x; elements 64K 1.001x, 128K 1.021x (the step's pick; the whole set then 1.00x against the
    // defaults over every shape), 512K 0.938x, 1M 0.857x. 128K cleared the 2% bar by 0.1% once in
    // two searches: 256K stays.
    t.parallel_min_flops = zen5 ? int64_t{9} << 19 : int64_t{8} << 20;
    t.parallel_min_elems = int64_t{256} << 10;
    return t;
}

void TileConfig::validate(Isa isa) const {
    const auto *uk = gemm::find_sgemm_kernel(gemm_ukernel);
    if (!uk) invalid_argument("tile config: gemm_ukernel '" + gemm_ukernel + "' is not a known microkernel");
    if (uk->isa != isa)
        invalid_argument("tile config: gemm_ukernel '" + gemm_ukernel + "' is for " +
                         std::string(isa_name(uk->isa)) + ", but the runtime uses " + std::string(isa_name(isa)));
    auto check = [](bool ok, const char *field, const std::string &why) {
        if (!ok) invalid_argument(std::string("tile config: ") + field + " " + why);
    };
    check(kc >= 1 && kc <= 16384, "kc", "must be in [1, 16384]");
    check(mc >= uk->mr && mc <= 65536 && mc % uk->mr == 0, "mc",
          "must be a multiple of MR = " + std::to_string(uk->mr) + " in [MR, 65536]");
    check(nc >= uk->nr && nc <= 65536 && nc % uk->nr == 0, "nc",
          "must be a multiple of NR = " + std::to_string(uk->nr) + " in [NR, 65536]");
    check(sup_max_n >= 0 && sup_max_n <= 65536, "sup_max_n", "must be in [0, 65536]");
    check(sup_max_k >= 0 && sup_max_k <= 65536, "sup_max_k", "must be in [0, 65536]");
    check(attn_block_q >= 1 && attn_block_q <= 4096, "attn_block_q", "must be in [1, 4096]");
    check(attn_block_k >= 1 && attn_block_k <= 8192, "attn_block_k", "must be in [1, 8192]");
    check(attn_kv_chunk >= attn_block_k && attn_kv_chunk <= (1 << 24) && attn_kv_chunk % attn_block_k == 0,
          "attn_kv_chunk", "must be a multiple of attn_block_k, at most 2^24");
    check(sup_chain_rows >= 0 && sup_chain_rows <= 64, "sup_chain_rows", "must be in [0, 64]");
    check(gemm::parse_transpose_variant(transpose).has_value(), "transpose",
          "must be \"shuffles\" or \"inserts\", got \"" + transpose + "\"");
    check(parallel_min_flops >= 0 && parallel_min_flops <= (int64_t{1} << 50), "parallel_min_flops", "must be in [0, 2^50]");
    check(parallel_min_elems >= 0 && parallel_min_elems <= (int64_t{1} << 50), "parallel_min_elems", "must be in [0, 2^50]");
}

} // namespace mha
