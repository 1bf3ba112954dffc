// The int8 KV cache (MHA_I8) and the cache's window (see serving_util.hpp).
#include <doctest/doctest.h>

#include "serving_util.hpp"

using namespace mha;
using namespace serving_test;

// ================================================================================================
// int8 KV cache (MHA_I8)
// ================================================================================================

TEST_CASE("int8 cache: rows round-trip within half a step, saturated rows exactly, zero rows as zeros; 0.27x the bytes") {
    Rt rt(1, best_default());
    const Shape s{4, 2, 24, 40};
    Cache c(rt, s, 64, 0, MHA_I8);
    std::vector<float> k = random_floats(sz(6 * s.k_row()), 3, -3.0f, 3.0f), v = random_floats(sz(6 * s.v_row()), 4, -3.0f, 3.0f);
    // Token 0: saturated rows (all equal, of several magnitudes and signs); token 1: zeros; token 2:
    // one value and zeros.
    const float sat[] = {0.7f, -1e-3f, 3.3e7f, -123.456f};
    for (int64_t h = 0; h < s.Hkv; ++h) {
        std::fill(k.begin() + h * s.D, k.begin() + (h + 1) * s.D, sat[h]);
        std::fill(v.begin() + h * s.Dv, v.begin() + (h + 1) * s.Dv, sat[h + 2]);
    }
    std::fill(k.begin() + s.k_row(), k.begin() + 2 * s.k_row(), 0.0f);
    std::fill(v.begin() + s.v_row(), v.begin() + 2 * s.v_row(), 0.0f);
    std::fill(k.begin() + 2 * s.k_row(), k.begin() + 3 * s.k_row(), 0.0f);
    k[sz(2 * s.k_row() + 5)] = -2.5f;
    REQUIRE(mha_kv_cache_append(rt, c, 7, 6, k.data(), v.data()) == MHA_OK);
    std::vector<float> kr, vr;
    c.read(7, 0, 6, s, kr, vr);
    for (int64_t i = 0; i < s.k_row(); ++i) CHECK(kr[sz(i)] == k[sz(i)]);  // saturated: exact
    for (int64_t i = 0; i < s.v_row(); ++i) CHECK(vr[sz(i)] == v[sz(i)]);
    for (int64_t i = s.k_row(); i < 3 * s.k_row(); ++i) CHECK(kr[sz(i)] == k[sz(i)]);  // zeros, and a lone value
    auto within_half_step = [](const float *x, const float *y, int64_t n) {
        float m = 0;
        for (int64_t i = 0; i < n; ++i) m = std::max(m, std::fabs(x[i]));
        for (int64_t i = 0; i < n; ++i) REQUIRE(std::fabs(x[i] - y[i]) <= m / 127.0f * 0.5f * 1.0001f);
    };
    for (int64_t t = 3; t < 6; ++t)
        for (int64_t h = 0; h < s.Hkv; ++h) {
            within_half_step(&k[sz(t * s.k_row() + h * s.D)], &kr[sz(t * s.k_row() + h * s.D)], s.D);
            within_half_step(&v[sz(t * s.v_row() + h * s.Dv)], &vr[sz(t * s.v_row() + h * s.Dv)], s.Dv);
        }
    // Bytes: H8 D128, int8 plus a scale per token and head, against fp32.
    const Shape big{8, 8, 128, 128};
    Cache f32(rt, big, 4096), i8(rt, big, 4096, 0, MHA_I8);
    uint64_t bf = 0, bi = 0;
    REQUIRE(mha_kv_cache_bytes(f32, &bf) == MHA_OK);
    REQUIRE(mha_kv_cache_bytes(i8, &bi) == MHA_OK);
    CHECK(static_cast<double>(bi) <= 0.27 * static_cast<double>(bf));
    CHECK(i8.config().dtype == MHA_I8);
    // A non-finite value: refused, nothing appended; a dtype outside the enum: refused.
    k[5] = NAN;
    CHECK(mha_kv_cache_append(rt, c, 7, 6, k.data(), v.data()) == MHA_INVALID_ARGUMENT);
    CHECK(std::string(mha_last_error()).find("non-finite") != std::string::npos);
    CHECK(c.seq_len(7) == 6);
    mha_kv_cache_config bad{};
    bad.num_kv_heads = 1; bad.head_dim = 8; bad.value_dim = 8; bad.max_tokens = 16;
    int bad_dtype = 3;
    std::memcpy(&bad.dtype, &bad_dtype, sizeof bad_dtype);
    mha_kv_cache *none = nullptr;
    CHECK(mha_kv_cache_create(rt, &bad, &none) == MHA_INVALID_ARGUMENT);
    CHECK(std::string(mha_last_error()).find("dtype") != std::string::npos);
    CHECK(none == nullptr);
}

TEST_CASE("int8 cache: attention adds no error beyond storage (double reference on the widened K and V) and keeps every bit-identity across paths and threads") {
    for (Isa isa : supported_isas())
        for (const Setup &su : {default_setup(isa), tiles_setup(isa, 5, 64, 128)})
            // GQA groups of 1 to 6 rows: decode's int8 scores take two key panels at a time up to 6.
            for (const Shape &s : {Shape{8, 2, 32, 32}, Shape{4, 1, 13, 7}, Shape{6, 1, 16, 16}, Shape{3, 3, 16, 20},
                                   Shape{6, 3, 40, 16}}) {
                CAPTURE(su.name);
                CAPTURE(s.D);
                CAPTURE(s.H / s.Hkv);
                const int64_t L = 200, row = s.o_row();
                Rt r1(1, su), r2(2, su);
                const SeqData t(s, L, 3000);
                const int64_t bt = block_tokens_for(r1, s);
                Cache c(r1, s, capacity(bt, {L, L, L}), 0, MHA_I8);
                append(r1, c, s, 1, t, 0, L);
                std::vector<float> kw, vw;  // the widened values the cache holds
                c.read(1, 0, L, s, kw, vw);
                // The prefill in one call on one thread: within 1e-5 of the double reference on the
                // widened K and V (the int8 arithmetic scales scores and probabilities, not the stored
                // values, so it differs from fp32 on the widened values in the last bits), and what
                // every other cached path must give, bit for bit.
                std::vector<float> F(sz(L * row), test::kSentinel);
                REQUIRE_MESSAGE(cached(r1, c, {1}, {0, L}, s.H, true, t.q.data(), F.data()) == MHA_OK, mha_last_error());
                const auto want = reference(s, L, L, true, t.q.data(), kw.data(), vw.data());
                int bad = 0;
                for (size_t i = 0; i < want.size(); ++i)
                    if (!(std::fabs(F[i] - want[i]) <= 1e-5 * std::max(1.0, std::fabs(want[i]))) && bad++ < 3)
                        FAIL_CHECK("[" << i << "] = " << F[i] << ", want " << want[i]);
                std::vector<float> out(sz(L * row), test::kSentinel);
                REQUIRE_MESSAGE(cached(r2, c, {1}, {0, L}, s.H, true, t.q.data(), out.data()) == MHA_OK, mha_last_error());
                same_rows(out.data(), F.data(), L, row, "int8 cached prefill on 2 threads = on 1");
                if (bad < 3) bad += static_cast<int>(chunks_then_steps(r1, r2, c, s, t, F, L, {1, 7, 64}, "int8 "));
                CHECK(bad == 0);
            }
}

TEST_CASE("kv cache window: blocks outside every future window go back, attention keeps its bits, and what they held is refused") {
    const Shape s{8, 2, 16, 16};
    const int64_t W = 100, L = 700;
    for (Isa isa : supported_isas())
        for (mha_dtype dtype : {MHA_F32, MHA_I8}) {
            CAPTURE(std::string(isa_name(isa)));
            CAPTURE(static_cast<int>(dtype));
            const Setup su = tiles_setup(isa, 5, 64, 128);
            Rt r1(1, su), r2(2, su);
            const SeqData t(s, L, 4000);
            mha_kv_cache_config cfg{};
            cfg.num_kv_heads = s.Hkv; cfg.head_dim = s.D; cfg.value_dim = s.Dv;
            cfg.max_tokens = 2048;
            cfg.dtype = dtype;
            cfg.window = W;
            mha_kv_cache *c = nullptr;
            REQUIRE_MESSAGE(mha_kv_cache_create(r1, &cfg, &c) == MHA_OK, mha_last_error());
            mha_kv_cache_config got{};
            REQUIRE(mha_kv_cache_get_config(c, &got) == MHA_OK);
            CHECK(got.window == W);
            const int64_t bt = got.block_tokens;
            int64_t all_free = 0;
            REQUIRE(mha_kv_cache_free_tokens(c, &all_free) == MHA_OK);
            // The reference: the same tokens in a cache that keeps everything, attended with the window.
            Cache full(r1, s, 2048, 0, dtype);
            append(r1, full, s, 1, t, 0, L);
            const VariantScope scope(mha_attention_variant{W, 0.0f, nullptr, nullptr});
            std::vector<float> want(sz(L * s.o_row()));
            REQUIRE(cached(r1, full, {1}, {0, L}, s.H, true, t.q.data(), want.data()) == MHA_OK);
            int64_t pos = 0, bad = 0, most_held = 0;
            for (int64_t n : chunks_of(L, {50, 1, 7, 64, 100, 1, 1, 200})) {
                mha_runtime *rt = pos % 2 ? static_cast<mha_runtime *>(r2) : static_cast<mha_runtime *>(r1);
                append(rt, c, s, 7, t, pos, n);
                std::vector<float> out(sz(n * s.o_row()), test::kSentinel);
                REQUIRE_MESSAGE(cached(rt, c, {7}, {0, n}, s.H, true, t.q.data() + pos * s.q_row(), out.data()) == MHA_OK,
                                std::string(mha_last_error()));
                bad += !same_rows(out.data(), want.data() + pos * s.o_row(), n, s.o_row(), "window cache chunk", pos);
                pos += n;
                int64_t free_now = 0;
                REQUIRE(mha_kv_cache_free_tokens(c, &free_now) == MHA_OK);
                most_held = std::max(most_held, all_free - free_now);
                // Held: what the last append's first token can see, plus that append, in whole blocks.
                CHECK(all_free - free_now <= (W + n + 2 * bt) / bt * bt);
            }
            CHECK(bad == 0);
            CHECK(most_held < L);
            // A window past the cache's, or none, is refused; so are queries whose window reaches
            // released positions, and reading them.
            std::vector<float> out(sz(400 * s.o_row()), test::kSentinel);
            {
                const VariantScope wide(mha_attention_variant{W + 1, 0.0f, nullptr, nullptr});
                CHECK(cached(r1, c, {7}, {0, 1}, s.H, true, t.q.data() + (L - 1) * s.q_row(), out.data()) == MHA_INVALID_ARGUMENT);
                CHECK(std::string(mha_last_error()).find("variant.window") != std::string::npos);
            }
            {
                const VariantScope none(mha_attention_variant{});
                CHECK(cached(r1, c, {7}, {0, 1}, s.H, true, t.q.data() + (L - 1) * s.q_row(), out.data()) == MHA_INVALID_ARGUMENT);
            }
            {
                const VariantScope again(mha_attention_variant{W, 0.0f, nullptr, nullptr});  // (scopes reset to none)
                // The last append (276 tokens at 424) released what precedes 325 - 325 % bt: queries from 300 see 201 on.
                CHECK(cached(r1, c, {7}, {0, 400}, s.H, true, t.q.data() + (L - 400) * s.q_row(), out.data()) ==
                      MHA_INVALID_ARGUMENT);
                CHECK(std::string(mha_last_error()).find("released") != std::string::npos);
            }
            CHECK(all_sentinel(out));
            std::vector<float> k(sz(s.k_row())), v(sz(s.v_row()));
            CHECK(mha_kv_cache_read(c, 7, 0, 1, k.data(), v.data()) == MHA_INVALID_ARGUMENT);
            CHECK(mha_kv_cache_read(c, 7, L - 1, 1, k.data(), v.data()) == MHA_OK);
            // Fork shares what is left; releasing both gives every block back.
            REQUIRE(mha_kv_cache_fork(c, 7, 8) == MHA_OK);
            append(r1, c, s, 8, t, 0, 1);
            REQUIRE(mha_kv_cache_release(c, 7) == MHA_OK);
            REQUIRE(mha_kv_cache_release(c, 8) == MHA_OK);
            int64_t free_end = 0;
            REQUIRE(mha_kv_cache_free_tokens(c, &free_end) == MHA_OK);
            CHECK(free_end == all_free);
            cfg.window = -1;
            mha_kv_cache *none = nullptr;
            CHECK(mha_kv_cache_create(r1, &cfg, &none) == MHA_INVALID_ARGUMENT);
            CHECK(std::string(mha_last_error()).find("window") != std::string::npos);
            mha_kv_cache_destroy(c);
        }
}
