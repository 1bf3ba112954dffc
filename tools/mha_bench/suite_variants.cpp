// mha-bench: the variants suite, the attention of today's decoders.
#include <cstdio>

#include "bench/layer_fixture.hpp"
#include "mha/attention.hpp"
#include "mha/serving.hpp"

#include "bench_tool.hpp"

namespace mha::bench_tool {

// ---- variants: the attention of today's decoders (issue 20) -------------------------------------
// Each row beside the same call without its feature: window 1024 at L 16384 (GFLOP/s over the
// visible pairs only, beside plain causal L 2048), softcap, ALiBi and sinks at L 2048, RoPE in the
// layer at B8 L128, the int8 cache in the serving decode shape, and head dims 64 to 256 at L 1024
// (their share of the FMA probe).
void suite_variants(Context &ctx, const std::regex *filter, std::vector<Row> &rows) {
    auto wanted = [&](const std::string &name) { return !ctx.opt.quick && selected(filter, name); };
    auto fill = [](std::vector<float> &x, size_t n, uint64_t seed) {
        x.resize(n);
        bench::fill_hashed(x.data(), n, seed, 1.0f);
    };
    const int64_t H = 8;
    // (a) attention rows: name, L, D, causal, the variant; work = 4 D H x visible pairs.
    struct AttnRow {
        std::string name;
        int64_t L, D;
        bool causal;
        int64_t window;
        float softcap;
        bool alibi, sinks;
    };
    std::vector<AttnRow> attn = {{"window1024", 16384, 64, true, 1024, 0, false, false},
                                 {"softcap", 2048, 64, false, 0, 30.0f, false, false},
                                 {"alibi", 2048, 64, false, 0, 0, true, false},
                                 {"sinks", 2048, 64, false, 0, 0, false, true}};
    for (int64_t D : {64, 80, 96, 112, 128, 256}) attn.push_back({std::string("D") + std::to_string(D), 1024, D, false, 0, 0, false, false});
    std::vector<float> slopes, sinks;
    for (int64_t h = 0; h < H; ++h) {
        slopes.push_back(std::exp2(-8.0f * static_cast<float>(h + 1) / static_cast<float>(H)));
        sinks.push_back(0.5f);
    }
    for (const AttnRow &a : attn) {
        const std::string shape = std::string("L") + std::to_string(a.L) + " H8 D" + std::to_string(a.D) + (a.causal ? " causal" : "");
        if (!wanted("variants/" + a.name + "/" + shape)) continue;
        std::vector<float> q, k, v, out(static_cast<size_t>(a.L * H * a.D));
        fill(q, out.size(), 31);
        fill(k, out.size(), 32);
        fill(v, out.size(), 33);
        AttentionParams p;
        p.batch = 1; p.q_len = p.kv_len = a.L; p.num_heads = p.num_kv_heads = H; p.head_dim = p.value_dim = a.D;
        p.causal = a.causal;
        AttentionParams plain = p;
        p.variant = AttentionVariant{a.window, a.softcap, a.alibi ? slopes.data() : nullptr, a.sinks ? sinks.data() : nullptr};
        double pairs = 0;
        for (int64_t i = 0; i < a.L; ++i) {
            const int64_t hi = a.causal ? i + 1 : a.L, lo = a.window ? std::max<int64_t>(0, i - a.window + 1) : 0;
            pairs += static_cast<double>(hi - lo);
        }
        // Plain causal attention at L 2048: the window row's target compares GFLOP/s with it.
        AttentionParams ref2048 = plain;
        ref2048.q_len = ref2048.kv_len = std::min<int64_t>(2048, a.L);
        for (int threads : ctx.opt.threads) {
            std::fprintf(stderr, "variants %s %s threads=%d\n", a.name.c_str(), shape.c_str(), threads);
            Runtime rt(RuntimeOptions{threads, {}, {}, {}});
            std::vector<Anchor> anchors;
            if (a.window)
                anchors.push_back({"causal L2048", [&] { attention(rt, ref2048, q.data(), k.data(), v.data(), out.data()); }});
            else if (a.softcap != 0.0f || a.alibi || a.sinks)
                anchors.push_back({"plain", [&] { attention(rt, plain, q.data(), k.data(), v.data(), out.data()); }});
            measure(ctx, Row{"variants", a.name, shape, threads, 0, 0, "GFLOP/s", -1, {}},
                    4.0 * static_cast<double>(a.D * H) * pairs, [&] { attention(rt, p, q.data(), k.data(), v.data(), out.data()); },
                    anchors, rows);
            if (a.window) {  // the L 2048 anchor's GFLOP/s over its causal pairs, for the 0.8x target
                Row &r = rows.back();
                const double t2048 = r.ms * 1e-3 * r.vs.back().second;
                r.extra["causal_L2048_gflops"] = 4.0 * static_cast<double>(a.D * H) * (2048.0 * 2049.0 / 2.0) / t2048 * 1e-9;
                // What the target reads: this row's GFLOP/s over its visible pairs against that one's
                // (the column shows this ratio, not the usual time ratio).
                r.vs.back() = {"causal L2048 GF/s", r.extra["causal_L2048_gflops"].get<double>() > 0
                                                         ? r.rate / r.extra["causal_L2048_gflops"].get<double>() : 0.0};
            }
        }
    }
    // (b) RoPE in the layer at B8 L128 E512 H8, beside the same layer without it.
    if (wanted("variants/rope/B8 L128 E512 H8")) {
        const bench::LayerShape s{8, 128, 512, 8, false};
        for (int threads : ctx.opt.threads) {
            std::fprintf(stderr, "variants rope %s threads=%d\n", s.str().c_str(), threads);
            Runtime rt(RuntimeOptions{threads, {}, {}, {}});
            bench::LayerFixture f(rt, s);
            LayerConfig c = f.layer->config();
            c.rope.dims = 64;
            const Layer roped(rt, c, LayerWeights::from_in_proj(c, f.w_in.data(), f.b_in.data(), f.w_out.data(), f.b_out.data()));
            measure(ctx, Row{"variants", "rope", s.str(), threads, 0, 0, "GFLOP/s", -1, {}}, s.flops(),
                    [&] { roped.forward(rt, f.forward_params, f.x.data(), nullptr, nullptr, f.out.data()); },
                    {{"no rope", [&] { f.forward(rt); }}}, rows);
        }
    }
    // (c) Decode from an int8 cache, the serving decode shape, beside the fp32 cache.
    const bench::DecodeShape d = {16, 4096, 32, 8, 128, false};
    if (wanted(std::string("variants/decode_i8/") + d.str())) {
        const int64_t B = d.batch, L = d.kv_len, Hq = d.heads, Hkv = d.kv_heads, D = d.dim, kvrow = Hkv * D;
        std::vector<float> q, k, v, out(static_cast<size_t>(B * Hq * D));
        fill(q, out.size(), 41);
        fill(k, static_cast<size_t>(B * L * kvrow), 42);
        fill(v, k.size(), 43);
        Runtime setup(RuntimeOptions{1, {}, {}, {}});
        KVCacheConfig cc;
        cc.num_kv_heads = Hkv; cc.head_dim = cc.value_dim = D;
        cc.max_tokens = B * cache_tokens_for(setup, L);
        KVCache f32(setup, cc);
        cc.dtype = DType::i8;
        KVCache i8(setup, cc);
        for (int64_t b = 0; b < B; ++b) {
            f32.append(b, L, k.data() + b * L * kvrow, v.data() + b * L * kvrow);
            i8.append(b, L, k.data() + b * L * kvrow, v.data() + b * L * kvrow);
        }
        std::vector<int64_t> ids(static_cast<size_t>(B)), offsets(static_cast<size_t>(B + 1));
        std::iota(ids.begin(), ids.end(), 0);
        std::iota(offsets.begin(), offsets.end(), 0);
        CachedParams p;
        p.num_seqs = B; p.seq_ids = ids.data(); p.q_offsets = offsets.data(); p.num_heads = Hq; p.causal = true;
        for (int threads : ctx.opt.threads) {
            std::fprintf(stderr, "variants decode_i8 %s threads=%d\n", d.str().c_str(), threads);
            Runtime rt(RuntimeOptions{threads, {}, {}, {}});
            // GB/s of the int8 bytes read (a scale per token and head included).
            const double bytes = static_cast<double>(B * L * Hkv) * (2.0 * static_cast<double>(D) + 8.0);
            measure(ctx, Row{"variants", "decode_i8", d.str(), threads, 0, 0, "GB/s", -1, {}}, bytes,
                    [&] { attention_cached(rt, i8, p, q.data(), out.data()); },
                    {{"f32 cache", [&] { attention_cached(rt, f32, p, q.data(), out.data()); }}}, rows);
            Row &r = rows.back();
            r.extra["tokens_per_s"] = static_cast<double>(B) / (r.ms * 1e-3);
            r.extra["cache_bytes"] = i8.bytes();
        }
    }
}

} // namespace mha::bench_tool
