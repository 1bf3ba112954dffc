// The paged KV cache (mha_kv_cache_*), and attention over it (mha_attention_cached) against the
// dense reference (see serving_util.hpp).
#include <doctest/doctest.h>

#include "serving_util.hpp"

using namespace mha;
using namespace serving_test;

// ================================================================================================
// The paged cache
// ================================================================================================

TEST_CASE("kv cache: append in pieces, read back bitwise, seq_len, free_tokens by whole blocks, release and reuse") {
    for (const Setup &su : cache_setups())
        for (const Shape s : {Shape{4, 2, 13, 7}, Shape{4, 2, 32, 16}}) {
            CAPTURE(su.name);
            CAPTURE(s.D);
            Rt rt(1, su);
            const TileConfig t = tiles_of(su);
            const int64_t nr = nr_of(t);
            std::vector<int64_t> block_choices = {0};
            if (t.attn_block_k % nr == 0 && nr != t.attn_block_k) block_choices.push_back(nr);
            for (int64_t want_bt : block_choices) {
                CAPTURE(want_bt);
                const int64_t bt = block_tokens_for(rt, s, want_bt);
                REQUIRE(bt > 0);
                if (want_bt) CHECK(bt == want_bt);
                CHECK(t.attn_block_k % bt == 0);
                CHECK((bt % nr == 0 || bt == t.attn_block_k));
                const int64_t nblocks = 6;
                Cache c(rt, s, nblocks * bt - 3, want_bt);  // rounded up to 6 blocks
                const mha_kv_cache_config cfg = c.config();
                CHECK(cfg.num_kv_heads == s.Hkv);
                CHECK(cfg.head_dim == s.D);
                CHECK(cfg.value_dim == s.Dv);
                CHECK(cfg.block_tokens == bt);
                CHECK(cfg.dtype == MHA_F32);
                CHECK(c.free_tokens() == nblocks * bt);
                uint64_t bytes = 0;
                REQUIRE(mha_kv_cache_bytes(c, &bytes) == MHA_OK);
                CHECK(bytes >= static_cast<uint64_t>(nblocks * bt * (s.k_row() + s.v_row())) * 4);
                CHECK(c.seq_len(42) == -1);

                auto blocks = [&](int64_t len) { return (len + bt - 1) / bt; };
                const SeqData a(s, 4 * bt, 7), b(s, 2 * bt, 8);
                std::vector<float> k, v;
                int64_t len_a = 0, len_b = 0;
                auto check_a = [&](const char *when) {
                    CAPTURE(when);
                    CHECK(c.seq_len(42) == len_a);
                    c.read(42, 0, len_a, s, k, v);
                    CHECK(std::memcmp(k.data(), a.k.data(), sz(len_a * s.k_row()) * 4) == 0);
                    CHECK(std::memcmp(v.data(), a.v.data(), sz(len_a * s.v_row()) * 4) == 0);
                };
                // Pieces that end mid-block, on a block edge, and cross one; an empty one.
                for (int64_t n : {int64_t{1}, bt - 1, bt + 3, int64_t{0}, int64_t{2}, int64_t{5}}) {
                    append(rt, c, s, 42, a, len_a, n);
                    len_a += n;
                    check_a("after a piece");
                    if (len_b < bt / 2 + 1) {  // a second sequence growing beside it
                        append(rt, c, s, 7, b, len_b, bt / 2 + 1);
                        len_b += bt / 2 + 1;
                    }
                    CHECK(c.free_tokens() == (nblocks - blocks(len_a) - blocks(len_b)) * bt);
                }
                // A window, and k or v alone.
                const int64_t st = 3, n = len_a - 5;
                c.read(42, st, n, s, k, v);
                CHECK(std::memcmp(k.data(), a.k.data() + st * s.k_row(), sz(n * s.k_row()) * 4) == 0);
                CHECK(std::memcmp(v.data(), a.v.data() + st * s.v_row(), sz(n * s.v_row()) * 4) == 0);
                std::vector<float> konly(sz(n * s.k_row()), test::kSentinel), vonly(sz(n * s.v_row()), test::kSentinel);
                REQUIRE(mha_kv_cache_read(c, 42, st, n, konly.data(), nullptr) == MHA_OK);
                REQUIRE(mha_kv_cache_read(c, 42, st, n, nullptr, vonly.data()) == MHA_OK);
                CHECK(test::same_bits(konly, k));
                CHECK(test::same_bits(vonly, v));
                c.read(7, 0, len_b, s, k, v);
                CHECK(std::memcmp(k.data(), b.k.data(), sz(len_b * s.k_row()) * 4) == 0);
                CHECK(std::memcmp(v.data(), b.v.data(), sz(len_b * s.v_row()) * 4) == 0);

                // Release gives the blocks back; the id is gone.
                REQUIRE(mha_kv_cache_release(c, 42) == MHA_OK);
                CHECK(c.seq_len(42) == -1);
                CHECK(c.free_tokens() == (nblocks - blocks(len_b)) * bt);
                // A new sequence takes every free block (its data must not leak the old blocks'),
                // then the cache is full.
                const int64_t room = c.free_tokens();
                const SeqData r(s, room + bt, 9);
                append(rt, c, s, 1000, r, 0, room / 2 + 1);
                append(rt, c, s, 1000, r, room / 2 + 1, room - (room / 2 + 1));
                CHECK(c.free_tokens() == 0);
                c.read(1000, 0, room, s, k, v);
                CHECK(std::memcmp(k.data(), r.k.data(), sz(room * s.k_row()) * 4) == 0);
                CHECK(std::memcmp(v.data(), r.v.data(), sz(room * s.v_row()) * 4) == 0);
                CHECK(mha_kv_cache_append(rt, c, 1000, 1, r.k.data(), r.v.data()) == MHA_OUT_OF_MEMORY);
                CHECK(c.seq_len(1000) == room);
                // Attention over the reused blocks: the last 3 queries against the reference.
                const int64_t H = s.H;
                std::vector<float> out(sz(3 * s.o_row()), test::kSentinel);
                REQUIRE(cached(rt, c, {1000}, {0, 3}, H, true, r.q.data() + (room - 3) * s.q_row(), out.data()) == MHA_OK);
                close_to(out.data(), reference(s, 3, room, true, r.q.data() + (room - 3) * s.q_row(), r.k.data(), r.v.data()),
                         "attention over reused blocks");
                // Release the other: its block serves the full sequence's next append.
                REQUIRE(mha_kv_cache_release(c, 7) == MHA_OK);
                CHECK(c.free_tokens() == blocks(len_b) * bt);
                append(rt, c, s, 1000, r, room, 1);
                CHECK(c.seq_len(1000) == room + 1);
                CHECK(c.free_tokens() == (blocks(len_b) - 1) * bt);
                c.read(1000, room - 2, 3, s, k, v);
                CHECK(std::memcmp(k.data(), r.k.data() + (room - 2) * s.k_row(), sz(3 * s.k_row()) * 4) == 0);
                CHECK(std::memcmp(v.data(), r.v.data() + (room - 2) * s.v_row(), sz(3 * s.v_row()) * 4) == 0);
                REQUIRE(mha_kv_cache_release(c, 1000) == MHA_OK);
                CHECK(c.free_tokens() == nblocks * bt);
                // A released id starts over.
                append(rt, c, s, 7, a, 0, 2);
                CHECK(c.seq_len(7) == 2);
                c.read(7, 0, 2, s, k, v);
                CHECK(std::memcmp(k.data(), a.k.data(), sz(2 * s.k_row()) * 4) == 0);
                CHECK(std::memcmp(v.data(), a.v.data(), sz(2 * s.v_row()) * 4) == 0);
                // An empty append starts an empty sequence.
                REQUIRE(mha_kv_cache_append(rt, c, 5, 0, kNone, kNone) == MHA_OK);
                CHECK(c.seq_len(5) == 0);
                REQUIRE(mha_kv_cache_release(c, 7) == MHA_OK);
                REQUIRE(mha_kv_cache_release(c, 5) == MHA_OK);
                CHECK(c.free_tokens() == nblocks * bt);
            }
        }
}

TEST_CASE("kv cache: fork in the middle of a block, then diverge: copy-on-write keeps both right") {
    for (const Setup &su : cache_setups()) {
        CAPTURE(su.name);
        Rt rt(1, su);
        const Shape s{4, 2, 16, 8};
        const int64_t bt = block_tokens_for(rt, s), nblocks = 8;
        Cache c(rt, s, nblocks * bt);
        std::vector<float> k, v;
        auto expect_seq = [&](int64_t id, const std::vector<const SeqData *> &parts, const std::vector<int64_t> &lens,
                              const char *what) {
            CAPTURE(what);
            CAPTURE(id);
            int64_t len = 0;
            for (int64_t n : lens) len += n;
            REQUIRE(c.seq_len(id) == len);
            c.read(id, 0, len, s, k, v);
            int64_t pos = 0;
            for (size_t i = 0; i < parts.size(); ++i) {
                CHECK(std::memcmp(k.data() + pos * s.k_row(), parts[i]->k.data(), sz(lens[i] * s.k_row()) * 4) == 0);
                CHECK(std::memcmp(v.data() + pos * s.v_row(), parts[i]->v.data(), sz(lens[i] * s.v_row()) * 4) == 0);
                pos += lens[i];
            }
        };
        // Source: one full block and part of a second.
        const int64_t P = bt + bt / 2 + 1, nA = 3, nB = bt + 2;
        const SeqData pre(s, P, 1), da(s, nA, 2), db(s, nB, 3);
        append(rt, c, s, 1, pre, 0, P);
        CHECK(c.free_tokens() == (nblocks - 2) * bt);
        REQUIRE(mha_kv_cache_fork(c, 1, 2) == MHA_OK);
        CHECK(c.free_tokens() == (nblocks - 2) * bt);  // shared, nothing copied
        expect_seq(2, {&pre}, {P}, "the fork reads as its source");
        // Diverge: 1's append lands in the shared partial block (a copy), 2's then owns the
        // original alone (no copy) and crosses into a new block.
        append(rt, c, s, 1, da, 0, nA);
        append(rt, c, s, 2, db, 0, nB);
        expect_seq(1, {&pre, &da}, {P, nA}, "source after diverging");
        expect_seq(2, {&pre, &db}, {P, nB}, "fork after diverging");
        CHECK(c.free_tokens() == (nblocks - 4) * bt);
        // Attention over each matches the reference and mha_attention on its dense K/V, bit for bit.
        for (int which = 0; which < 2; ++which) {
            const int64_t id = which == 0 ? 1 : 2, L = which == 0 ? P + nA : P + nB;
            CAPTURE(id);
            c.read(id, 0, L, s, k, v);
            const auto q = random_floats(sz(L * s.q_row()), 40 + static_cast<uint32_t>(which));
            std::vector<float> out(sz(L * s.o_row()), test::kSentinel);
            REQUIRE(cached(rt, c, {id}, {0, L}, s.H, true, q.data(), out.data()) == MHA_OK);
            close_to(out.data(), reference(s, L, L, true, q.data(), k.data(), v.data()), "attention over a forked sequence");
            same_rows(out.data(), dense(rt, s, L, L, true, q.data(), k.data(), v.data()).data(), L, s.o_row(),
                      "forked sequence vs mha_attention");
        }
        // The source goes; the fork keeps the shared block.
        REQUIRE(mha_kv_cache_release(c, 1) == MHA_OK);
        CHECK(c.free_tokens() == (nblocks - 3) * bt);
        expect_seq(2, {&pre, &db}, {P, nB}, "fork after its source is released");
        REQUIRE(mha_kv_cache_release(c, 2) == MHA_OK);
        CHECK(c.free_tokens() == nblocks * bt);

        // Fork on a block edge: appends to either need a new block, none a copy. A fork of a
        // fork outlives both.
        const SeqData two(s, 2 * bt, 4), one(s, 1, 5), other(s, 1, 6);
        append(rt, c, s, 3, two, 0, 2 * bt);
        REQUIRE(mha_kv_cache_fork(c, 3, 4) == MHA_OK);
        append(rt, c, s, 3, one, 0, 1);
        append(rt, c, s, 4, other, 0, 1);
        CHECK(c.free_tokens() == (nblocks - 4) * bt);
        expect_seq(3, {&two, &one}, {2 * bt, 1}, "edge fork, source");
        expect_seq(4, {&two, &other}, {2 * bt, 1}, "edge fork, fork");
        REQUIRE(mha_kv_cache_fork(c, 4, 5) == MHA_OK);
        REQUIRE(mha_kv_cache_release(c, 3) == MHA_OK);
        REQUIRE(mha_kv_cache_release(c, 4) == MHA_OK);
        expect_seq(5, {&two, &other}, {2 * bt, 1}, "fork of a fork");
        CHECK(c.free_tokens() == (nblocks - 3) * bt);
        // An empty sequence forks too.
        REQUIRE(mha_kv_cache_append(rt, c, 6, 0, kNone, kNone) == MHA_OK);
        REQUIRE(mha_kv_cache_fork(c, 6, 7) == MHA_OK);
        CHECK(c.seq_len(7) == 0);
        append(rt, c, s, 7, one, 0, 1);
        CHECK(c.seq_len(6) == 0);
        CHECK(c.seq_len(7) == 1);
        for (int64_t id : {5, 6, 7}) REQUIRE(mha_kv_cache_release(c, id) == MHA_OK);
        CHECK(c.free_tokens() == nblocks * bt);
    }
}

TEST_CASE("kv cache: bytes within 2% of max_tokens x one token's K and V (H8 D128), and bf16 is unsupported") {
    Rt rt(1, best_default());
    for (const Shape s : {Shape{8, 8, 128, 128}, Shape{32, 8, 128, 128}, Shape{8, 2, 128, 64}}) {
        CAPTURE(s.Hkv);
        CAPTURE(s.Dv);
        const int64_t bt = block_tokens_for(rt, s), max_tokens = bt * std::max<int64_t>(4, 2048 / bt);
        Cache c(rt, s, max_tokens);
        uint64_t bytes = 0;
        REQUIRE(mha_kv_cache_bytes(c, &bytes) == MHA_OK);
        const double want = static_cast<double>(max_tokens) * static_cast<double>(s.Hkv * (s.D + s.Dv)) * 4.0;
        CHECK_MESSAGE(std::fabs(static_cast<double>(bytes) - want) <= 0.02 * want, bytes << " bytes, want " << want);
        CHECK(c.free_tokens() == max_tokens);
    }
    mha_kv_cache_config cfg{};
    cfg.num_kv_heads = 2;
    cfg.head_dim = 64;
    cfg.value_dim = 64;
    cfg.max_tokens = 1024;
    cfg.dtype = MHA_BF16;
    mha_kv_cache *c = nullptr;
    CHECK(mha_kv_cache_create(rt, &cfg, &c) == MHA_UNSUPPORTED);
    CHECK(c == nullptr);
    const std::string msg = mha_last_error();
    CHECK_MESSAGE(contains_any(msg, {"bf16", "BF16", "dtype"}), msg);
    mha_kv_cache_destroy(c);
    mha_kv_cache_destroy(nullptr);
}

// ================================================================================================
// Attention over the cache against the dense reference
// ================================================================================================

TEST_CASE("attention_cached: chunked prefill and decode against the dense causal reference, and non-causal") {
    for (const Setup &su : cache_setups())
        for (const Shape s : {Shape{8, 2, 32, 32}, Shape{4, 1, 16, 24}, Shape{2, 1, 13, 7}})
            for (int blocks : {0, 1, 2}) {
                if (test::reduced() && s.H != 8) continue;  // tools/tsan: the GQA shape only (1 thread)
                CAPTURE(su.name);
                CAPTURE(s.H);
                CAPTURE(s.Hkv);
                CAPTURE(s.D);
                CAPTURE(s.Dv);
                Rt rt(1, su);
                const TileConfig t = tiles_of(su);
                // block_tokens: the runtime's choice, NR (several blocks per key tile), and, if the runtime
                // takes it (mha.h says block_tokens must divide attn_block_k; the implementation also
                // accepts multiples of it), two key tiles per block.
                int64_t bt = 0;
                if (blocks == 1) {
                    bt = nr_of(t);
                    if (t.attn_block_k % bt != 0 || bt == block_tokens_for(rt, s)) continue;
                } else if (blocks == 2) {
                    mha_kv_cache_config cfg{s.Hkv, s.D, s.Dv, 2 * t.attn_block_k, 1, MHA_F32, 0};
                    mha_kv_cache *probe = nullptr;
                    const mha_status st = mha_kv_cache_create(rt, &cfg, &probe);
                    mha_kv_cache_destroy(probe);
                    if (st != MHA_OK) continue;
                    bt = 2 * t.attn_block_k;
                }
                CAPTURE(bt);
                const int64_t L = 300;  // past a default key tile, and 4 small ones (2 chunks)
                const SeqData d(s, L, 77);
                const auto want = reference(s, L, L, true, d.q.data(), d.k.data(), d.v.data());
                const auto F = dense(rt, s, L, L, true, d.q.data(), d.k.data(), d.v.data());
                Cache c(rt, s, L, bt);
                int64_t pos = 0;
                std::vector<int64_t> steps = {37, 1, 100, 2, 60};
                for (int64_t i = 200; i < L; ++i) steps.push_back(1);  // then decode one token at a time to L
                for (int64_t n : steps) {
                    CAPTURE(pos);
                    CAPTURE(n);
                    append(rt, c, s, 9, d, pos, n);
                    const float *q = d.q.data() + pos * s.q_row();
                    std::vector<float> out(sz(n * s.o_row()) + 5, test::kSentinel);
                    REQUIRE_MESSAGE(cached(rt, c, {9}, {0, n}, s.H, true, q, out.data()) == MHA_OK, mha_last_error());
                    CHECK(all_sentinel(out, sz(n * s.o_row())));
                    bool ok = close_to(out.data(), std::vector<double>(want.begin() + pos * s.o_row(), want.begin() + (pos + n) * s.o_row()),
                                       "causal chunk");
                    ok &= same_rows(out.data(), F.data() + pos * s.o_row(), n, s.o_row(), "causal chunk vs mha_attention", pos);
                    // Non-causal: each of the chunk's queries sees every cached position.
                    std::fill(out.begin(), out.end(), test::kSentinel);
                    REQUIRE(cached(rt, c, {9}, {0, n}, s.H, false, q, out.data()) == MHA_OK);
                    ok &= close_to(out.data(), reference(s, n, pos + n, false, q, d.k.data(), d.v.data()), "non-causal chunk");
                    pos += n;
                    if (!ok) break;
                }
                CHECK(pos == L);
                CHECK(c.free_tokens() == 0);
            }
}

TEST_CASE("attention_cached: one call serves prefill chunks and decode steps of different sequences (GQA)") {
    for (const Setup &su : cache_setups())
        for (const Shape s : {Shape{8, 2, 16, 16}, Shape{6, 3, 13, 7}}) {
            CAPTURE(su.name);
            CAPTURE(s.D);
            Rt rt(2, su);
            // id, cached before the step, new tokens in the step (then one more decode step each).
            struct S {
                int64_t id, before, now;
            };
            const std::vector<S> seqs = {{11, 50, 40}, {3, 59, 1}, {500, 0, 1}, {8, 28, 12}, {77, 10, 0}, {9, 0, 270}, {4, 1, 1}};
            std::vector<SeqData> data;
            const int64_t bt = block_tokens_for(rt, s);
            int64_t cap = 0;
            for (const S &x : seqs) cap += capacity(bt, {x.before + x.now + 1});
            Cache c(rt, s, cap);
            for (size_t i = 0; i < seqs.size(); ++i) {
                data.emplace_back(s, seqs[i].before + seqs[i].now + 1, 300 + 5 * static_cast<uint32_t>(i));
                if (seqs[i].before) append(rt, c, s, seqs[i].id, data[i], 0, seqs[i].before);
            }
            for (int step = 0; step < 2; ++step)
                for (bool causal : {true, false}) {
                    CAPTURE(step);
                    CAPTURE(causal);
                    std::vector<int64_t> ids, qo = {0};
                    std::vector<float> q;
                    for (size_t i = 0; i < seqs.size(); ++i) {
                        const int64_t start = step == 0 ? seqs[i].before : seqs[i].before + seqs[i].now,
                                      n = step == 0 ? seqs[i].now : 1;
                        if (causal && n)  // append once per step (before the causal run)
                            append(rt, c, s, seqs[i].id, data[i], start, n);
                        else if (causal && c.seq_len(seqs[i].id) < 0)
                            REQUIRE(mha_kv_cache_append(rt, c, seqs[i].id, 0, kNone, kNone) == MHA_OK);
                        ids.push_back(seqs[i].id);
                        qo.push_back(qo.back() + n);
                        q.insert(q.end(), data[i].q.begin() + start * s.q_row(), data[i].q.begin() + (start + n) * s.q_row());
                    }
                    std::vector<float> out(sz(qo.back() * s.o_row()) + 3, test::kSentinel);
                    REQUIRE_MESSAGE(cached(rt, c, ids, qo, s.H, causal, q.data(), out.data()) == MHA_OK, mha_last_error());
                    CHECK(all_sentinel(out, sz(qo.back() * s.o_row())));
                    for (size_t i = 0; i < seqs.size(); ++i) {
                        const int64_t n = qo[i + 1] - qo[i], len = c.seq_len(seqs[i].id);
                        CAPTURE(seqs[i].id);
                        close_to(out.data() + qo[i] * s.o_row(),
                                 reference(s, n, len, causal, q.data() + qo[i] * s.q_row(), data[i].k.data(), data[i].v.data()),
                                 "sequence in a continuous batch");
                    }
                }
        }
}
