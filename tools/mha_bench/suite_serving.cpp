// mha-bench: the serving suite: ragged prefill, decode and a continuous batch through the KV cache.
#include <algorithm>
#include <cstdio>
#include <cstring>

#include "mha/attention.hpp"
#include "mha/serving.hpp"

#include "bench_tool.hpp"

namespace mha::bench_tool {

int64_t cache_tokens_for(const Runtime &rt, int64_t len) {
    const int64_t bk = std::max<int64_t>(rt.tiles().attn_block_k, 1);
    return (len + bk - 1) / bk * bk;
}

namespace {

Row serving_row(const std::string &name, const std::string &shape, int threads, const char *unit) {
    Row r;
    r.suite = "serving";
    r.name = name;
    r.shape = shape;
    r.threads = threads;
    r.unit = unit;
    return r;
}

bool same_bits(const std::vector<float> &a, const std::vector<float> &b) {
    return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// (a) The prompt mix prefilled in one mha::attention_varlen call (causal), beside the same batch
// padded to the longest prompt through mha::attention and one mha::attention call per prompt.
// Padding: each prompt's rows at the front of its batch entry, zeros after; q_len = kv_len = the
// longest, causal (bottom-right is top-left when q_len = kv_len) and kv_valid_lens = the prompt
// lengths, so the real rows see exactly their causal prefix and the padded query rows are computed
// and thrown away, as a server that pads does. GFLOP/s counts the useful causal work only:
// 4 D H per visible (query, key) pair, 2 L (L + 1) D H per prompt, for all three.
void serving_prefill(Context &ctx, const std::regex *filter, std::vector<Row> &rows) {
    const std::vector<int64_t> &lens = bench::serving_prompt_lens();
    const int64_t S = static_cast<int64_t>(lens.size()), Lmax = *std::max_element(lens.begin(), lens.end());
    std::vector<int64_t> offsets(static_cast<size_t>(S + 1), 0);
    std::partial_sum(lens.begin(), lens.end(), offsets.begin() + 1);
    const int64_t T = offsets.back();
    std::vector<int32_t> valid(lens.begin(), lens.end());
    for (const auto &h : bench::serving_prefill_heads()) {
        if (ctx.opt.quick && !h.quick) continue;
        const std::string shape = "mix" + std::to_string(S) + " T" + std::to_string(T) + " " + h.str() + " causal";
        if (!selected(filter, "serving/prefill/" + shape)) continue;
        const int64_t H = h.heads, Hkv = h.kv_heads, D = h.dim, qrow = H * D, kvrow = Hkv * D;
        std::vector<float> q(static_cast<size_t>(T * qrow)), k(static_cast<size_t>(T * kvrow)), v(k.size()),
            out(q.size()), out_seq(q.size());
        bench::fill_hashed(q.data(), q.size(), 1, 1.0f);
        bench::fill_hashed(k.data(), k.size(), 2, 1.0f);
        bench::fill_hashed(v.data(), v.size(), 3, 1.0f);
        std::vector<float> qp(static_cast<size_t>(S * Lmax * qrow), 0.0f), kp(static_cast<size_t>(S * Lmax * kvrow), 0.0f),
            vp(kp.size(), 0.0f), outp(qp.size());
        for (int64_t s = 0; s < S; ++s) {
            const auto L = lens[static_cast<size_t>(s)], o = offsets[static_cast<size_t>(s)];
            std::copy_n(q.begin() + o * qrow, L * qrow, qp.begin() + s * Lmax * qrow);
            std::copy_n(k.begin() + o * kvrow, L * kvrow, kp.begin() + s * Lmax * kvrow);
            std::copy_n(v.begin() + o * kvrow, L * kvrow, vp.begin() + s * Lmax * kvrow);
        }
        VarlenParams p;
        p.num_seqs = S;
        p.q_offsets = p.kv_offsets = offsets.data();
        p.num_heads = H; p.num_kv_heads = Hkv; p.head_dim = p.value_dim = D;
        p.causal = true;
        AttentionParams padded;
        padded.batch = S; padded.q_len = padded.kv_len = Lmax;
        padded.num_heads = H; padded.num_kv_heads = Hkv; padded.head_dim = padded.value_dim = D;
        padded.causal = true;
        padded.kv_valid_lens = valid.data();
        double flops = 0;
        for (int64_t L : lens) flops += 4.0 * static_cast<double>(D * H) * bench::causal_pairs(L, L);
        auto per_seq = [&](Runtime &r) {
            for (int64_t s = 0; s < S; ++s) {
                AttentionParams one = padded;
                one.batch = 1;
                one.q_len = one.kv_len = lens[static_cast<size_t>(s)];
                one.kv_valid_lens = nullptr;
                const int64_t o = offsets[static_cast<size_t>(s)];
                attention(r, one, q.data() + o * qrow, k.data() + o * kvrow, v.data() + o * kvrow, out_seq.data() + o * qrow);
            }
        };
        for (int threads : ctx.opt.threads) {
            std::fprintf(stderr, "serving prefill %s threads=%d\n", shape.c_str(), threads);
            Runtime rt(RuntimeOptions{threads, {}, {}, {}}), rt1(RuntimeOptions{1, {}, {}, {}});
            std::vector<Anchor> anchors = {
                {"padded", [&] { attention(rt, padded, qp.data(), kp.data(), vp.data(), outp.data()); }},
                {"per-seq", [&] { per_seq(rt); }}};
            if (threads > 1)
                anchors.push_back({"1 thread", [&] { attention_varlen(rt1, p, q.data(), k.data(), v.data(), out.data()); }, 1});
            measure(ctx, serving_row("prefill", shape, threads, "GFLOP/s"), flops,
                    [&] { attention_varlen(rt, p, q.data(), k.data(), v.data(), out.data()); }, anchors, rows);
            Row &r = rows.back();
            r.extra["seq_lens"] = lens;
            r.extra["tokens"] = T;
            r.extra["tokens_per_s"] = static_cast<double>(T) / (r.ms * 1e-3);
            r.extra["flops_counted"] = "causal";
            r.same_bits.emplace_back("per-seq", same_bits(out, out_seq));
            bool pad_same = true;
            for (int64_t s = 0; s < S && pad_same; ++s)
                pad_same = std::memcmp(outp.data() + s * Lmax * qrow, out.data() + offsets[static_cast<size_t>(s)] * qrow,
                                       static_cast<size_t>(lens[static_cast<size_t>(s)] * qrow) * sizeof(float)) == 0;
            r.same_bits.emplace_back("padded", pad_same);
        }
    }
}

// (b) One decode step of B sequences of L cached tokens each (fp32 cache): one query per sequence
// through mha::attention_cached, as GB/s of the K and V bytes of every cached token, against the
// read probe; beside it the same step through dense mha::attention (batch B, q_len 1, K and V
// contiguous per sequence). The cache is filled once; attention does not append, so every
// repetition reads the same L tokens.
void serving_decode(Context &ctx, const std::regex *filter, std::vector<Row> &rows) {
    const bench::DecodeShape s = {16, 4096, 32, 8, 128, true};
    if (!selected(filter, "serving/decode/" + s.str())) return;
    const int64_t B = s.batch, L = s.kv_len, H = s.heads, Hkv = s.kv_heads, D = s.dim, kvrow = Hkv * D;
    std::vector<float> q(static_cast<size_t>(B * H * D)), k(static_cast<size_t>(B * L * kvrow)), v(k.size()),
        out(q.size()), out_dense(q.size());
    bench::fill_hashed(q.data(), q.size(), 11, 1.0f);
    bench::fill_hashed(k.data(), k.size(), 12, 1.0f);
    bench::fill_hashed(v.data(), v.size(), 13, 1.0f);
    Runtime setup(RuntimeOptions{1, {}, {}, {}});  // the cache's runtime (outlives it)
    KVCacheConfig cc;
    cc.num_kv_heads = Hkv; cc.head_dim = cc.value_dim = D;
    cc.max_tokens = B * cache_tokens_for(setup, L);
    KVCache cache(setup, cc);
    std::vector<int64_t> ids(static_cast<size_t>(B)), offsets(static_cast<size_t>(B + 1));
    std::iota(ids.begin(), ids.end(), 0);
    std::iota(offsets.begin(), offsets.end(), 0);
    for (int64_t b = 0; b < B; ++b) cache.append(b, L, k.data() + b * L * kvrow, v.data() + b * L * kvrow);
    CachedParams p;
    p.num_seqs = B; p.seq_ids = ids.data(); p.q_offsets = offsets.data(); p.num_heads = H; p.causal = true;
    AttentionParams dense;
    dense.batch = B; dense.q_len = 1; dense.kv_len = L;
    dense.num_heads = H; dense.num_kv_heads = Hkv; dense.head_dim = dense.value_dim = D;
    dense.causal = true;
    for (int threads : ctx.opt.threads) {
        std::fprintf(stderr, "serving decode %s threads=%d\n", s.str().c_str(), threads);
        Runtime rt(RuntimeOptions{threads, {}, {}, {}}), rt1(RuntimeOptions{1, {}, {}, {}});
        std::vector<Anchor> anchors = {
            {"dense", [&] { attention(rt, dense, q.data(), k.data(), v.data(), out_dense.data()); }}};
        if (threads > 1) anchors.push_back({"1 thread", [&] { attention_cached(rt1, cache, p, q.data(), out.data()); }, 1});
        measure(ctx, serving_row("decode", s.str(), threads, "GB/s"), s.kv_bytes(),
                [&] { attention_cached(rt, cache, p, q.data(), out.data()); }, anchors, rows);
        Row &r = rows.back();
        r.extra["cached_tokens"] = B * L;
        r.extra["cache_bytes"] = cache.bytes();
        r.extra["tokens_per_s"] = static_cast<double>(B) / (r.ms * 1e-3);
        r.same_bits.emplace_back("dense", same_bits(out, out_dense));
    }
}

// (c) One step of a continuous batch in one mha::attention_cached call: prefill chunks (their
// queries are the last `chunk` of prefill_cached + chunk cached tokens, causal) beside decodes
// (one query over decode_cached tokens). The K and V of every token, the new ones included, are
// appended once before timing (attention does not append), so the lengths stay fixed. Anchors:
// "split", the same step as two attention_cached calls (the chunks, then the decodes), and
// "dense", the same two groups through mha::attention on contiguous K and V. GFLOP/s counts
// 4 D H per visible (query, key) pair.
void serving_continuous(Context &ctx, const std::regex *filter, std::vector<Row> &rows) {
    const bench::ContinuousShape &c = bench::serving_continuous_shape();
    if (ctx.opt.quick && !c.heads.quick) return;
    if (!selected(filter, "serving/continuous/" + c.str())) return;
    const int64_t H = c.heads.heads, Hkv = c.heads.kv_heads, D = c.heads.dim, qrow = H * D, kvrow = Hkv * D;
    const int64_t NP = c.prefills, ND = c.decodes, Lp = c.prefill_cached + c.chunk, Ld = c.decode_cached;
    const int64_t Tq = c.new_tokens(), pre_rows = NP * c.chunk;
    std::vector<float> q(static_cast<size_t>(Tq * qrow)), out(q.size()), out_split(q.size()), out_dense(q.size());
    std::vector<float> kp(static_cast<size_t>(NP * Lp * kvrow)), vp(kp.size()), kd(static_cast<size_t>(ND * Ld * kvrow)),
        vd(kd.size());
    bench::fill_hashed(q.data(), q.size(), 21, 1.0f);
    bench::fill_hashed(kp.data(), kp.size(), 22, 1.0f);
    bench::fill_hashed(vp.data(), vp.size(), 23, 1.0f);
    bench::fill_hashed(kd.data(), kd.size(), 24, 1.0f);
    bench::fill_hashed(vd.data(), vd.size(), 25, 1.0f);
    Runtime setup(RuntimeOptions{1, {}, {}, {}});
    KVCacheConfig cc;
    cc.num_kv_heads = Hkv; cc.head_dim = cc.value_dim = D;
    cc.max_tokens = NP * cache_tokens_for(setup, Lp) + ND * cache_tokens_for(setup, Ld);
    KVCache cache(setup, cc);
    std::vector<int64_t> ids(static_cast<size_t>(NP + ND)), offsets(static_cast<size_t>(NP + ND + 1), 0);
    std::iota(ids.begin(), ids.end(), 0);
    for (int64_t s = 0; s < NP; ++s) {
        cache.append(s, Lp, kp.data() + s * Lp * kvrow, vp.data() + s * Lp * kvrow);
        offsets[static_cast<size_t>(s + 1)] = (s + 1) * c.chunk;
    }
    for (int64_t s = 0; s < ND; ++s) {
        cache.append(NP + s, Ld, kd.data() + s * Ld * kvrow, vd.data() + s * Ld * kvrow);
        offsets[static_cast<size_t>(NP + s + 1)] = pre_rows + s + 1;
    }
    CachedParams all;
    all.num_seqs = NP + ND; all.seq_ids = ids.data(); all.q_offsets = offsets.data(); all.num_heads = H;
    all.causal = true;
    std::vector<int64_t> dec_offsets(static_cast<size_t>(ND + 1));
    std::iota(dec_offsets.begin(), dec_offsets.end(), 0);
    CachedParams pre = all, dec = all;
    pre.num_seqs = NP;
    dec.num_seqs = ND; dec.seq_ids = ids.data() + NP; dec.q_offsets = dec_offsets.data();
    AttentionParams dpre, ddec;
    for (AttentionParams *a : {&dpre, &ddec}) {
        a->num_heads = H; a->num_kv_heads = Hkv; a->head_dim = a->value_dim = D; a->causal = true;
    }
    dpre.batch = NP; dpre.q_len = c.chunk; dpre.kv_len = Lp;
    ddec.batch = ND; ddec.q_len = 1; ddec.kv_len = Ld;
    const double pairs = static_cast<double>(NP) * bench::causal_pairs(c.chunk, Lp) +
                         static_cast<double>(ND) * bench::causal_pairs(1, Ld);
    const double flops = 4.0 * static_cast<double>(D * H) * pairs;
    const double kv_bytes = 2.0 * 4.0 * static_cast<double>(c.cached_tokens() * kvrow);
    for (int threads : ctx.opt.threads) {
        std::fprintf(stderr, "serving continuous %s threads=%d\n", c.str().c_str(), threads);
        Runtime rt(RuntimeOptions{threads, {}, {}, {}}), rt1(RuntimeOptions{1, {}, {}, {}});
        std::vector<Anchor> anchors = {
            {"split", [&] {
                 attention_cached(rt, cache, pre, q.data(), out_split.data());
                 attention_cached(rt, cache, dec, q.data() + pre_rows * qrow, out_split.data() + pre_rows * qrow);
             }},
            {"dense", [&] {
                 attention(rt, dpre, q.data(), kp.data(), vp.data(), out_dense.data());
                 attention(rt, ddec, q.data() + pre_rows * qrow, kd.data(), vd.data(), out_dense.data() + pre_rows * qrow);
             }}};
        if (threads > 1) anchors.push_back({"1 thread", [&] { attention_cached(rt1, cache, all, q.data(), out.data()); }, 1});
        measure(ctx, serving_row("continuous", c.str(), threads, "GFLOP/s"), flops,
                [&] { attention_cached(rt, cache, all, q.data(), out.data()); }, anchors, rows);
        Row &r = rows.back();
        r.extra["new_tokens"] = Tq;
        r.extra["tokens_per_s"] = static_cast<double>(Tq) / (r.ms * 1e-3);
        r.extra["cached_tokens"] = c.cached_tokens();
        r.extra["kv_gbs"] = kv_bytes / (r.ms * 1e-3) * 1e-9;
        r.extra["flops_counted"] = "causal";
        r.same_bits.emplace_back("split", same_bits(out, out_split));
        r.same_bits.emplace_back("dense", same_bits(out, out_dense));
    }
}

} // namespace

void suite_serving(Context &ctx, const std::regex *filter, std::vector<Row> &rows) {
    serving_prefill(ctx, filter, rows);
    serving_decode(ctx, filter, rows);
    serving_continuous(ctx, filter, rows);
}

} // namespace mha::bench_tool
