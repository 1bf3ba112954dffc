// The same bits however a token is batched: mha_attention alone, varlen beside other sequences,
// the cache in chunks and decode steps, and the layer's incremental forward (see serving_util.hpp).
#include <doctest/doctest.h>

#include "serving_util.hpp"

using namespace mha;
using namespace serving_test;

namespace {

struct InvCase {
    const char *what;
    Shape s;
    int64_t L;
    bool small_tiles;
};

// L = 1100 crosses 4 default key tiles and a 1024-key chunk, L = 2100 two chunks; L = 300 crosses 4
// small tiles and 2 chunks.
const InvCase kInvCases[] = {
    {"default tiles, L 1100", {4, 2, 32, 32}, 1100, false},
    {"default tiles, GQA 8/2 D64, L 2100 (two chunks)", {8, 2, 64, 64}, 2100, false},
    {"default tiles, odd dims 13/7, L 600", {6, 3, 13, 7}, 600, false},
    {"tiles 5/64/128, L 300", {4, 2, 32, 32}, 300, true},
    {"tiles 5/64/128, MQA odd dims, L 150", {4, 1, 13, 7}, 150, true},
};

} // namespace

TEST_CASE("bit-identity: mha_attention alone = varlen beside others = cached prefill, chunks, decode; 1 and 2 threads") {
    for (Isa isa : supported_isas())
        for (const InvCase &ic : kInvCases) {
            // Reduced (tools/tsan): not L 2100, most of the time; L 1100 still crosses a chunk with
            // default tiles, and L 300 two with small ones.
            if (test::reduced() && ic.L > 1100) continue;
            const Setup su = ic.small_tiles ? tiles_setup(isa, 5, 64, 128) : default_setup(isa);
            CAPTURE(su.name);
            CAPTURE(ic.what);
            const Shape &s = ic.s;
            const int64_t L = ic.L, row = s.o_row();
            Rt r1(1, su), r2(2, su);
            const SeqData t(s, L, 1000);
            const auto F = dense(r1, s, L, L, true, t.q.data(), t.k.data(), t.v.data());
            same_rows(dense(r2, s, L, L, true, t.q.data(), t.k.data(), t.v.data()).data(), F.data(), L, row,
                      "mha_attention on 2 threads");
            // Sanity against the reference: the first 40 rows and the last 24 (which see every key).
            close_to(F.data(), reference(s, 40, 40, true, t.q.data(), t.k.data(), t.v.data()), "first rows vs reference");
            close_to(F.data() + (L - 24) * row, reference(s, 24, L, true, t.q.data() + (L - 24) * s.q_row(), t.k.data(), t.v.data()),
                     "last rows vs reference");

            // Varlen with other sequences before and after it.
            {
                const SeqData a(s, 37, 1001), b(s, 3, 300, 1002), e(s, 0, 9, 1003), f(s, L / 2 + 5, 1004), g(s, 4, 0, 1005);
                {
                    Ragged rg(s);
                    for (const SeqData *d : {&a, &t, &b, &e, &f, &g}) rg.add(*d);
                    std::vector<float> out(sz(rg.total_q() * row), test::kSentinel);
                    rg.run(r2, true, out.data());
                    same_rows(out.data() + rg.qo[1] * row, F.data(), L, row, "varlen, second of six, 2 threads");
                    same_rows(out.data(), dense(r1, s, 37, 37, true, a.q.data(), a.k.data(), a.v.data()).data(), 37, row,
                              "varlen, a neighbour vs alone");
                    same_rows(out.data() + rg.qo[2] * row, dense(r1, s, 3, 300, true, b.q.data(), b.k.data(), b.v.data()).data(), 3,
                              row, "varlen, a neighbour with Lq < Lk vs alone");
                }
                {
                    Ragged rg(s);
                    for (const SeqData *d : {&t, &f, &b}) rg.add(*d);
                    std::vector<float> out(sz(rg.total_q() * row), test::kSentinel);
                    rg.run(r1, true, out.data());
                    same_rows(out.data(), F.data(), L, row, "varlen, first of three, 1 thread");
                }
                {
                    Ragged rg(s);
                    rg.add(t);
                    std::vector<float> out(sz(L * row), test::kSentinel);
                    rg.run(r2, true, out.data());
                    same_rows(out.data(), F.data(), L, row, "varlen, alone");
                }
            }

            // Through the cache: one prefill, two chunkings (one beside a decoding neighbour), decode
            // one token at a time.
            {
                const int64_t bt = block_tokens_for(r1, s);
                Cache c(r1, s, capacity(bt, {L, L, L, L, L}));
                // One call.
                append(r1, c, s, 1, t, 0, L);
                {
                    std::vector<float> out(sz(L * row), test::kSentinel);
                    REQUIRE_MESSAGE(cached(r1, c, {1}, {0, L}, s.H, true, t.q.data(), out.data()) == MHA_OK, mha_last_error());
                    same_rows(out.data(), F.data(), L, row, "cached prefill in one call");
                    std::vector<float> k, v;
                    c.read(1, 0, L, s, k, v);
                    CHECK(test::same_bits(k, t.k));
                    CHECK(test::same_bits(v, t.v));
                    // Non-causal over the whole cache: the last 5 queries = mha_attention without the mask.
                    std::vector<float> nc(sz(5 * row), test::kSentinel);
                    const float *q5 = t.q.data() + (L - 5) * s.q_row();
                    REQUIRE(cached(r2, c, {1}, {0, 5}, s.H, false, q5, nc.data()) == MHA_OK);
                    same_rows(nc.data(), dense(r1, s, 5, L, false, q5, t.k.data(), t.v.data()).data(), 5, row,
                              "cached non-causal vs mha_attention non-causal");
                }
                // Chunks 1, 7, 64, 100, rest on 2 threads, each call beside a neighbour's decode step.
                const auto chunks_a = chunks_of(L, {1, 7, 64, 100});
                const int64_t nb0 = 10, nbL = nb0 + static_cast<int64_t>(chunks_a.size());
                const SeqData nb(s, nbL, 1010);
                const auto Fnb = dense(r1, s, nbL, nbL, true, nb.q.data(), nb.k.data(), nb.v.data());
                append(r1, c, s, 3, nb, 0, nb0);
                int64_t pos = 0, npos = nb0, bad = 0;
                for (int64_t n : chunks_a) {
                    append(r2, c, s, 2, t, pos, n);
                    append(r2, c, s, 3, nb, npos, 1);
                    std::vector<float> q(nb.q.begin() + npos * s.q_row(), nb.q.begin() + (npos + 1) * s.q_row());
                    q.insert(q.end(), t.q.begin() + pos * s.q_row(), t.q.begin() + (pos + n) * s.q_row());
                    std::vector<float> out(sz((n + 1) * row), test::kSentinel);
                    REQUIRE_MESSAGE(cached(r2, c, {3, 2}, {0, 1, 1 + n}, s.H, true, q.data(), out.data()) == MHA_OK,
                                    mha_last_error());
                    bad += !same_rows(out.data() + row, F.data() + pos * row, n, row, "chunk beside a neighbour", pos);
                    bad += !same_rows(out.data(), Fnb.data() + npos * row, 1, row, "the neighbour's decode step", npos);
                    pos += n;
                    ++npos;
                }
                CHECK(bad == 0);
                // Other chunk sizes, alone, on 1 thread.
                pos = 0;
                for (int64_t n : chunks_of(L, {100, 64, 7, 1, 1, 33})) {
                    append(r1, c, s, 4, t, pos, n);
                    std::vector<float> out(sz(n * row), test::kSentinel);
                    REQUIRE(cached(r1, c, {4}, {0, n}, s.H, true, t.q.data() + pos * s.q_row(), out.data()) == MHA_OK);
                    bad += !same_rows(out.data(), F.data() + pos * row, n, row, "chunk alone", pos);
                    pos += n;
                }
                CHECK(bad == 0);
                // Decode every token, one per call, alternating 1 and 2 threads.
                for (int64_t i = 0; i < L && bad < 3; ++i) {
                    mha_runtime *rt = i % 2 ? static_cast<mha_runtime *>(r2) : static_cast<mha_runtime *>(r1);
                    append(rt, c, s, 5, t, i, 1);
                    std::vector<float> out(sz(row), test::kSentinel);
                    REQUIRE(cached(rt, c, {5}, {0, 1}, s.H, true, t.q.data() + i * s.q_row(), out.data()) == MHA_OK);
                    bad += !same_rows(out.data(), F.data() + i * row, 1, row, "decode step", i);
                }
                CHECK(bad == 0);
                CHECK(c.seq_len(5) == L);
            }
        }
}

TEST_CASE("in place (out == q) through varlen and the cache (f32 and int8): the bits of a separate out; refused where Dv != Dqk") {
    const Shape s{8, 2, 32, 32};
    const int64_t row = s.o_row();
    for (const Setup &su : cache_setups())
        for (int threads : {1, 2}) {
            CAPTURE(su.name);
            CAPTURE(threads);
            Rt rt(threads, su);
            // Varlen: a long sequence (several key tiles and chunks), a few rows over many keys (the
            // direct path), one with queries and no keys, and a short one.
            {
                const SeqData a(s, 300, 1101), b(s, 3, 300, 1102), e(s, 4, 0, 1103), f(s, 37, 1104);
                Ragged rg(s);
                for (const SeqData *d : {&a, &b, &e, &f}) rg.add(*d);
                std::vector<float> want(sz(rg.total_q() * row), test::kSentinel);
                rg.run(rt, true, want.data());
                Ragged in_place = rg;
                in_place.run(rt, true, in_place.q.data());
                CHECK(test::same_bits(in_place.q, want));
            }
            // The cache: a prefill chunk beside another sequence's decode step, f32 and int8.
            for (mha_dtype dtype : {MHA_F32, MHA_I8}) {
                CAPTURE(static_cast<int>(dtype));
                const int64_t bt = block_tokens_for(rt, s);
                Cache c(rt, s, capacity(bt, {300, 60}), 0, dtype);
                const SeqData t(s, 300, 1110), nb(s, 60, 1111);
                append(rt, c, s, 1, t, 0, 300);
                append(rt, c, s, 2, nb, 0, 60);
                std::vector<float> q(nb.q.end() - s.q_row(), nb.q.end());  // the neighbour's last token, then 200 of t's
                q.insert(q.end(), t.q.end() - 200 * s.q_row(), t.q.end());
                std::vector<float> want(sz(201 * row), test::kSentinel);
                REQUIRE_MESSAGE(cached(rt, c, {2, 1}, {0, 1, 201}, s.H, true, q.data(), want.data()) == MHA_OK, mha_last_error());
                REQUIRE_MESSAGE(cached(rt, c, {2, 1}, {0, 1, 201}, s.H, true, q.data(), q.data()) == MHA_OK, mha_last_error());
                CHECK(test::same_bits(q, want));
            }
        }
    // Dv != Dqk: a head's output would cover another head's query; refused, nothing written.
    Rt rt(1, best_default());
    const Shape w{2, 1, 8, 4};
    const SeqData d(w, 5, 1120);
    Ragged rg(w);
    rg.add(d);
    const mha_varlen_params p = rg.params(false);
    std::vector<float> x = rg.q;
    CHECK(mha_attention_varlen(rt, &p, x.data(), rg.k.data(), rg.v.data(), x.data()) == MHA_INVALID_ARGUMENT);
    CHECK(std::string(mha_last_error()).find("in-place attention (out == q) needs value_dim == head_dim") != std::string::npos);
    CHECK(test::same_bits(x, rg.q));
    Cache c(rt, w, capacity(block_tokens_for(rt, w), {5}));
    append(rt, c, w, 1, d, 0, 5);
    CHECK(cached(rt, c, {1}, {0, 5}, w.H, true, x.data(), x.data()) == MHA_INVALID_ARGUMENT);
    CHECK(std::string(mha_last_error()).find("in-place attention (out == q) needs value_dim == head_dim") != std::string::npos);
    CHECK(test::same_bits(x, rg.q));
}

TEST_CASE("variant: window, softcap, ALiBi, sinks through varlen and the cache (prefill, chunks, decode) = mha_attention") {
    const Shape s{8, 2, 32, 32};
    const int64_t L = 300, row = s.o_row();
    std::vector<float> slopes, sinks;
    for (int64_t h = 0; h < s.H; ++h) {
        slopes.push_back(std::exp2(-8.0f * static_cast<float>(h + 1) / static_cast<float>(s.H)));
        sinks.push_back(0.3f * static_cast<float>(h) - 1.0f);
    }
    const struct {
        const char *what;
        mha_attention_variant v;
    } variants[] = {{"window 40", {40, 0.0f, nullptr, nullptr}},
                    {"window 100, softcap, ALiBi, sinks", {100, 0.7f, slopes.data(), sinks.data()}},
                    {"softcap, ALiBi, sinks, no window", {0, 0.7f, slopes.data(), sinks.data()}}};
    for (Isa isa : supported_isas())
        for (const Setup &su : {default_setup(isa), tiles_setup(isa, 5, 64, 128)})
            for (const auto &var : variants) {
                CAPTURE(su.name);
                CAPTURE(var.what);
                const VariantScope scope(var.v);
                Rt r1(1, su), r2(2, su);
                const SeqData t(s, L, 2000);
                const auto F = dense(r1, s, L, L, true, t.q.data(), t.k.data(), t.v.data());
                close_to(F.data(), reference(s, L, L, true, t.q.data(), t.k.data(), t.v.data()), "causal vs reference");
                same_rows(dense(r2, s, L, L, true, t.q.data(), t.k.data(), t.v.data()).data(), F.data(), L, row, "2 threads");
                // Varlen beside others, one with Lq < Lk (its queries at the last positions).
                const SeqData a(s, 37, 2001), b(s, 3, 250, 2002);
                {
                    Ragged rg(s);
                    for (const SeqData *d : {&a, &t, &b}) rg.add(*d);
                    std::vector<float> out(sz(rg.total_q() * row), test::kSentinel);
                    rg.run(r2, true, out.data());
                    same_rows(out.data() + rg.qo[1] * row, F.data(), L, row, "varlen, second of three");
                    const auto Fb = dense(r1, s, 3, 250, true, b.q.data(), b.k.data(), b.v.data());
                    same_rows(out.data() + rg.qo[2] * row, Fb.data(), 3, row, "varlen, Lq < Lk vs alone");
                    close_to(Fb.data(), reference(s, 3, 250, true, b.q.data(), b.k.data(), b.v.data()), "Lq < Lk vs reference");
                    rg.run(r1, false, out.data());
                    close_to(out.data() + rg.qo[2] * row, reference(s, 3, 250, false, b.q.data(), b.k.data(), b.v.data()),
                             "varlen not causal vs reference");
                }
                // The cache: prefill in one call, chunks beside nothing, decode token by token.
                const int64_t bt = block_tokens_for(r1, s);
                Cache c(r1, s, capacity(bt, {L, L, L}));
                append(r1, c, s, 1, t, 0, L);
                {
                    std::vector<float> out(sz(L * row), test::kSentinel);
                    REQUIRE_MESSAGE(cached(r2, c, {1}, {0, L}, s.H, true, t.q.data(), out.data()) == MHA_OK, mha_last_error());
                    same_rows(out.data(), F.data(), L, row, "cached prefill");
                    std::vector<float> nc(sz(5 * row), test::kSentinel);
                    const float *q5 = t.q.data() + (L - 5) * s.q_row();
                    REQUIRE(cached(r1, c, {1}, {0, 5}, s.H, false, q5, nc.data()) == MHA_OK);
                    same_rows(nc.data(), dense(r2, s, 5, L, false, q5, t.k.data(), t.v.data()).data(), 5, row,
                              "cached not causal vs mha_attention");
                    close_to(nc.data(), reference(s, 5, L, false, q5, t.k.data(), t.v.data()), "cached not causal vs reference");
                }
                CHECK(chunks_then_steps(r1, r2, c, s, t, F, L, {1, 7, 64, 100}, "") == 0);
            }
}

TEST_CASE("bit-identity with tiles 5/7/14: a cache with blocks of attn_block_k tokens, chunks and decode = mha_attention") {
    // block_tokens 0 must resolve to something legal: with attn_block_k = 7 only 7 itself.
    for (Isa isa : supported_isas()) {
        const Setup su = tiles_setup(isa, 5, 7, 14);
        CAPTURE(su.name);
        Rt r1(1, su), r2(2, su);
        const Shape s{4, 2, 16, 8};
        const int64_t L = 40, row = s.o_row();
        const int64_t bt = block_tokens_for(r1, s);
        CHECK(bt == 7);
        const SeqData t(s, L, 55);
        const auto F = dense(r1, s, L, L, true, t.q.data(), t.k.data(), t.v.data());
        close_to(F.data(), reference(s, L, L, true, t.q.data(), t.k.data(), t.v.data()), "mha_attention vs reference");
        Cache c(r1, s, 3 * L);
        int64_t pos = 0, bad = 0;
        for (int64_t n : chunks_of(L, {1, 7, 5, 13})) {
            append(r1, c, s, 1, t, pos, n);
            std::vector<float> out(sz(n * row), test::kSentinel);
            REQUIRE_MESSAGE(cached(r2, c, {1}, {0, n}, s.H, true, t.q.data() + pos * s.q_row(), out.data()) == MHA_OK,
                            mha_last_error());
            bad += !same_rows(out.data(), F.data() + pos * row, n, row, "chunk", pos);
            pos += n;
        }
        for (int64_t i = 0; i < L; ++i) {
            append(r1, c, s, 2, t, i, 1);
            std::vector<float> out(sz(row), test::kSentinel);
            REQUIRE(cached(i % 2 ? static_cast<mha_runtime *>(r2) : static_cast<mha_runtime *>(r1), c, {2}, {0, 1}, s.H, true,
                           t.q.data() + i * s.q_row(), out.data()) == MHA_OK);
            bad += !same_rows(out.data(), F.data() + i * row, 1, row, "decode", i);
        }
        CHECK(bad == 0);
    }
}

TEST_CASE("bit-identity, layer: mha_layer_forward causal = forward_cached prefill + decode, and chunked, 1 and 2 threads") {
    for (Isa isa : supported_isas())
        for (bool small : {false, true}) {
            const Setup su = small ? tiles_setup(isa, 5, 64, 128) : default_setup(isa);
            CAPTURE(su.name);
            Rt r1(1, su), r2(2, su);
            const int64_t E = 32, L = small ? 200 : 1100, P = small ? 100 : 1000;  // decode crosses a chunk
            LayerBox lb(r1, layer_cfg(E, 4, 2, 12, 10), 21);
            const Shape cs = lb.cache_shape();
            const auto x = random_floats(sz(L * E), 22);
            const auto F = lb.full(r1, L, x.data());
            same_rows(lb.full(r2, L, x.data()).data(), F.data(), L, E, "mha_layer_forward on 2 threads");
            Cache c(r1, cs, capacity(block_tokens_for(r1, cs), {L, L}));
            int64_t bad = 0;
            // Prefill P in one call, then decode one token per call, alternating the runtimes.
            {
                std::vector<float> out(sz(P * E), test::kSentinel);
                REQUIRE_MESSAGE(lb.step(r1, c, {5}, {0, P}, true, x.data(), out.data()) == MHA_OK, mha_last_error());
                bad += !same_rows(out.data(), F.data(), P, E, "layer prefill");
                for (int64_t i = P; i < L && bad < 3; ++i) {
                    std::vector<float> o(sz(E), test::kSentinel);
                    REQUIRE(lb.step(i % 2 ? static_cast<mha_runtime *>(r2) : static_cast<mha_runtime *>(r1), c, {5}, {0, 1}, true,
                                    x.data() + i * E, o.data()) == MHA_OK);
                    bad += !same_rows(o.data(), F.data() + i * E, 1, E, "layer decode step", i);
                }
                CHECK(c.seq_len(5) == L);
            }
            // Chunks 1, 7, 64, 100, rest on 2 threads.
            int64_t pos = 0;
            for (int64_t n : chunks_of(L, {1, 7, 64, 100})) {
                std::vector<float> o(sz(n * E), test::kSentinel);
                REQUIRE(lb.step(r2, c, {6}, {0, n}, true, x.data() + pos * E, o.data()) == MHA_OK);
                bad += !same_rows(o.data(), F.data() + pos * E, n, E, "layer chunk", pos);
                pos += n;
            }
            CHECK(bad == 0);
            // Both ways projected the same K and V.
            std::vector<float> k5, v5, k6, v6;
            c.read(5, 0, L, cs, k5, v5);
            c.read(6, 0, L, cs, k6, v6);
            CHECK(test::same_bits(k5, k6));
            CHECK(test::same_bits(v5, v6));
        }
}

TEST_CASE("bit-identity, layer: sequences batched in one forward_cached call = each alone = the full forward") {
    for (const Setup &su : cache_setups()) {
        CAPTURE(su.name);
        Rt r1(1, su), r2(2, su);
        const int64_t E = 24, steps = 6;
        LayerBox lb(r1, layer_cfg(E, 4, 1, 8, 6), 31);  // MQA
        const Shape cs = lb.cache_shape();
        const int64_t LA = 40, LB = 70, LC = 30;
        const auto xa = random_floats(sz((LA + steps) * E), 32), xb = random_floats(sz((LB + steps) * E), 33),
                   xc = random_floats(sz((LC + steps) * E), 34);
        const auto FA = lb.full(r1, LA + steps, xa.data()), FB = lb.full(r1, LB + steps, xb.data()),
                   FC = lb.full(r1, LC + steps, xc.data());
        const int64_t cap = capacity(block_tokens_for(r1, cs), {LA + steps, LB + steps, LC + steps});
        Cache batched(r1, cs, cap), alone(r1, cs, cap);
        int64_t bad = 0;
        struct Part {
            const std::vector<float> *x;
            int64_t from, to;
        };
        auto cat = [&](std::initializer_list<Part> parts) {
            std::vector<float> x;
            for (const Part &p : parts) x.insert(x.end(), p.x->begin() + p.from * E, p.x->begin() + p.to * E);
            return x;
        };
        // Prefill A and B together (B first), and each alone.
        {
            const auto x = cat({{&xb, 0, LB}, {&xa, 0, LA}});
            std::vector<float> out(sz((LA + LB) * E), test::kSentinel);
            REQUIRE_MESSAGE(lb.step(r2, batched, {2, 1}, {0, LB, LB + LA}, true, x.data(), out.data()) == MHA_OK, mha_last_error());
            bad += !same_rows(out.data(), FB.data(), LB, E, "batched prefill, B");
            bad += !same_rows(out.data() + LB * E, FA.data(), LA, E, "batched prefill, A");
            std::vector<float> oa(sz(LA * E)), ob(sz(LB * E));
            REQUIRE(lb.step(r1, alone, {1}, {0, LA}, true, xa.data(), oa.data()) == MHA_OK);
            REQUIRE(lb.step(r1, alone, {2}, {0, LB}, true, xb.data(), ob.data()) == MHA_OK);
            bad += !same_rows(oa.data(), FA.data(), LA, E, "prefill alone, A");
            bad += !same_rows(ob.data(), FB.data(), LB, E, "prefill alone, B");
        }
        // Decode steps of A and B in one call; at step 2, C joins with a prefill chunk of LC.
        int64_t c_len = 0;
        for (int64_t st = 0; st < steps; ++st) {
            CAPTURE(st);
            std::vector<int64_t> ids = {2, 1}, qo = {0, 1, 2};
            auto x = cat({{&xb, LB + st, LB + st + 1}, {&xa, LA + st, LA + st + 1}});
            int64_t c_n = 0;
            if (st >= 2) {
                c_n = st == 2 ? LC : 1;
                ids.insert(ids.begin() + 1, 3);
                qo = {0, 1, 1 + c_n, 2 + c_n};
                const auto xcn = cat({{&xc, c_len, c_len + c_n}});
                x.insert(x.begin() + E, xcn.begin(), xcn.end());
            }
            std::vector<float> out(sz(qo.back() * E), test::kSentinel);
            REQUIRE_MESSAGE(lb.step(st % 2 ? static_cast<mha_runtime *>(r2) : static_cast<mha_runtime *>(r1), batched, ids, qo, true,
                                    x.data(), out.data()) == MHA_OK,
                            mha_last_error());
            bad += !same_rows(out.data(), FB.data() + (LB + st) * E, 1, E, "batched decode, B", LB + st);
            bad += !same_rows(out.data() + (qo.back() - 1) * E, FA.data() + (LA + st) * E, 1, E, "batched decode, A", LA + st);
            if (c_n) bad += !same_rows(out.data() + E, FC.data() + c_len * E, c_n, E, "C beside the decodes", c_len);
            c_len += c_n;
            std::vector<float> oa(sz(E)), ob(sz(E));
            REQUIRE(lb.step(r2, alone, {1}, {0, 1}, true, xa.data() + (LA + st) * E, oa.data()) == MHA_OK);
            REQUIRE(lb.step(r1, alone, {2}, {0, 1}, true, xb.data() + (LB + st) * E, ob.data()) == MHA_OK);
            bad += !same_rows(oa.data(), out.data() + (qo.back() - 1) * E, 1, E, "decode alone = batched, A", LA + st);
            bad += !same_rows(ob.data(), out.data(), 1, E, "decode alone = batched, B", LB + st);
        }
        CHECK(bad == 0);
        CHECK(batched.seq_len(1) == LA + steps);
        CHECK(batched.seq_len(2) == LB + steps);
        CHECK(batched.seq_len(3) == c_len);
    }
}
