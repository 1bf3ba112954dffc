// Bad input through the serving entry points: a status and a message, and nothing changed (see
// serving_util.hpp).
#include <doctest/doctest.h>

#include "serving_util.hpp"

using namespace mha;
using namespace serving_test;

namespace {

std::vector<std::string> null_names(const std::string &name) {
    return {name + " is NULL", name + " must not be NULL", name + " = NULL", name + " is null", name + " == NULL"};
}

// A failed call with a known message, so a stale message cannot pass for a new one.
void reset_error(mha_runtime *rt) {
    float c = 0;
    REQUIRE(mha_sgemm(rt, 'Z', 'N', 1, 1, 1, 1, &c, 1, &c, 1, 0, &c, 1) == MHA_INVALID_ARGUMENT);
}

struct Snapshot {
    int64_t free = -1;
    std::vector<int64_t> lens;
    std::vector<std::vector<float>> k, v;
    bool operator==(const Snapshot &) const = default;
};

Snapshot snapshot(const Cache &c, const Shape &s, const std::vector<int64_t> &ids) {
    Snapshot sn;
    sn.free = c.free_tokens();
    for (int64_t id : ids) {
        const int64_t len = c.seq_len(id);
        sn.lens.push_back(len);
        std::vector<float> k, v;
        if (len > 0) c.read(id, 0, len, s, k, v);
        sn.k.push_back(k);
        sn.v.push_back(v);
    }
    return sn;
}

} // namespace

TEST_CASE("bad input: a status, a message naming the field, and the cache and every output left as they were") {
    const Setup su = best_default();
    Rt rt(1, su);
    const Shape s{4, 2, 8, 4};
    const int64_t bt = block_tokens_for(rt, s), nblocks = 8;
    Cache c(rt, s, nblocks * bt);
    const SeqData d1(s, 5, 1), d2(s, bt + 1, 2);
    append(rt, c, s, 1, d1, 0, 5);
    append(rt, c, s, 2, d2, 0, bt + 1);
    const std::vector<int64_t> ids = {1, 2, 3, 9, 50};
    const Snapshot before = snapshot(c, s, ids);
    REQUIRE(before.free == (nblocks - 3) * bt);

    // Big enough for every call below (the layer's overflowing batch has about 6 blocks of rows).
    const size_t big = sz(std::max<int64_t>(4096, (8 * bt + 64) * 16));
    std::vector<float> out(big, test::kSentinel), rk(4096, test::kSentinel), rv(4096, test::kSentinel);
    const auto q = random_floats(big, 3), k = random_floats(big, 4), v = random_floats(big, 5);
    std::vector<std::function<bool()>> extra_unchanged;

    auto expect = [&](const std::string &what, const std::function<mha_status()> &call, std::initializer_list<mha_status> want,
                      const std::vector<std::string> &needles) {
        reset_error(rt);
        const std::string stale = mha_last_error();
        const mha_status got = call();
        const std::string msg = mha_last_error();
        bool status_ok = false;
        for (mha_status w : want) status_ok |= got == w;
        CHECK_MESSAGE(status_ok, what << ": status " << static_cast<int>(got) << ", message '" << msg << "'");
        CHECK_MESSAGE((!msg.empty() && msg != stale), what << ": no message of its own");
        CHECK_MESSAGE(contains_any(msg, needles), what << ": the message '" << msg << "' does not name the field");
        CHECK_MESSAGE(snapshot(c, s, ids) == before, what << ": the cache changed");
        CHECK_MESSAGE(all_sentinel(out), what << ": out was written");
        CHECK_MESSAGE((all_sentinel(rk) && all_sentinel(rv)), what << ": a read buffer was written");
        for (auto &f : extra_unchanged) CHECK_MESSAGE(f(), what << ": another cache changed");
    };
    constexpr auto INV = MHA_INVALID_ARGUMENT;
    const int64_t huge = INT64_C(1) << 62;

    SUBCASE("mha_attention_varlen") {
        const std::vector<int64_t> qo = {0, 2, 5}, ko = {0, 3, 7};
        mha_varlen_params good{};
        good.num_seqs = 2;
        good.q_offsets = qo.data();
        good.kv_offsets = ko.data();
        good.num_heads = 4;
        good.num_kv_heads = 2;
        good.head_dim = 8;
        good.value_dim = 4;
        {
            std::vector<float> o(5 * 4 * 4);
            REQUIRE_MESSAGE(mha_attention_varlen(rt, &good, q.data(), k.data(), v.data(), o.data()) == MHA_OK, mha_last_error());
        }
        auto with = [&](const std::string &what, const std::function<void(mha_varlen_params &)> &edit,
                        std::initializer_list<mha_status> want, const std::vector<std::string> &needles) {
            expect(what, [&] {
                mha_varlen_params p = good;
                edit(p);
                return mha_attention_varlen(rt, &p, q.data(), k.data(), v.data(), out.data());
            }, want, needles);
        };
        expect("rt NULL", [&] { return mha_attention_varlen(nullptr, &good, q.data(), k.data(), v.data(), out.data()); }, {INV}, null_names("rt"));
        expect("p NULL", [&] { return mha_attention_varlen(rt, nullptr, q.data(), k.data(), v.data(), out.data()); }, {INV}, null_names("p"));
        expect("q NULL", [&] { return mha_attention_varlen(rt, &good, nullptr, k.data(), v.data(), out.data()); }, {INV}, null_names("q"));
        expect("k NULL", [&] { return mha_attention_varlen(rt, &good, q.data(), nullptr, v.data(), out.data()); }, {INV}, null_names("k"));
        expect("v NULL", [&] { return mha_attention_varlen(rt, &good, q.data(), k.data(), nullptr, out.data()); }, {INV}, null_names("v"));
        expect("out NULL", [&] { return mha_attention_varlen(rt, &good, q.data(), k.data(), v.data(), nullptr); }, {INV}, null_names("out"));
        with("q_offsets NULL", [](auto &p) { p.q_offsets = nullptr; }, {INV}, {"q_offsets"});
        with("kv_offsets NULL", [](auto &p) { p.kv_offsets = nullptr; }, {INV}, {"kv_offsets"});
        with("num_seqs < 0", [](auto &p) { p.num_seqs = -1; }, {INV}, {"num_seqs"});
        static const int64_t q_first[] = {1, 2, 5}, q_down[] = {0, 3, 2}, k_first[] = {2, 3, 7}, k_down[] = {0, 4, 3},
                             q_huge[] = {0, 2, INT64_C(1) << 62}, k_huge[] = {0, 3, INT64_C(1) << 62};
        with("q_offsets[0] != 0", [](auto &p) { p.q_offsets = q_first; }, {INV}, {"q_offsets"});
        with("q_offsets decreasing", [](auto &p) { p.q_offsets = q_down; }, {INV}, {"q_offsets"});
        with("kv_offsets[0] != 0", [](auto &p) { p.kv_offsets = k_first; }, {INV}, {"kv_offsets"});
        with("kv_offsets decreasing", [](auto &p) { p.kv_offsets = k_down; }, {INV}, {"kv_offsets"});
        with("num_heads not a multiple of num_kv_heads", [](auto &p) { p.num_heads = 3; }, {INV}, {"num_heads", "num_kv_heads"});
        with("num_heads 0", [](auto &p) { p.num_heads = 0; }, {INV}, {"num_heads"});
        with("num_kv_heads 0", [](auto &p) { p.num_kv_heads = 0; }, {INV}, {"num_kv_heads"});
        with("head_dim 0", [](auto &p) { p.head_dim = 0; }, {INV}, {"head_dim"});
        with("value_dim < 0", [](auto &p) { p.value_dim = -4; }, {INV}, {"value_dim"});
        with("scale NaN", [](auto &p) { p.scale = NAN; }, {INV}, {"scale"});
        with("window < 0", [](auto &p) { p.variant.window = -3; }, {INV}, {"variant.window"});
        with("softcap NaN", [](auto &p) { p.variant.softcap = NAN; }, {INV}, {"variant.softcap"});
        with("softcap < 0", [](auto &p) { p.variant.softcap = -2.0f; }, {INV}, {"variant.softcap"});
        with("q rows overflow", [](auto &p) { p.q_offsets = q_huge; }, {INV}, {"overflow", "q_offsets"});
        with("kv rows overflow", [](auto &p) { p.kv_offsets = k_huge; }, {INV}, {"overflow", "kv_offsets"});
        with("head sizes overflow", [](auto &p) { p.num_heads = INT64_C(1) << 31; p.head_dim = INT64_C(1) << 40; }, {INV},
             {"overflow", "head_dim", "num_heads"});
    }

    SUBCASE("mha_kv_cache_create") {
        mha_kv_cache_config good{};
        good.num_kv_heads = 2;
        good.head_dim = 8;
        good.value_dim = 4;
        good.max_tokens = 100;
        mha_kv_cache *made = nullptr;
        auto with = [&](const std::string &what, const std::function<void(mha_kv_cache_config &)> &edit,
                        std::initializer_list<mha_status> want, const std::vector<std::string> &needles) {
            expect(what, [&] {
                mha_kv_cache_config cfg = good;
                edit(cfg);
                return mha_kv_cache_create(rt, &cfg, &made);
            }, want, needles);
            CHECK_MESSAGE(made == nullptr, what << ": a cache was made");
            mha_kv_cache_destroy(made);
            made = nullptr;
        };
        expect("rt NULL", [&] { return mha_kv_cache_create(nullptr, &good, &made); }, {INV}, null_names("rt"));
        expect("config NULL", [&] { return mha_kv_cache_create(rt, nullptr, &made); }, {INV}, null_names("config"));
        expect("out NULL", [&] { return mha_kv_cache_create(rt, &good, nullptr); }, {INV}, null_names("out"));
        CHECK(made == nullptr);
        const TileConfig t = tiles_of(su);
        const int64_t nr = nr_of(t);
        with("num_kv_heads 0", [](auto &x) { x.num_kv_heads = 0; }, {INV}, {"num_kv_heads"});
        with("head_dim 0", [](auto &x) { x.head_dim = 0; }, {INV}, {"head_dim"});
        with("value_dim < 0", [](auto &x) { x.value_dim = -1; }, {INV}, {"value_dim"});
        with("max_tokens < 0", [](auto &x) { x.max_tokens = -5; }, {INV}, {"max_tokens"});
        with("block_tokens < 0", [](auto &x) { x.block_tokens = -16; }, {INV}, {"block_tokens"});
        with("block_tokens 3 (divides nothing)", [](auto &x) { x.block_tokens = 3; }, {INV}, {"block_tokens"});
        // Neither divides attn_block_k nor is a multiple of it (mha.h allows only divisors; the
        // implementation also takes multiples of attn_block_k, see the attention_cached test).
        with("block_tokens = attn_block_k + NR", [&](auto &x) { x.block_tokens = t.attn_block_k + nr; }, {INV}, {"block_tokens"});
        if (nr % 2 == 0 && t.attn_block_k % (nr / 2) == 0)
            with("block_tokens not a multiple of NR", [&](auto &x) { x.block_tokens = nr / 2; }, {INV}, {"block_tokens"});
        with("dtype unknown", [](auto &x) { x.dtype = static_cast<mha_dtype>(7); }, {INV, MHA_UNSUPPORTED}, {"dtype"});
        with("dtype bf16", [](auto &x) { x.dtype = MHA_BF16; }, {MHA_UNSUPPORTED}, {});
        with("max_tokens whose bytes overflow", [&](auto &x) { x.max_tokens = huge; x.head_dim = 128; x.value_dim = 128; }, {INV},
             {"overflow", "max_tokens"});
    }

    SUBCASE("mha_kv_cache_append, fork, release, seq_len, free_tokens, bytes, get_config, read") {
        expect("append: rt NULL", [&] { return mha_kv_cache_append(nullptr, c, 1, 1, k.data(), v.data()); }, {INV}, null_names("rt"));
        expect("append: cache NULL", [&] { return mha_kv_cache_append(rt, nullptr, 1, 1, k.data(), v.data()); }, {INV}, null_names("cache"));
        expect("append: k NULL", [&] { return mha_kv_cache_append(rt, c, 1, 1, nullptr, v.data()); }, {INV}, null_names("k"));
        expect("append: v NULL", [&] { return mha_kv_cache_append(rt, c, 1, 1, k.data(), nullptr); }, {INV}, null_names("v"));
        expect("append: negative seq_id", [&] { return mha_kv_cache_append(rt, c, -1, 1, k.data(), v.data()); }, {INV}, {"seq_id"});
        expect("append: negative n_tokens", [&] { return mha_kv_cache_append(rt, c, 1, -1, k.data(), v.data()); }, {INV}, {"n_tokens"});
        const int64_t room = before.free + (bt - 5);  // seq 1's tail plus the free blocks
        expect("append past the capacity (existing sequence)",
               [&] { return mha_kv_cache_append(rt, c, 1, room + 1, k.data(), v.data()); }, {MHA_OUT_OF_MEMORY}, {});
        expect("append past the capacity (new sequence)",
               [&] { return mha_kv_cache_append(rt, c, 9, before.free + 1, k.data(), v.data()); }, {MHA_OUT_OF_MEMORY}, {});
        expect("append: n_tokens whose extent overflows",
               [&] { return mha_kv_cache_append(rt, c, 9, huge, k.data(), v.data()); }, {INV, MHA_OUT_OF_MEMORY}, {});
        expect("fork: cache NULL", [&] { return mha_kv_cache_fork(nullptr, 1, 3); }, {INV}, null_names("cache"));
        expect("fork onto an existing id", [&] { return mha_kv_cache_fork(c, 1, 2); }, {INV}, {"dst_seq"});
        expect("fork onto itself", [&] { return mha_kv_cache_fork(c, 1, 1); }, {INV}, {"dst_seq"});
        expect("fork from an unknown id", [&] { return mha_kv_cache_fork(c, 9, 3); }, {INV}, {"src_seq"});
        expect("fork from a negative id", [&] { return mha_kv_cache_fork(c, -2, 3); }, {INV}, {"src_seq"});
        expect("fork onto a negative id", [&] { return mha_kv_cache_fork(c, 1, -3); }, {INV}, {"dst_seq"});
        expect("release: cache NULL", [&] { return mha_kv_cache_release(nullptr, 1); }, {INV}, null_names("cache"));
        expect("release of an unknown id", [&] { return mha_kv_cache_release(c, 9); }, {INV}, {"seq_id"});
        expect("release of a negative id", [&] { return mha_kv_cache_release(c, -1); }, {INV}, {"seq_id"});
        int64_t n = -3;
        uint64_t b = 3;
        mha_kv_cache_config cfg{};
        cfg.head_dim = -9;
        expect("seq_len: cache NULL", [&] { return mha_kv_cache_seq_len(nullptr, 1, &n); }, {INV}, null_names("cache"));
        expect("seq_len: len NULL", [&] { return mha_kv_cache_seq_len(c, 1, nullptr); }, {INV}, null_names("len"));
        expect("seq_len: unknown id", [&] { return mha_kv_cache_seq_len(c, 9, &n); }, {INV}, {"seq_id"});
        expect("free_tokens: cache NULL", [&] { return mha_kv_cache_free_tokens(nullptr, &n); }, {INV}, null_names("cache"));
        expect("free_tokens: tokens NULL", [&] { return mha_kv_cache_free_tokens(c, nullptr); }, {INV}, null_names("tokens"));
        expect("bytes: cache NULL", [&] { return mha_kv_cache_bytes(nullptr, &b); }, {INV}, null_names("cache"));
        expect("bytes: bytes NULL", [&] { return mha_kv_cache_bytes(c, nullptr); }, {INV}, null_names("bytes"));
        expect("get_config: cache NULL", [&] { return mha_kv_cache_get_config(nullptr, &cfg); }, {INV}, null_names("cache"));
        expect("get_config: config NULL", [&] { return mha_kv_cache_get_config(c, nullptr); }, {INV}, null_names("config"));
        CHECK(n == -3);
        CHECK(b == 3);
        CHECK(cfg.head_dim == -9);
        expect("read: cache NULL", [&] { return mha_kv_cache_read(nullptr, 1, 0, 1, rk.data(), rv.data()); }, {INV}, null_names("cache"));
        expect("read: unknown id", [&] { return mha_kv_cache_read(c, 9, 0, 1, rk.data(), rv.data()); }, {INV}, {"seq_id"});
        expect("read: negative start", [&] { return mha_kv_cache_read(c, 1, -1, 2, rk.data(), rv.data()); }, {INV}, {"start"});
        expect("read: negative n_tokens", [&] { return mha_kv_cache_read(c, 1, 0, -1, rk.data(), rv.data()); }, {INV}, {"n_tokens"});
        expect("read past the sequence", [&] { return mha_kv_cache_read(c, 1, 2, 4, rk.data(), rv.data()); }, {INV},
               {"n_tokens", "start"});
        expect("read: huge n_tokens", [&] { return mha_kv_cache_read(c, 1, 2, huge, rk.data(), rv.data()); }, {INV},
               {"n_tokens", "start", "overflow"});
        // What fits is accepted: the capacity arithmetic above is right.
        REQUIRE(mha_kv_cache_append(rt, c, 1, room, k.data(), v.data()) == MHA_OK);
        CHECK(c.free_tokens() == 0);
    }

    SUBCASE("mha_attention_cached") {
        const std::vector<int64_t> gids = {1, 2}, gqo = {0, 2, 5};
        mha_cached_params good{};
        good.num_seqs = 2;
        good.seq_ids = gids.data();
        good.q_offsets = gqo.data();
        good.num_heads = 4;
        good.causal = 1;
        {
            std::vector<float> o(5 * 4 * 4);
            REQUIRE_MESSAGE(mha_attention_cached(rt, c, &good, q.data(), o.data()) == MHA_OK, mha_last_error());
        }
        auto with = [&](const std::string &what, const std::function<void(mha_cached_params &)> &edit,
                        std::initializer_list<mha_status> want, const std::vector<std::string> &needles) {
            expect(what, [&] {
                mha_cached_params p = good;
                edit(p);
                return mha_attention_cached(rt, c, &p, q.data(), out.data());
            }, want, needles);
        };
        expect("rt NULL", [&] { return mha_attention_cached(nullptr, c, &good, q.data(), out.data()); }, {INV}, null_names("rt"));
        expect("cache NULL", [&] { return mha_attention_cached(rt, nullptr, &good, q.data(), out.data()); }, {INV}, null_names("cache"));
        expect("p NULL", [&] { return mha_attention_cached(rt, c, nullptr, q.data(), out.data()); }, {INV}, null_names("p"));
        expect("q NULL", [&] { return mha_attention_cached(rt, c, &good, nullptr, out.data()); }, {INV}, null_names("q"));
        expect("out NULL", [&] { return mha_attention_cached(rt, c, &good, q.data(), nullptr); }, {INV}, null_names("out"));
        static const int64_t unknown[] = {1, 99}, dup[] = {2, 2}, neg[] = {-1, 2}, first[] = {1, 2, 5}, down[] = {0, 3, 2},
                             too_many[] = {0, 6, 7}, huge_qo[] = {0, 2, INT64_C(1) << 62};
        with("seq_ids NULL", [](auto &p) { p.seq_ids = nullptr; }, {INV}, {"seq_ids"});
        with("q_offsets NULL", [](auto &p) { p.q_offsets = nullptr; }, {INV}, {"q_offsets"});
        with("num_seqs < 0", [](auto &p) { p.num_seqs = -1; }, {INV}, {"num_seqs"});
        with("unknown seq_id", [](auto &p) { p.seq_ids = unknown; }, {INV}, {"seq_ids"});
        with("duplicate seq_ids", [](auto &p) { p.seq_ids = dup; }, {INV}, {"seq_ids"});
        with("negative seq_id", [](auto &p) { p.seq_ids = neg; }, {INV}, {"seq_ids"});
        with("q_offsets[0] != 0", [](auto &p) { p.q_offsets = first; }, {INV}, {"q_offsets"});
        with("q_offsets decreasing", [](auto &p) { p.q_offsets = down; }, {INV}, {"q_offsets"});
        with("more queries than cached tokens", [](auto &p) { p.q_offsets = too_many; }, {INV}, {"q_offsets"});
        with("offsets past everything", [](auto &p) { p.q_offsets = huge_qo; }, {INV}, {"q_offsets", "overflow"});
        with("num_heads not a multiple of the cache's num_kv_heads", [](auto &p) { p.num_heads = 3; }, {INV}, {"num_heads"});
        with("num_heads 0", [](auto &p) { p.num_heads = 0; }, {INV}, {"num_heads"});
        with("scale NaN", [](auto &p) { p.scale = NAN; }, {INV}, {"scale"});
        with("window < 0", [](auto &p) { p.variant.window = -1; }, {INV}, {"variant.window"});
        with("softcap inf", [](auto &p) { p.variant.softcap = INFINITY; }, {INV}, {"variant.softcap"});
        // A runtime with other attention tiles than the cache's.
        const Setup other = tiles_setup(su.isa, 5, 64, 128);
        Rt rt_other(1, other);
        expect("a runtime with other tiles", [&] { return mha_attention_cached(rt_other, c, &good, q.data(), out.data()); },
               {INV, MHA_UNSUPPORTED}, {});
    }

    SUBCASE("mha_layer_forward_cached") {
        const int64_t E = 16;
        LayerBox lb(rt, layer_cfg(E, 4, 2, 8, 4), 61);  // dims of the cache
        const auto x = random_floats(big, 62);
        const std::vector<int64_t> gids = {1, 3}, gqo = {0, 2, 3};
        mha_layer_cached_params good{};
        good.num_seqs = 2;
        good.seq_ids = gids.data();
        good.q_offsets = gqo.data();
        good.causal = 1;
        auto with = [&](const std::string &what, const std::function<void(mha_layer_cached_params &)> &edit,
                        std::initializer_list<mha_status> want, const std::vector<std::string> &needles) {
            expect(what, [&] {
                mha_layer_cached_params p = good;
                edit(p);
                return mha_layer_forward_cached(rt, lb.layer, c, &p, x.data(), out.data());
            }, want, needles);
        };
        expect("rt NULL", [&] { return mha_layer_forward_cached(nullptr, lb.layer, c, &good, x.data(), out.data()); }, {INV},
               null_names("rt"));
        expect("layer NULL", [&] { return mha_layer_forward_cached(rt, nullptr, c, &good, x.data(), out.data()); }, {INV},
               null_names("layer"));
        expect("cache NULL", [&] { return mha_layer_forward_cached(rt, lb.layer, nullptr, &good, x.data(), out.data()); }, {INV},
               null_names("cache"));
        expect("p NULL", [&] { return mha_layer_forward_cached(rt, lb.layer, c, nullptr, x.data(), out.data()); }, {INV},
               null_names("p"));
        expect("x NULL", [&] { return mha_layer_forward_cached(rt, lb.layer, c, &good, nullptr, out.data()); }, {INV},
               null_names("x"));
        expect("out NULL", [&] { return mha_layer_forward_cached(rt, lb.layer, c, &good, x.data(), nullptr); }, {INV},
               null_names("out"));
        static const int64_t dup[] = {3, 3}, neg[] = {1, -3}, first[] = {1, 2, 3}, down[] = {0, 2, 1},
                             huge_qo[] = {0, 1, INT64_C(1) << 62};
        with("seq_ids NULL", [](auto &p) { p.seq_ids = nullptr; }, {INV}, {"seq_ids"});
        with("q_offsets NULL", [](auto &p) { p.q_offsets = nullptr; }, {INV}, {"q_offsets"});
        with("num_seqs < 0", [](auto &p) { p.num_seqs = -2; }, {INV}, {"num_seqs"});
        with("duplicate seq_ids", [](auto &p) { p.seq_ids = dup; }, {INV}, {"seq_ids"});
        with("negative seq_id", [](auto &p) { p.seq_ids = neg; }, {INV}, {"seq_ids"});
        with("q_offsets[0] != 0", [](auto &p) { p.q_offsets = first; }, {INV}, {"q_offsets"});
        with("q_offsets decreasing", [](auto &p) { p.q_offsets = down; }, {INV}, {"q_offsets"});
        with("huge q_offsets", [](auto &p) { p.q_offsets = huge_qo; }, {INV, MHA_OUT_OF_MEMORY}, {});
        // Caches whose dims differ from the layer's.
        for (auto [what, shape, field] : {std::tuple{"cache head_dim differs", Shape{4, 2, 16, 4}, "head_dim"},
                                          std::tuple{"cache num_kv_heads differs", Shape{4, 4, 8, 4}, "num_kv_heads"},
                                          std::tuple{"cache value_dim differs", Shape{4, 2, 8, 8}, "value_dim"}}) {
            Cache other(rt, shape, 4 * bt);
            const int64_t free_other = other.free_tokens();
            extra_unchanged = {[&] { return other.free_tokens() == free_other && other.seq_len(1) == -1 && other.seq_len(3) == -1; }};
            expect(what, [&] { return mha_layer_forward_cached(rt, lb.layer, other, &good, x.data(), out.data()); }, {INV},
                   {field});
            extra_unchanged.clear();
        }
        // A cross-attention layer (kdim != E) cannot run incrementally.
        {
            LayerBox cross(rt, layer_cfg(E, 4, 2, 8, 4, 12), 63);
            expect("cross-attention layer", [&] { return mha_layer_forward_cached(rt, cross.layer, c, &good, x.data(), out.data()); },
                   {INV}, {});
        }
        // Each sequence's new tokens fit alone, but not all of them: nothing is appended to any.
        const int64_t tail1 = bt - 5, na = tail1 + bt, nb = before.free - bt + 1;
        REQUIRE(nb > 0);
        REQUIRE(sz((na + nb) * E) <= big);
        static std::vector<int64_t> ids2 = {1, 50}, qo2;
        qo2 = {0, na, na + nb};
        with("the new tokens of all sequences overflow the cache", [](auto &p) {
            p.seq_ids = ids2.data();
            p.q_offsets = qo2.data();
        }, {MHA_OUT_OF_MEMORY}, {});
        // And each alone does fit.
        std::vector<float> o(big);
        const std::vector<int64_t> only_b = {50}, qob = {0, nb};
        mha_layer_cached_params pb = good;
        pb.num_seqs = 1;
        pb.seq_ids = only_b.data();
        pb.q_offsets = qob.data();
        REQUIRE_MESSAGE(mha_layer_forward_cached(rt, lb.layer, c, &pb, x.data(), o.data()) == MHA_OK, mha_last_error());
        CHECK(c.seq_len(50) == nb);
        REQUIRE(mha_kv_cache_release(c, 50) == MHA_OK);
        // The good call itself is fine.
        REQUIRE_MESSAGE(mha_layer_forward_cached(rt, lb.layer, c, &good, x.data(), o.data()) == MHA_OK, mha_last_error());
        CHECK(c.seq_len(1) == 7);
        CHECK(c.seq_len(3) == 1);
    }
}
