// Host threads sharing one cache (see serving_util.hpp).
#include <doctest/doctest.h>

#include "serving_util.hpp"

using namespace mha;
using namespace serving_test;

// ================================================================================================
// Host threads sharing one cache
// ================================================================================================

TEST_CASE("8 host threads append to and attend over their own sequences of one cache, on one 2-thread runtime") {
    Rt rt(2, best_default());
    const Shape s{4, 2, 16, 16};
    const std::vector<int64_t> steps = {7, 1, 1, 13, 1, 1, 30, 1, 2, 1};
    int64_t total = 0;
    for (int64_t n : steps) total += n;
    constexpr int T = 8;
    const int64_t bt = block_tokens_for(rt, s);
    Cache c(rt, s, 2 * T * (total + bt));
    const int64_t all_free = c.free_tokens();
    std::vector<SeqData> data;
    for (int t = 0; t < T; ++t) data.emplace_back(s, total, 500 + 3 * static_cast<uint32_t>(t));

    // Appends and attends step by step; returns "" or what failed.
    auto run = [&](int64_t id, const SeqData &d, std::vector<float> &out) -> std::string {
        out.assign(sz(total * s.o_row()), test::kSentinel);
        int64_t pos = 0;
        for (int64_t n : steps) {
            if (mha_kv_cache_append(rt, c, id, n, d.k.data() + pos * s.k_row(), d.v.data() + pos * s.v_row()) != MHA_OK)
                return std::string("append: ") + mha_last_error();
            if (cached(rt, c, {id}, {0, n}, s.H, true, d.q.data() + pos * s.q_row(), out.data() + pos * s.o_row()) != MHA_OK)
                return std::string("attention: ") + mha_last_error();
            pos += n;
        }
        std::vector<float> k(sz(total * s.k_row())), v(sz(total * s.v_row()));
        if (mha_kv_cache_read(c, id, 0, total, k.data(), v.data()) != MHA_OK) return std::string("read: ") + mha_last_error();
        if (k != d.k || v != d.v) return "read back differs";
        return "";
    };
    std::vector<std::vector<float>> want(T);
    for (int t = 0; t < T; ++t) {
        REQUIRE(run(1000 + t, data[sz(t)], want[sz(t)]) == "");
        close_to(want[sz(t)].data(), reference(s, total, total, true, data[sz(t)].q.data(), data[sz(t)].k.data(), data[sz(t)].v.data()),
                 "sequential run vs reference");
        REQUIRE(mha_kv_cache_release(c, 1000 + t) == MHA_OK);
    }
    for (int round = 0; round < 3; ++round) {
        CAPTURE(round);
        std::vector<std::vector<float>> got(T);
        std::vector<std::string> err(T);
        std::vector<std::thread> threads;
        for (int t = 0; t < T; ++t)
            threads.emplace_back([&, t] {
                err[sz(t)] = run(100 + t, data[sz(t)], got[sz(t)]);
                if (err[sz(t)].empty() && mha_kv_cache_release(c, 100 + t) != MHA_OK) err[sz(t)] = "release failed";
            });
        for (auto &th : threads) th.join();
        for (int t = 0; t < T; ++t) {
            CAPTURE(t);
            CHECK(err[sz(t)] == "");
            CHECK(test::same_bits(got[sz(t)], want[sz(t)]));
        }
        CHECK(c.free_tokens() == all_free);
    }
}

TEST_CASE("8 host threads fork one shared prefix (mid-block) at once, diverge and attend, while the prefix is attended") {
    // Every fork shares the prefix's partial last block, so the first appends copy it on write
    // from 8 threads at once; the prefix itself is attended by every thread meanwhile.
    Rt rt(2, best_default());
    const Shape s{4, 2, 16, 16};
    constexpr int T = 8;
    const int64_t bt = block_tokens_for(rt, s), P = bt + bt / 2 + 3;  // mid-block
    const std::vector<int64_t> steps = {1, 5, 1, 1, 20, 1};
    int64_t own = 0;
    for (int64_t n : steps) own += n;
    const int64_t L = P + own;
    Cache c(rt, s, capacity(bt, {P}) + 2 * T * capacity(bt, {L}));
    const SeqData pre(s, P, 900);
    append(rt, c, s, 7, pre, 0, P);
    const auto q_pre = random_floats(sz(4 * s.q_row()), 901);
    // Sequence t: the prefix, then its own tokens; its data as one dense sequence.
    std::vector<SeqData> data;
    for (int t = 0; t < T; ++t) {
        data.emplace_back(s, L, 910 + 3 * static_cast<uint32_t>(t));
        std::copy(pre.k.begin(), pre.k.end(), data.back().k.begin());
        std::copy(pre.v.begin(), pre.v.end(), data.back().v.begin());
    }
    // The prefix's last 4 queries, non-causal, as every thread attends it.
    std::vector<float> want_pre(sz(4 * s.o_row()));
    REQUIRE(cached(rt, c, {7}, {0, 4}, s.H, false, q_pre.data(), want_pre.data()) == MHA_OK);

    auto run = [&](int64_t id, const SeqData &d, std::vector<float> &out, std::vector<float> &pre_out) -> std::string {
        out.assign(sz(own * s.o_row()), test::kSentinel);
        pre_out.assign(want_pre.size(), test::kSentinel);
        if (mha_kv_cache_fork(c, 7, id) != MHA_OK) return std::string("fork: ") + mha_last_error();
        int64_t pos = P;
        for (int64_t n : steps) {
            if (mha_kv_cache_append(rt, c, id, n, d.k.data() + pos * s.k_row(), d.v.data() + pos * s.v_row()) != MHA_OK)
                return std::string("append: ") + mha_last_error();
            if (cached(rt, c, {id}, {0, n}, s.H, true, d.q.data() + pos * s.q_row(), out.data() + (pos - P) * s.o_row()) != MHA_OK)
                return std::string("attention: ") + mha_last_error();
            if (cached(rt, c, {7}, {0, 4}, s.H, false, q_pre.data(), pre_out.data()) != MHA_OK)
                return std::string("attention over the prefix: ") + mha_last_error();
            pos += n;
        }
        std::vector<float> k(sz(L * s.k_row())), v(sz(L * s.v_row()));
        if (mha_kv_cache_read(c, id, 0, L, k.data(), v.data()) != MHA_OK) return std::string("read: ") + mha_last_error();
        if (k != d.k || v != d.v) return "read back differs";
        return "";
    };
    // Alone, one after the other; each against mha_attention on its dense K/V.
    std::vector<std::vector<float>> want(T);
    for (int t = 0; t < T; ++t) {
        std::vector<float> pre_out;
        REQUIRE(run(2000 + t, data[sz(t)], want[sz(t)], pre_out) == "");
        const SeqData &d = data[sz(t)];
        same_rows(want[sz(t)].data(), dense(rt, s, L, L, true, d.q.data(), d.k.data(), d.v.data()).data() + P * s.o_row(), own,
                  s.o_row(), "forked sequence vs mha_attention", P);
        REQUIRE(mha_kv_cache_release(c, 2000 + t) == MHA_OK);
    }
    const int64_t free_before = c.free_tokens();
    for (int round = 0; round < 3; ++round) {
        CAPTURE(round);
        std::vector<std::vector<float>> got(T), got_pre(T);
        std::vector<std::string> err(T);
        std::vector<std::thread> threads;
        for (int t = 0; t < T; ++t)
            threads.emplace_back([&, t] {
                err[sz(t)] = run(100 + t, data[sz(t)], got[sz(t)], got_pre[sz(t)]);
                if (err[sz(t)].empty() && mha_kv_cache_release(c, 100 + t) != MHA_OK) err[sz(t)] = "release failed";
            });
        for (auto &th : threads) th.join();
        for (int t = 0; t < T; ++t) {
            CAPTURE(t);
            CHECK(err[sz(t)] == "");
            CHECK(test::same_bits(got[sz(t)], want[sz(t)]));
            CHECK(test::same_bits(got_pre[sz(t)], want_pre));
        }
        CHECK(c.seq_len(7) == P);
        CHECK(c.free_tokens() == free_before);
        std::vector<float> k, v;
        c.read(7, 0, P, s, k, v);
        CHECK(test::same_bits(k, pre.k));
        CHECK(test::same_bits(v, pre.v));
    }
}
