// The GEMM against a double-precision reference: every microkernel the host supports, the tile
// edges of each, both paths (packed and small-problem), transposes, alpha/beta, padded leading
// dimensions, thread-count determinism, concurrent host threads and bad input.
#include <algorithm>
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <string>

#include "gemm/prepacked.hpp"
#include "gemm/sgemm_kernels.hpp"
#include "mha/gemm.hpp"
#include "gemm_test_util.hpp"
#include "reference.hpp"
#include "test_util.hpp"

using namespace mha;
using mha::test::default_tiles;
using mha::test::host_kernels;
using mha::test::kSentinel;
using mha::test::small_tiles;

namespace {

struct GemmCase {
    char ta = 'N', tb = 'N';
    int64_t m = 1, n = 1, k = 1;
    float alpha = 1.0f, beta = 0.0f;
    int64_t pad_a = 0, pad_b = 0, pad_c = 0;  // extra columns in each leading dimension
    bool nan_in_c = false;                   // with beta == 0 the NaN must be overwritten
    uint32_t seed = 1;
};

std::string describe(const GemmCase &g) {
    return std::string(1, g.ta) + g.tb + " m=" + std::to_string(g.m) + " n=" + std::to_string(g.n) +
           " k=" + std::to_string(g.k) + " alpha=" + std::to_string(g.alpha) + " beta=" + std::to_string(g.beta) +
           " pads=" + std::to_string(g.pad_a) + "," + std::to_string(g.pad_b) + "," + std::to_string(g.pad_c);
}

// Runs one case and checks every element against the double reference (unless with_reference is
// false: a run whose bits the caller compares with a checked one), and that nothing outside the
// m x n window of C was written. Returns C (with padding) for bitwise comparisons.
std::vector<float> check_gemm(Runtime &rt, const GemmCase &g, bool with_reference = true) {
    const int64_t a_rows = g.ta == 'N' ? g.m : g.k, a_cols = g.ta == 'N' ? g.k : g.m;
    const int64_t b_rows = g.tb == 'N' ? g.k : g.n, b_cols = g.tb == 'N' ? g.n : g.k;
    const int64_t lda = a_cols + g.pad_a, ldb = b_cols + g.pad_b, ldc = g.n + g.pad_c;
    auto a = test::random_floats(static_cast<size_t>(a_rows * lda + 1), g.seed);
    auto b = test::random_floats(static_cast<size_t>(b_rows * ldb + 1), g.seed + 7);
    auto c = test::random_floats(static_cast<size_t>(g.m * ldc + 1), g.seed + 13);
    for (int64_t i = 0; i < g.m; ++i)
        for (int64_t j = g.n; j < ldc; ++j) c[static_cast<size_t>(i * ldc + j)] = kSentinel;
    c.back() = kSentinel;
    if (g.nan_in_c)
        for (int64_t i = 0; i < g.m; ++i) c[static_cast<size_t>(i * ldc)] = std::numeric_limits<float>::quiet_NaN();

    std::vector<double> want, mag;
    if (with_reference)
        ref::sgemm(g.ta, g.tb, g.m, g.n, g.k, g.alpha, a.data(), lda, b.data(), ldb, g.beta, c.data(), ldc, want, mag);
    sgemm(rt, static_cast<Trans>(g.ta), static_cast<Trans>(g.tb), g.m, g.n, g.k, g.alpha, a.data(), lda, b.data(),
          ldb, g.beta, c.data(), ldc);

    const double eps = std::numeric_limits<float>::epsilon();
    int64_t bad = 0;
    for (int64_t i = 0; i < g.m; ++i) {
        for (int64_t j = 0; with_reference && j < g.n; ++j) {
            const size_t r = static_cast<size_t>(i * g.n + j);
            const double got = c[static_cast<size_t>(i * ldc + j)];
            const double tol = 2.0 * eps * static_cast<double>(g.k + 2) * mag[r] + 1e-30;
            if (!(std::fabs(got - want[r]) <= tol) && bad++ < 3)
                FAIL_CHECK(describe(g) << " at (" << i << "," << j << "): got " << got << " want " << want[r]);
        }
        for (int64_t j = g.n; j < ldc; ++j)
            if (c[static_cast<size_t>(i * ldc + j)] != kSentinel && bad++ < 3)
                FAIL_CHECK(describe(g) << ": padding of C written at (" << i << "," << j << ")");
    }
    CHECK_MESSAGE(c.back() == kSentinel, describe(g), ": wrote past the end of C");
    CHECK_MESSAGE(bad == 0, describe(g));
    return c;
}

// How many elements of the m x n window (leading dimension ld) differ in their bits.
int64_t differing(const std::vector<float> &x, const std::vector<float> &y, int64_t m, int64_t n, int64_t ld) {
    int64_t count = 0;
    for (int64_t i = 0; i < m; ++i)
        for (int64_t j = 0; j < n; ++j) {
            const size_t at = static_cast<size_t>(i * ld + j);
            count += std::memcmp(&x[at], &y[at], sizeof(float)) != 0;
        }
    return count;
}

// fn(rt, small) for every kernel the host runs, on the small tiles and on the defaults.
template <class Fn>
void on_every_kernel_and_tiling(const Fn &fn) {
    for (const auto *uk : host_kernels()) {
        const std::string kernel_name = uk->name;
        CAPTURE(kernel_name);
        for (bool small : {true, false}) {
            Runtime rt(small ? small_tiles(*uk) : default_tiles(*uk));
            fn(rt, small);
        }
    }
}

// check_gemm under each register transpose (shuffles, then inserts: TileConfig::transpose), on
// runtimes otherwise like rt, and the two results bit for bit.
void check_both_transposes(const test::BothTransposes &both, const GemmCase &g, bool small) {
    std::vector<float> c[2];
    for (int v = 0; v < 2; ++v) c[v] = check_gemm(*both.rt[v], g);
    CHECK_MESSAGE(differing(c[0], c[1], g.m, g.n, g.n + g.pad_c) == 0, describe(g), " small=", small);
}

} // namespace

TEST_CASE("the host runs at least one kernel, and every ISA it supports has a default") {
    REQUIRE_FALSE(host_kernels().empty());
    for (Isa isa : supported_isas()) {
        Runtime rt(RuntimeOptions{1, isa, {}, {}});
        CHECK(rt.isa() == isa);
        CHECK(gemm::find_sgemm_kernel(rt.tiles().gemm_ukernel) != nullptr);
    }
}

TEST_CASE("edge tiles: m, n, k at 1, below, at and above MR, NR, MC, KC, NC, on both paths") {
    for (const auto *uk : host_kernels()) {
        const std::string kernel_name = uk->name;
        CAPTURE(kernel_name);
        Runtime rt(small_tiles(*uk));
        const int64_t MR = uk->mr, NR = uk->nr;
        std::vector<int64_t> ms, ns;
        for (int64_t x = 1; x <= MR + 1; ++x) ms.push_back(x);
        for (int64_t x : {2 * MR - 1, 2 * MR, 2 * MR + 1, 4 * MR + 3}) ms.push_back(x);
        // NR + NR / 2: an edge tile whole vectors wide, which the narrower kernel stores in place.
        for (int64_t x : {int64_t{1}, int64_t{2}, NR - 1, NR, NR + 1, NR + NR / 2, 2 * NR, 2 * NR + 1, 4 * NR + 5})
            ns.push_back(x);
        for (int64_t k : {1, 7, 8, 9, 15, 16, 17, 33}) {
            for (int64_t m : ms)
                for (int64_t n : ns) {
                    GemmCase g;
                    g.m = m; g.n = n; g.k = k;
                    g.seed = static_cast<uint32_t>(m * 1000 + n * 10 + k);
                    check_gemm(rt, g);
                }
        }
    }
}

TEST_CASE("weights packed once, with the bias epilogue: every kernel, edge tiles, column offsets, odd lds") {
    for (const auto *uk : host_kernels()) {
        const std::string kernel_name = uk->name;
        CAPTURE(kernel_name);
        for (bool small : {true, false}) {
            Runtime rt(small ? small_tiles(*uk, 2) : default_tiles(*uk, 2));
            const int64_t MR = uk->mr, NR = uk->nr;
            for (int64_t k : {int64_t{1}, int64_t{15}, int64_t{17}, int64_t{40}})
                for (int64_t n_total : {int64_t{1}, NR - 1, NR, NR + NR / 2, 2 * NR + 3})
                    for (int64_t m : {int64_t{1}, MR - 1, MR, MR + 1, 3 * MR + 2}) {
                        // W [n_total, k] as nn.Linear stores it; B = W^T.
                        const auto w = test::random_floats(static_cast<size_t>(n_total * k), 3);
                        const auto bias = test::random_floats(static_cast<size_t>(n_total), 4);
                        const gemm::PackedB pb = gemm::pack_b(rt.state(), k, n_total, w.data(), 1, k);
                        const int64_t lda = k + 3;
                        const auto a = test::random_floats(static_cast<size_t>(m * lda), 5);
                        // Every column offset that starts a panel, and every width to the end.
                        for (int64_t j0 = 0; j0 < n_total; j0 += NR)
                            for (bool with_bias : {false, true}) {
                                const int64_t n = n_total - j0, ldc = n + 5;
                                std::vector<float> c(static_cast<size_t>(m * ldc), kSentinel);
                                gemm::sgemm_prepacked(rt.state(), m, n, a.data(), lda, pb, j0,
                                                      with_bias ? bias.data() + j0 : nullptr, c.data(), ldc);
                                int64_t bad = 0;
                                for (int64_t i = 0; i < m; ++i)
                                    for (int64_t j = 0; j < ldc; ++j) {
                                        const float got = c[static_cast<size_t>(i * ldc + j)];
                                        if (j >= n) {
                                            bad += got != kSentinel;
                                            continue;
                                        }
                                        double want = with_bias ? bias[static_cast<size_t>(j0 + j)] : 0.0, mag = std::fabs(want);
                                        for (int64_t p = 0; p < k; ++p) {
                                            const double t = static_cast<double>(a[static_cast<size_t>(i * lda + p)]) *
                                                             w[static_cast<size_t>((j0 + j) * k + p)];
                                            want += t;
                                            mag += std::fabs(t);
                                        }
                                        bad += !(std::fabs(got - want) <= 2.0 * 1.2e-7 * static_cast<double>(k + 2) * mag);
                                    }
                                CHECK_MESSAGE(bad == 0, "m=", m, " n=", n, " k=", k, " j0=", j0, " bias=", with_bias);
                            }
                    }
        }
    }
}

TEST_CASE("weights packed for one kernel or KC are refused by a runtime with another") {
    const auto *uk = host_kernels().front();
    Runtime small(small_tiles(*uk)), normal(default_tiles(*uk));
    const auto w = test::random_floats(64 * 40, 1), a = test::random_floats(4 * 40, 2);
    const gemm::PackedB pb = gemm::pack_b(small.state(), 40, 64, w.data(), 1, 40);
    std::vector<float> c(4 * 64, kSentinel);
    CHECK_THROWS_WITH_AS(gemm::sgemm_prepacked(normal.state(), 4, 64, a.data(), 40, pb, 0, nullptr, c.data(), 64),
                         doctest::Contains("packed for"), Error);
    for (float x : c) REQUIRE(x == kSentinel);
}

TEST_CASE("all four transpose pairs, alpha/beta variants and beta = 0 over NaN") {
    for (const auto *uk : host_kernels()) {
        const std::string kernel_name = uk->name;
        CAPTURE(kernel_name);
        for (bool small : {true, false}) {
            Runtime rt(small ? small_tiles(*uk) : default_tiles(*uk));
            for (char ta : {'N', 'T'})
                for (char tb : {'N', 'T'})
                    for (auto [alpha, beta] : {std::pair{1.0f, 0.0f}, {0.5f, 1.0f}, {-2.0f, 0.25f}, {1.0f, -1.0f}})
                        for (auto [m, n, k] : {std::tuple{37, 45, 29}, {uk->mr * 3, uk->nr * 2, 40}, {5, 130, 3}}) {
                            GemmCase g;
                            g.ta = ta; g.tb = tb; g.m = m; g.n = n; g.k = k;
                            g.alpha = alpha; g.beta = beta;
                            g.nan_in_c = beta == 0.0f;
                            check_gemm(rt, g);
                        }
        }
    }
}

TEST_CASE("few rows against B^T: both register transposes (shuffles, inserts) give the same bits, on every kernel") {
    // From 5 rows macro_bt_rows transposes B^T's blocks with either form of Transpose's columns
    // (gemm/transpose_variant.hpp: TileConfig::transpose); both must move the same
    // floats. Every row count the path takes and the ones around it; columns whose last block
    // holds 1, 3, 4, 7, 10, 13 or 15 of a 16 x 16 block's rows (1-7 of an 8 x 8 one) or all of
    // them; depths below, at and past a block; beta 0 and 1; an odd ldb; small and default tiles.
    // Against double under each form, and the two results bit for bit.
    on_every_kernel_and_tiling([](Runtime &rt, bool small) {
        const test::BothTransposes both(rt);
        for (int64_t m = 1; m <= 10; ++m)
            for (int64_t n : {1, 7, 15, 16, 17, 19, 26, 29, 33, 100})
                for (int64_t k : {1, 15, 16, 17, 40})
                    for (float beta : {0.0f, 1.0f}) {
                        GemmCase g;
                        g.tb = 'T';
                        g.m = m; g.n = n; g.k = k; g.beta = beta;
                        g.pad_b = 3; g.pad_c = 1;
                        g.nan_in_c = beta == 0.0f;
                        g.seed = static_cast<uint32_t>(m * 131 + n * 7 + k);
                        check_both_transposes(both, g, small);
                    }
    });
}

TEST_CASE("packing B^T and A^T: both register transposes (shuffles, inserts) give the same bits, on every kernel") {
    // The transposing pack (sgemm_pack.hpp: B^T's panels, A^T's strips) takes the runtime's
    // register transpose (TileConfig::transpose); both must move the same floats. Rows and
    // columns that cut a 16 x 16 (8 x 8) block anywhere, depths below, at and past a block and past
    // the small tiles' KC; NT, TN and TT; odd leading dimensions. Against double under each form,
    // and the two results bit for bit.
    on_every_kernel_and_tiling([](Runtime &rt, bool small) {
        const test::BothTransposes both(rt);
        for (auto [ta, tb] : {std::pair{'N', 'T'}, {'T', 'N'}, {'T', 'T'}})
            for (int64_t m : {29, 131})
                for (int64_t n : {7, 33, 70})
                    for (int64_t k : {5, 16, 17, 45, 300}) {
                        GemmCase g;
                        g.ta = ta; g.tb = tb;
                        g.m = m; g.n = n; g.k = k;
                        g.pad_a = 3; g.pad_b = 1; g.pad_c = 2;
                        g.seed = static_cast<uint32_t>(m * 131 + n * 7 + k);
                        check_both_transposes(both, g, small);
                    }
    });
}

TEST_CASE("primes up to about 300, padded leading dimensions, default tiles") {
    const int64_t primes[] = {2, 3, 5, 13, 31, 61, 67, 127, 131, 193, 257, 293};
    for (const auto *uk : host_kernels()) {
        const std::string kernel_name = uk->name;
        CAPTURE(kernel_name);
        Runtime rt(default_tiles(*uk, 2));
        uint32_t seed = 3;
        for (int64_t m : primes)
            for (int64_t n : {int64_t{3}, int64_t{67}, int64_t{293}})
                for (int64_t k : {int64_t{5}, int64_t{131}, int64_t{293}}) {
                    GemmCase g;
                    g.m = m; g.n = n; g.k = k;
                    g.ta = (seed & 1) ? 'T' : 'N';
                    g.tb = (seed & 2) ? 'T' : 'N';
                    g.pad_a = seed % 5; g.pad_b = (seed / 5) % 3; g.pad_c = seed % 7;
                    g.beta = (seed % 3) ? 0.0f : 0.5f;
                    g.seed = seed++;
                    check_gemm(rt, g);
                }
    }
}

TEST_CASE("A stored transposed on the small-problem path: its strips packed, the bits of A stored as is") {
    // The small-problem path packs the strips of a transposed A whose rows lie a multiple of 1 KiB
    // apart, or of a large enough product with A^T's rows 64 floats or longer apart (see
    // sgemm_sup), and reads the others in place; few rows against B^T take the B^T path instead,
    // whose A^T panels are packed too. Every element must have the bits of the same product on A
    // stored as is (each sum the same ordered chain), and the reference's values: row counts
    // around MR, the edge panel, depths within and past a KC block, both B layouts, beta 0 and 1.
    for (const auto *uk : host_kernels()) {
        const std::string kernel_name = uk->name;
        CAPTURE(kernel_name);
        const int64_t MR = uk->mr, NR = uk->nr;
        for (bool small : {true, false}) {
            Runtime rt(small ? small_tiles(*uk, 2) : default_tiles(*uk, 2));
            struct Case {
                int64_t m, n, k, lda;
            };
            std::vector<Case> cases;
            for (int64_t m : {int64_t{1}, MR - 1, MR, MR + 1, 2 * MR + 3, 3 * MR})
                for (int64_t n : {NR - 1, 2 * NR + 3})
                    for (int64_t k : {7, 40, 333}) cases.push_back({m, n, k, 256});
            cases.push_back({300, small ? NR : 200, small ? 300 : 100, 512});   // a multiple of 1 KiB
            cases.push_back({300, small ? NR - 3 : 200, small ? 8 : 100, 305});  // large enough (default tiles)
            for (const auto &[m, n, k, lda] : cases)
                for (char tb : {'N', 'T'})
                    for (float beta : {0.0f, 1.0f}) {
                        const int64_t ldb = (tb == 'N' ? n : k) + 1, ldc = n + 2, ld_rows = k + 3;
                        const auto at = test::random_floats(static_cast<size_t>(k * lda), static_cast<uint32_t>(m + n + k));
                        const auto b = test::random_floats(static_cast<size_t>((tb == 'N' ? k : n) * ldb), 77);
                        std::vector<float> a_rows(static_cast<size_t>(m * ld_rows));
                        for (int64_t i = 0; i < m; ++i)
                            for (int64_t p = 0; p < k; ++p) a_rows[i * ld_rows + p] = at[p * lda + i];
                        const auto c0 = test::random_floats(static_cast<size_t>(m * ldc), 78);
                        std::vector<float> c_t(c0), c_n(c0);
                        sgemm(rt, Trans::T, static_cast<Trans>(tb), m, n, k, 1.0f, at.data(), lda, b.data(), ldb, beta,
                              c_t.data(), ldc);
                        sgemm(rt, Trans::N, static_cast<Trans>(tb), m, n, k, 1.0f, a_rows.data(), ld_rows, b.data(), ldb,
                              beta, c_n.data(), ldc);
                        CHECK_MESSAGE(test::same_bits(c_t, c_n), "small=", small, " tb=", tb, " m=", m, " n=", n, " k=", k,
                                      " lda=", lda, " beta=", beta);
                    }
            for (const auto &[m, n, k, lda] : {cases[7], cases.back()})
                check_gemm(rt, GemmCase{'T', 'N', m, n, k, 0.5f, 1.0f, lda - m, 1, 2, false, 5});
        }
    }
}

TEST_CASE("skinny and attention-shaped products") {
    for (Isa isa : supported_isas()) {
        CAPTURE(isa_name(isa));
        Runtime rt(RuntimeOptions{2, isa, {}, {}});
        for (auto [ta, tb, m, n, k] : {std::tuple{'N', 'N', 1, 1000, 64}, {'N', 'N', 1000, 1, 64},
                                       {'N', 'T', 1, 1000, 64}, {'T', 'N', 1000, 1, 64},
                                       {'N', 'T', 200, 300, 64}, {'N', 'N', 300, 64, 200},
                                       {'N', 'N', 129, 65, 513}, {'N', 'T', 3, 5, 1000}}) {
            GemmCase g;
            g.ta = ta; g.tb = tb; g.m = m; g.n = n; g.k = k;
            g.pad_a = 3; g.pad_c = 1;
            check_gemm(rt, g);
        }
    }
}

TEST_CASE("k == 0 gives beta * C; m == 0 or n == 0 does nothing; alpha == 0 does not read A or B") {
    Runtime rt(RuntimeOptions{1, {}, {}, {}});
    std::vector<float> c = {1, 2, 3, 4};
    sgemm(rt, Trans::N, Trans::N, 2, 2, 0, 1.0f, nullptr, 1, nullptr, 2, 0.5f, c.data(), 2);
    CHECK(c == std::vector<float>{0.5f, 1, 1.5f, 2});
    c[0] = std::numeric_limits<float>::quiet_NaN();
    sgemm(rt, Trans::N, Trans::N, 2, 2, 0, 1.0f, nullptr, 1, nullptr, 2, 0.0f, c.data(), 2);
    CHECK(c == std::vector<float>{0, 0, 0, 0});
    std::vector<float> untouched = {7, 7};
    sgemm(rt, Trans::N, Trans::N, 0, 2, 3, 1.0f, nullptr, 3, nullptr, 2, 0.0f, untouched.data(), 2);
    sgemm(rt, Trans::N, Trans::N, 1, 0, 3, 1.0f, nullptr, 3, nullptr, 1, 0.0f, untouched.data(), 1);
    CHECK(untouched == std::vector<float>{7, 7});
    std::vector<float> a = {std::numeric_limits<float>::quiet_NaN(), 1}, b = {1, 1};
    c = {1, 2, 3, 4};
    sgemm(rt, Trans::N, Trans::N, 2, 2, 1, 0.0f, a.data(), 1, b.data(), 2, 2.0f, c.data(), 2);
    CHECK(c == std::vector<float>{2, 4, 6, 8});
}

TEST_CASE("1, 2 and 3 threads give the same bits, on both paths") {
    for (const auto *uk : host_kernels()) {
        const std::string kernel_name = uk->name;
        CAPTURE(kernel_name);
        // (Depths in (128, KC] with 8 strips or more: the small-problem path on one thread, the
        // packed path on more; see sgemm.)
        for (auto [ta, tb, m, n, k] : {std::tuple{'N', 'N', 301, 257, 700}, {'T', 'T', 97, 515, 300},
                                       {'N', 'T', 511, 300, 64}, {'N', 'N', 700, 64, 301}, {'N', 'N', 301, 257, 300},
                                       {'N', 'T', 200, 300, 256}, {'T', 'N', 200, 260, 300}}) {
            GemmCase g;
            g.ta = ta; g.tb = tb; g.m = m; g.n = n; g.k = k;
            g.beta = 0.5f;
            Runtime r1(default_tiles(*uk, 1)), r2(default_tiles(*uk, 2)), r3(default_tiles(*uk, 3));
            const auto c1 = check_gemm(r1, g), c2 = check_gemm(r2, g, false), c3 = check_gemm(r3, g, false);
            CHECK(test::same_bits(c1, c2));
            CHECK(test::same_bits(c1, c3));
        }
    }
}

TEST_CASE("a few strips on 2 and 3 threads: their columns split between the threads, the bits of one thread") {
    // Up to four strips (4 MR - 1 rows; 32 on AVX2) on more than one thread, each thread takes a
    // share of B's columns (NR at a time) over the whole depth on the one-thread path (sgemm's
    // on_threads), for stored B and packed B alike; whether B comes from memory (the chain, the
    // chunks) is still judged on the whole B. Rows 1, 2, the lanes' few-rows path's last (9, or 8
    // on AVX2, past its MR of 6), MR, MR + 1, two strips and an odd part, the last rows split
    // (4 MR - 1; 32 on AVX2) and the first rows not; every transpose; widths of 4 NR + 5 (shares
    // of 2, 2 and 1 panels on 3 threads, the last cut by the edge) and 1000; one depth block or
    // several (and, on the defaults, a B past 2 KC x NC, whose halves are not); padded leading
    // dimensions; packed B with a bias and an activation, whose offsets follow each share.
    for (const auto *uk : host_kernels()) {
        const std::string kernel_name = uk->name;
        CAPTURE(kernel_name);
        for (bool small : {true, false}) {
            Runtime r1(small ? small_tiles(*uk, 1) : default_tiles(*uk, 1));
            Runtime r2(small ? small_tiles(*uk, 2) : default_tiles(*uk, 2));
            Runtime r3(small ? small_tiles(*uk, 3) : default_tiles(*uk, 3));
            const TileConfig &t = r1.tiles();
            const int64_t past = (2 * t.kc * t.nc + 999) / 1000 + 5;  // k for 1000 columns past 2 KC x NC
            const std::vector<std::pair<int64_t, int64_t>> shapes =
                small ? std::vector<std::pair<int64_t, int64_t>>{{4 * uk->nr + 5, 45}, {1000, 333}}
                      : std::vector<std::pair<int64_t, int64_t>>{{4 * uk->nr + 5, 7}, {1000, past}};
            const int64_t MR = uk->mr, split_last = uk->lanes == 16 ? 4 * MR - 1 : 32;
            for (int64_t m : {int64_t{1}, int64_t{2}, int64_t{uk->lanes == 16 ? 9 : 8}, MR, MR + 1, 2 * MR + 3, split_last,
                              split_last + 1})
                for (auto [n, k] : shapes)
                    for (auto [ta, tb] : {std::pair{'N', 'N'}, {'N', 'T'}, {'T', 'N'}, {'T', 'T'}}) {
                        // The wide, deep shape for a strip's rows and the last rows split only.
                        if (n == 1000 && m > MR && m != split_last) continue;
                        GemmCase g;
                        g.ta = ta; g.tb = tb; g.m = m; g.n = n; g.k = k;
                        g.alpha = n == 1000 ? 1.0f : 0.5f;
                        g.beta = n == 1000 ? 0.0f : 1.0f;
                        g.pad_a = 1; g.pad_b = 3; g.pad_c = 2;
                        g.seed = static_cast<uint32_t>(m * 131 + n + k);
                        // The values on one thread; on 2 and 3 threads its bits (and C's padding untouched).
                        const auto c1 = check_gemm(r1, g), c2 = check_gemm(r2, g, false), c3 = check_gemm(r3, g, false);
                        CHECK_MESSAGE(differing(c1, c2, m, n, n + 2) == 0, describe(g), " small=", small, " 2 threads");
                        CHECK_MESSAGE(differing(c1, c3, m, n, n + 2) == 0, describe(g), " small=", small, " 3 threads");
                        if (ta != 'N') continue;
                        // Packed B, through the public call and the layer's (with a column offset, a
                        // bias and an activation).
                        const int64_t ldb = tb == 'N' ? n + 3 : k + 3, ldc = n + 2;
                        const auto a = test::random_floats(static_cast<size_t>(m * (k + 1)), g.seed);
                        const auto b = test::random_floats(static_cast<size_t>((tb == 'N' ? k : n) * ldb), g.seed + 7);
                        const auto bias = test::random_floats(static_cast<size_t>(n), g.seed + 11);
                        const gemm::Epilogue act = tb == 'N' ? gemm::Epilogue::gelu : gemm::Epilogue::relu;
                        std::vector<float> parts[3];
                        std::vector<float> out[3];
                        Runtime *rts[3] = {&r1, &r2, &r3};
                        for (int r = 0; r < 3; ++r) {
                            const SgemmPackedB pb(*rts[r], static_cast<Trans>(tb), k, n, b.data(), ldb);
                            out[r].assign(static_cast<size_t>(m * ldc), 0.0f);
                            sgemm(*rts[r], Trans::N, m, 1.0f, a.data(), k + 1, pb, 0.0f, out[r].data(), ldc);
                            const int64_t j0 = uk->nr, cols = n - j0;
                            std::vector<float> part(static_cast<size_t>(m * ldc), 0.0f);
                            gemm::sgemm_prepacked(rts[r]->state(), m, cols, a.data(), k + 1, pb.packed(), j0, nullptr,
                                                  part.data(), ldc);
                            // Columns [j0, n) of the whole product, moved to the left as the offset call writes them.
                            std::vector<float> shifted(static_cast<size_t>(m * ldc), 0.0f);
                            for (int64_t i = 0; i < m; ++i)
                                std::copy_n(out[r].begin() + i * ldc + j0, cols, shifted.begin() + i * ldc);
                            CHECK_MESSAGE(differing(shifted, part, m, cols, ldc) == 0, describe(g), " packed, from column ", j0,
                                          ", ", r + 1, " threads");
                            // The whole width again with the bias and the activation, against the
                            // product plus bias, activated in double on one thread's output below.
                            parts[r].assign(static_cast<size_t>(m * ldc), 0.0f);
                            gemm::sgemm_prepacked(rts[r]->state(), m, n, a.data(), k + 1, pb.packed(), 0, bias.data(),
                                                  parts[r].data(), ldc, act);
                        }
                        CHECK_MESSAGE(differing(parts[0], parts[1], m, n, ldc) == 0, describe(g), " bias and activation, 2 threads");
                        CHECK_MESSAGE(differing(parts[0], parts[2], m, n, ldc) == 0, describe(g), " bias and activation, 3 threads");
                        int64_t off = 0;
                        for (int64_t i = 0; i < m; ++i)
                            for (int64_t j = 0; j < n; ++j) {
                                const double x = static_cast<double>(out[0][static_cast<size_t>(i * ldc + j)]) + bias[static_cast<size_t>(j)];
                                const double want = act == gemm::Epilogue::relu ? std::max(x, 0.0) : 0.5 * x * (1.0 + std::erf(x / std::sqrt(2.0)));
                                off += !(std::fabs(parts[0][static_cast<size_t>(i * ldc + j)] - want) <= 1e-5 * (1.0 + std::fabs(x)));
                            }
                        CHECK_MESSAGE(off == 0, describe(g), " bias and activation against the product: ", off, " elements off");
                        CHECK_MESSAGE(differing(out[0], out[1], m, n, ldc) == 0, describe(g), " packed, 2 threads");
                        CHECK_MESSAGE(differing(out[0], out[2], m, n, ldc) == 0, describe(g), " packed, 3 threads");
                    }
        }
    }
}

// Found in review: with alpha != 1 and beta not 0, a tile cut by the right edge that went through
// a local buffer rounded alpha x sum and beta x C apart (two roundings) where a whole or narrow
// tile's microkernel fuses them (one), so an edge column W wide (n % NR == W) had other bits on the
// chunked path (one thread, B rows 4 KiB apart) than tile by tile (two threads). Every path now
// merges with the microkernel's arithmetic.
TEST_CASE("an edge tile rounds as a whole tile: alpha != 1, beta 0.3 and 1, the same bits on 1, 2 and 3 threads") {
    for (const auto *uk : host_kernels()) {
        const std::string kernel_name = uk->name;
        CAPTURE(kernel_name);
        const int64_t MR = uk->mr, NR = uk->nr, W = uk->lanes;
        // n % NR == W and n % NR == W / 2; B rows 4 KiB apart (chunked on one thread) or not.
        const int64_t n0 = 31 * NR + W;
        for (auto [m, n, k, ldb] : {std::tuple{3 * MR - 2, n0, 300, (n0 + 1023) / 1024 * 1024},
                                    {3 * MR - 2, n0, 300, n0 + 3},
                                    {9 * MR, 7 * NR + W, 200, 7 * NR + W},
                                    {9 * MR, 7 * NR + W / 2, 600, 7 * NR + W / 2}})
            for (float beta : {0.3f, 1.0f}) {
                GemmCase g;
                g.m = m; g.n = n; g.k = k;
                g.pad_b = ldb - n;
                g.alpha = 0.7f;
                g.beta = beta;
                CAPTURE(m); CAPTURE(n); CAPTURE(k); CAPTURE(ldb); CAPTURE(beta);
                auto opts = [&](int threads) {
                    RuntimeOptions o = default_tiles(*uk, threads);
                    o.tiles->parallel_min_flops = 0;  // every call on all its threads
                    return o;
                };
                Runtime r1(opts(1)), r2(opts(2)), r3(opts(3));
                const auto c1 = check_gemm(r1, g), c2 = check_gemm(r2, g, false), c3 = check_gemm(r3, g, false);
                CHECK(test::same_bits(c1, c2));
                CHECK(test::same_bits(c1, c3));
            }
    }
}

TEST_CASE("A stored as is (rows any distance apart) or transposed gives the same bits: read in place or packed first, against B and B^T") {
    // The packed path reads a row-major A in place (the microkernel's strided loads), its rows at
    // any stride (a multiple of 4 KiB too, where a strip's rows share L1 sets), and packs a
    // transposed A (column-major storage) as a whole block first; neither may change one sum.
    // Products large enough for the packed path at the default tiles, and every block edge at
    // small tiles, on 1 and 2 threads.
    // A few rows against B^T (macro_bt_rows) take A^T k x m (m floats a depth step): one row of A
    // along k, or A^T with rows exactly m apart, is read where it lies; any other layout (A^T
    // padded, rows of A) is copied first for the whole depth; the same bits from each.
    for (const auto *uk : host_kernels()) {
        const std::string kernel_name = uk->name;
        CAPTURE(kernel_name);
        for (bool small : {true, false})
            for (int threads : {1, 2}) {
                Runtime rt(small ? small_tiles(*uk, threads) : default_tiles(*uk, threads));
                const int64_t kc = rt.tiles().kc;
                for (auto [m, n, k] : {std::tuple<int64_t, int64_t, int64_t>{4 * uk->mr + 3, 3 * uk->nr + 5, 2 * kc + 7},
                                       {2 * uk->mr - 1, 5 * uk->nr, kc + 1}, {1, 2 * uk->nr + 1, 3 * kc}}) {
                    CAPTURE(m); CAPTURE(n); CAPTURE(k); CAPTURE(threads); CAPTURE(small);
                    const int64_t lda = k + 3, ldat = m + 5, ldb = n + 1, ldc = n + 2;
                    const int64_t lda_4k = (k + 1023) / 1024 * 1024;  // rows a multiple of 4 KiB apart
                    const auto a = test::random_floats(static_cast<size_t>(m * lda), 21);
                    std::vector<float> a_4k(static_cast<size_t>(m * lda_4k), kSentinel);
                    for (int64_t i = 0; i < m; ++i)
                        std::copy_n(a.begin() + i * lda, k, a_4k.begin() + i * lda_4k);
                    std::vector<float> at(static_cast<size_t>(k * ldat), kSentinel);
                    for (int64_t i = 0; i < m; ++i)
                        for (int64_t p = 0; p < k; ++p) at[static_cast<size_t>(p * ldat + i)] = a[static_cast<size_t>(i * lda + p)];
                    const auto b = test::random_floats(static_cast<size_t>(k * ldb), 22);
                    std::vector<float> c(static_cast<size_t>(m * ldc), 0.0f), ct(c.size(), 0.0f), c4k(c.size(), 0.0f);
                    sgemm(rt, Trans::N, Trans::N, m, n, k, 1.0f, a.data(), lda, b.data(), ldb, 0.0f, c.data(), ldc);
                    sgemm(rt, Trans::T, Trans::N, m, n, k, 1.0f, at.data(), ldat, b.data(), ldb, 0.0f, ct.data(), ldc);
                    sgemm(rt, Trans::N, Trans::N, m, n, k, 1.0f, a_4k.data(), lda_4k, b.data(), ldb, 0.0f, c4k.data(), ldc);
                    CHECK(test::same_bits(c, ct));
                    CHECK(test::same_bits(c, c4k));
                    std::vector<double> want, mag;
                    ref::sgemm('N', 'N', m, n, k, 1.0f, a.data(), lda, b.data(), ldb, 0.0f, c.data(), ldc, want, mag);
                    int64_t bad = 0;
                    for (int64_t i = 0; i < m; ++i)
                        for (int64_t j = 0; j < n; ++j) {
                            const size_t r = static_cast<size_t>(i * n + j);
                            const double tol = 2.0 * std::numeric_limits<float>::epsilon() * static_cast<double>(k + 2) * mag[r];
                            bad += !(std::fabs(c[static_cast<size_t>(i * ldc + j)] - want[r]) <= tol);
                        }
                    CHECK(bad == 0);
                }
                for (int64_t m = 1; m <= gemm::kBtRowsMax + 1; ++m)
                    for (int64_t n : {int64_t{1}, int64_t{17}, int64_t{100}})
                        for (int64_t k : {int64_t{1}, int64_t{17}, int64_t{327}}) {
                            CAPTURE(m); CAPTURE(n); CAPTURE(k); CAPTURE(small); CAPTURE(threads);
                            const int64_t lda = k + 1, ldb = k + 3;
                            const auto a = test::random_floats(static_cast<size_t>(m * lda), static_cast<uint32_t>(m * 131 + k));
                            const auto b = test::random_floats(static_cast<size_t>(n * ldb), static_cast<uint32_t>(n + 7));
                            auto run = [&](char ta, const float *ap, int64_t ld) {
                                std::vector<float> c(static_cast<size_t>(m * n), kSentinel);
                                sgemm(rt, static_cast<Trans>(ta), Trans::T, m, n, k, 1.0f, ap, ld, b.data(), ldb, 0.0f,
                                      c.data(), n);
                                return c;
                            };
                            const auto c_rows = run('N', a.data(), lda);
                            for (int64_t pad : {0, 2}) {  // A^T's rows m apart (read in place), then m + 2
                                const int64_t ldt = m + pad;
                                std::vector<float> at(static_cast<size_t>(k * ldt), kSentinel);
                                for (int64_t i = 0; i < m; ++i)
                                    for (int64_t p = 0; p < k; ++p) at[p * ldt + i] = a[i * lda + p];
                                CHECK_MESSAGE(differing(run('T', at.data(), ldt), c_rows, m, n, n) == 0, "A^T pad ", pad);
                            }
                        }
            }
    }
}

TEST_CASE("few rows against B^T (macro_bt_rows, C^T = B^T A^T): every row count up to the lanes, past them to NR and two full panels, beta 0 and 1, edges, depth blocks") {
    // Up to the kernel's NR rows with alpha = 1 and beta 0 or 1 take B^T in place: macro_bt_rows to
    // 9 rows on AVX-512 (all 8 on AVX2), macro_bt from 10 to the lanes, macro_bt_wide past them
    // (A^T one NR-wide panel), and NR + lanes or 2 NR rows as two full panels; alpha 2 and beta 0.5
    // keep to the other paths, and so do NR + 1, NR + lanes + 1 and 2 NR - 1 rows, and, past the
    // rows path, a B^T of at most 64 x 64 (see sgemm_bt): there the depth of 327 takes the wider
    // columns through macro_bt and both panels of macro_bt_wide. Every element's bits against the
    // packed path's.
    // Columns around MR and the lanes, depths around the transposed block (16 or 8) and across KC
    // (16 in the small tiles), a padded B^T and C, NaN in C under beta = 0. (test "a row of C has
    // the same bits whatever m is" holds these paths to the others' bits.)
    for (const auto *uk : host_kernels()) {
        const std::string kernel_name = uk->name;
        CAPTURE(kernel_name);
        const int64_t MR = uk->mr, lanes = uk->lanes, NR = uk->nr;
        std::vector<int64_t> rows;
        for (int64_t m = 1; m <= 16; ++m) rows.push_back(m);
        for (int64_t m : {lanes + 1, lanes + 5, NR - 1, NR, NR + 1, NR + lanes, NR + lanes + 1, 2 * NR - 1, 2 * NR})
            if (m > 16 && std::find(rows.begin(), rows.end(), m) == rows.end()) rows.push_back(m);
        for (bool small : {true, false}) {
            Runtime rt(small ? small_tiles(*uk) : default_tiles(*uk));
            for (int64_t m : rows)
                for (int64_t n : {int64_t{1}, MR - 1, MR, MR + 1, lanes, lanes + 1, 2 * MR + 3, int64_t{100}})
                    for (int64_t k : {1, 7, 8, 17, 40, 327})
                        for (auto [alpha, beta] : {std::pair{1.0f, 0.0f}, {1.0f, 1.0f}, {2.0f, 0.0f}, {1.0f, 0.5f}}) {
                            GemmCase g;
                            g.tb = 'T';
                            g.m = m; g.n = n; g.k = k;
                            g.alpha = alpha; g.beta = beta;
                            g.pad_b = 3; g.pad_c = 2;
                            g.nan_in_c = beta == 0.0f;
                            g.seed = static_cast<uint32_t>(m * 7919 + n * 31 + k);
                            const auto c = check_gemm(rt, g);
                            if (alpha != 1.0f || beta != 0.0f) continue;
                            // The bits of the packed path (through prepacked weights).
                            const int64_t ldb = k + 3, ldc = n + 2;
                            const auto a = test::random_floats(static_cast<size_t>(m * k + 1), g.seed);
                            const auto b = test::random_floats(static_cast<size_t>(n * ldb + 1), g.seed + 7);
                            const gemm::PackedB pb = gemm::pack_b(rt.state(), k, n, b.data(), 1, ldb);
                            std::vector<float> c_pre(static_cast<size_t>(m * ldc));
                            gemm::sgemm_prepacked(rt.state(), m, n, a.data(), k, pb, 0, nullptr, c_pre.data(), ldc);
                            CHECK_MESSAGE(differing(c, c_pre, m, n, ldc) == 0, "m=", m, " n=", n, " k=", k, " small=", small);
                        }
        }
    }
}

TEST_CASE("a row of C has the same bits whatever m is: the strips it falls in, on both paths and prepacked") {
    // The row strips change with m (16 rows of a 14-row kernel run as 8 + 8, 15 as 8 + 7; see
    // gemm::strip_start), and a strip of the small-problem path reads B in place or packed by m; a
    // row's sums must not follow. Every m from 1 to 4 MR + 3 against the full product's rows.
    for (const auto *uk : host_kernels()) {
        const std::string kernel_name = uk->name;
        CAPTURE(kernel_name);
        const int64_t MR = uk->mr, NR = uk->nr, m_all = 4 * MR + 3;
        for (bool small : {true, false}) {
            Runtime rt(small ? small_tiles(*uk, 2) : default_tiles(*uk, 2));
            // ('T' at depth 130: a B^T past 64 x 64, which rows past the rows path take through
            // macro_bt and macro_bt_wide; see sgemm_bt.)
            for (auto [tb, n, k] : {std::tuple{'N', 2 * NR + 3, 40}, {'T', 2 * NR + 3, 40}, {'T', 2 * NR + 3, 130},
                                    {'N', NR - 1, 33}}) {
                const int64_t lda = k + 1, ldb = (tb == 'N' ? n : k) + 2, ldc = n + 3;
                const auto a = test::random_floats(static_cast<size_t>(m_all * lda), 11);
                const auto b = test::random_floats(static_cast<size_t>((tb == 'N' ? k : n) * ldb), 12);
                const gemm::PackedB pb = gemm::pack_b(rt.state(), k, n, b.data(), tb == 'N' ? ldb : 1, tb == 'N' ? 1 : ldb);
                std::vector<float> all(static_cast<size_t>(m_all * ldc)), all_pre(all.size());
                sgemm(rt, Trans::N, static_cast<Trans>(tb), m_all, n, k, 1.0f, a.data(), lda, b.data(), ldb, 0.0f,
                      all.data(), ldc);
                gemm::sgemm_prepacked(rt.state(), m_all, n, a.data(), lda, pb, 0, nullptr, all_pre.data(), ldc);
                for (int64_t m = 1; m <= m_all; ++m) {
                    std::vector<float> c(static_cast<size_t>(m * ldc)), c_pre(c.size());
                    sgemm(rt, Trans::N, static_cast<Trans>(tb), m, n, k, 1.0f, a.data(), lda, b.data(), ldb, 0.0f, c.data(),
                          ldc);
                    gemm::sgemm_prepacked(rt.state(), m, n, a.data(), lda, pb, 0, nullptr, c_pre.data(), ldc);
                    const int64_t differ = differing(c, all, m, n, ldc) + differing(c_pre, all_pre, m, n, ldc);
                    CHECK_MESSAGE(differ == 0, "tb=", tb, " n=", n, " k=", k, " m=", m, " small tiles=", small);
                }
            }
        }
    }
}

TEST_CASE("a few strips against B not transposed: B read in place, with the packed path's bits on 1 and 2 threads") {
    // Up to 8 MR rows a one-thread product against B whose rows are not 4 KiB apart reads B where
    // it lies (gemm::in_place_rows), past the small-problem sizes, and on two threads up to 32
    // rows, its strips shared out by columns when they do not divide among the threads; B's
    // rows 4 KiB apart go in chunks of depth up to gemm::chunked_rows (see the next test), and
    // take the packed path past them. The packed path (there, on two
    // threads from 33 rows, and through prepacked weights) must give every element the same bits,
    // and all stay within the reference's bound. k crosses a KC block.
    for (const auto *uk : host_kernels()) {
        const std::string kernel_name = uk->name;
        CAPTURE(kernel_name);
        const RuntimeOptions o = default_tiles(*uk, 1);
        RuntimeOptions o2 = default_tiles(*uk, 2);
        o2.tiles->parallel_min_flops = 0;  // two threads at any size: in place up to 32 rows, cut evenly
        Runtime rt(o), rt2(o2);
        const int64_t MR = uk->mr, NR = uk->nr, k = o.tiles->sup_max_k + 37;
        // A few column panels (two threads cut 3 strips into strip x column-share items), and
        // many (they split the columns alone).
        for (int64_t n : {o.tiles->sup_max_n + NR + 5, std::max(o.tiles->sup_max_n, 9 * NR) + 5}) {
            for (int64_t ldb : {n + 3, int64_t{1024}}) {
                for (int64_t m : {MR + 1, int64_t{16}, int64_t{17}, int64_t{31}, int64_t{32}, int64_t{33}, 2 * MR + 3, 8 * MR - 1,
                                  8 * MR}) {
                    GemmCase g;
                    g.m = m; g.n = n; g.k = k; g.pad_a = 1; g.pad_b = ldb - n; g.pad_c = 2; g.seed = static_cast<uint32_t>(m);
                    const auto c = check_gemm(rt, g), c2 = check_gemm(rt2, g);
                    CHECK(test::same_bits(c, c2));
                    const int64_t lda = k + 1, ldc = n + 2;
                    const auto a = test::random_floats(static_cast<size_t>(m * lda + 1), g.seed);
                    const auto b = test::random_floats(static_cast<size_t>(k * ldb + 1), g.seed + 7);
                    const gemm::PackedB pb = gemm::pack_b(rt.state(), k, n, b.data(), ldb, 1);
                    std::vector<float> c_pre(static_cast<size_t>(m * ldc));
                    gemm::sgemm_prepacked(rt.state(), m, n, a.data(), lda, pb, 0, nullptr, c_pre.data(), ldc);
                    CHECK_MESSAGE(differing(c, c_pre, m, n, ldc) == 0, "m=", m, " n=", n, " k=", k, " ldb=", ldb);
                }
            }
        }
    }
}

// m x n x k against B with rows ldb apart and against the same B at ldb + 5 (another path when
// ldb is a multiple of 1024, the tile-by-tile one at the other stride), for every m in ms and a
// few alpha and beta: every element of C must have the same bits.
void same_bits_at_another_stride(Runtime &rt, const std::vector<int64_t> &ms, int64_t n, int64_t k, int64_t ldb,
                                 uint32_t seed, const std::string &what) {
    const int64_t m_all = *std::max_element(ms.begin(), ms.end()), lda = k + 3, ldc = n + 2, ldb_off = ldb + 5;
    const auto a = test::random_floats(static_cast<size_t>(m_all * lda), seed);
    const auto b = test::random_floats(static_cast<size_t>(k * ldb), seed + 1);
    std::vector<float> b_off(static_cast<size_t>(k * ldb_off));
    for (int64_t p = 0; p < k; ++p) std::copy(b.begin() + p * ldb, b.begin() + p * ldb + n, b_off.begin() + p * ldb_off);
    const auto c0 = test::random_floats(static_cast<size_t>(m_all * ldc), seed + 2);
    for (int64_t m : ms)
        for (auto [alpha, beta] : {std::pair{1.0f, 0.0f}, {1.0f, 1.0f}, {0.5f, -2.0f}}) {
            std::vector<float> c(c0), c_off(c0);
            sgemm(rt, Trans::N, Trans::N, m, n, k, alpha, a.data(), lda, b.data(), ldb, beta, c.data(), ldc);
            sgemm(rt, Trans::N, Trans::N, m, n, k, alpha, a.data(), lda, b_off.data(), ldb_off, beta, c_off.data(), ldc);
            CHECK_MESSAGE(test::same_bits(c, c_off), what, " ldb=", ldb, " n=", n, " k=", k, " m=", m, " alpha=", alpha,
                          " beta=", beta);
        }
}

TEST_CASE("B rows a multiple of 4 KiB apart: a strip of few rows reads B in chunks of depth, with the other paths' bits") {
    // Such a stride sends a strip of at most chain_rows rows through sgemm_sup_chained (its depth a
    // few rows at a time across all its tiles, the sums kept in between); any other stride takes
    // it tile by tile. Both must give every element the same bits, and the reference's values,
    // across depth chunks and blocks (k from 9: one chunk and a row), the packed edge panel, the
    // multi-panel tiles of 1-5 rows, alpha and beta.
    for (const auto *uk : host_kernels()) {
        const std::string kernel_name = uk->name;
        CAPTURE(kernel_name);
        const int64_t NR = uk->nr, m_all = uk->chain_rows + 1;
        for (bool small : {true, false}) {
            Runtime rt(small ? small_tiles(*uk, 2) : default_tiles(*uk, 2));
            for (int64_t ldb : {1024, 2048})
                for (int64_t n : {int64_t{1}, NR - 1, NR + 1, 2 * NR + 3, 4 * NR + 5, int64_t{300}})
                    for (int64_t k : {9, 17, 40, 333}) {
                        std::vector<int64_t> ms(static_cast<size_t>(m_all));
                        std::iota(ms.begin(), ms.end(), int64_t{1});
                        same_bits_at_another_stride(rt, ms, n, k, ldb, 31, small ? "small tiles" : "default tiles");
                        // The values, against the double reference (C's padding untouched).
                        check_gemm(rt, GemmCase{'N', 'N', m_all - 1, n, k, 0.5f, 1.0f, 0, ldb - n, 2, false, 7});
                    }
        }
        // Large enough for two and three threads (each takes a share of the columns over the whole
        // depth, B past L2 and read in chunks, or the chain): the bits of one thread. Up to four
        // strips (the chunks on one thread, the split at the top on more), and past them.
        Runtime rt1(default_tiles(*uk, 1)), rt2(default_tiles(*uk, 2)), rt3(default_tiles(*uk, 3));
        const int64_t n = 2048 - 5, k = 1100, ldb = 2048, MR = uk->mr, m_most = 4 * MR + 1;
        const auto a = test::random_floats(static_cast<size_t>(m_most * k), 41);
        const auto b = test::random_floats(static_cast<size_t>(k * ldb), 42);
        for (int64_t m : {int64_t{1}, int64_t{uk->chain_rows}, 2 * MR + 3, 4 * MR - 1, m_most}) {
            std::vector<float> c1(static_cast<size_t>(m * n)), c2(c1.size()), c3(c1.size());
            sgemm(rt1, Trans::N, Trans::N, m, n, k, 1.0f, a.data(), k, b.data(), ldb, 0.0f, c1.data(), n);
            sgemm(rt2, Trans::N, Trans::N, m, n, k, 1.0f, a.data(), k, b.data(), ldb, 0.0f, c2.data(), n);
            sgemm(rt3, Trans::N, Trans::N, m, n, k, 1.0f, a.data(), k, b.data(), ldb, 0.0f, c3.data(), n);
            CHECK_MESSAGE(test::same_bits(c1, c2), "m=", m, " 2 threads");
            CHECK_MESSAGE(test::same_bits(c1, c3), "m=", m, " 3 threads");
        }
        // The values of the split, against the double reference.
        check_gemm(rt3, GemmCase{'N', 'N', 4 * MR - 1, 1019, 300, 1.0f, 0.0f, 0, 5, 0, false, 43});
    }
}

TEST_CASE("a strip of few rows against a B past L2, at any stride: the chain's bits are the tiles'") {
    // TileConfig::sup_chain_rows sends strips of that many rows against a B of at least 2 KC x NC
    // through sgemm_sup_chained at any stride (on Intel's cores by default), not only at 4 KiB
    // multiples. Every row count up to the kernel's chain rows and one past, odd strides, alpha
    // and beta: the bits of the same runtime with the option off (tile by tile), and the
    // reference's values; with the default tiles and with small ones (depth blocks of 16).
    for (const auto *uk : host_kernels()) {
        const std::string kernel_name = uk->name;
        CAPTURE(kernel_name);
        for (bool small : {false, true}) {
            RuntimeOptions on = small ? small_tiles(*uk) : default_tiles(*uk), off = on;
            on.tiles->sup_chain_rows = uk->chain_rows;
            off.tiles->sup_chain_rows = 0;
            Runtime rt_on(on), rt_off(off);
            const int64_t n = small ? 300 : 1000, block = 2 * on.tiles->kc * on.tiles->nc;
            const int64_t k = small ? 333 : (block + n - 1) / n + 37, ldb = n + 3, lda = k + 1, ldc = n + 2;
            const int64_t m_all = uk->chain_rows + 1;
            const auto a = test::random_floats(static_cast<size_t>(m_all * lda), 51);
            const auto b = test::random_floats(static_cast<size_t>(k * ldb), 52);
            const auto c0 = test::random_floats(static_cast<size_t>(m_all * ldc), 53);
            for (int64_t m = 1; m <= m_all; ++m)
                for (auto [alpha, beta] : {std::pair{1.0f, 0.0f}, {1.0f, 1.0f}, {0.5f, -2.0f}}) {
                    std::vector<float> c_on(c0), c_off(c0);
                    sgemm(rt_on, Trans::N, Trans::N, m, n, k, alpha, a.data(), lda, b.data(), ldb, beta, c_on.data(), ldc);
                    sgemm(rt_off, Trans::N, Trans::N, m, n, k, alpha, a.data(), lda, b.data(), ldb, beta, c_off.data(), ldc);
                    CHECK_MESSAGE(test::same_bits(c_on, c_off), "small=", small, " m=", m, " alpha=", alpha, " beta=", beta);
                }
            check_gemm(rt_on, GemmCase{'N', 'N', uk->chain_rows, n, k, 0.5f, 1.0f, 1, 3, 2, false, 9});
        }
    }
}

TEST_CASE("B rows a multiple of 4 KiB apart: a few strips read B in chunks of depth across the block, with the other paths' bits") {
    // Two to four strips against such B (gemm::chunked_rows) read it in place 32 or 64 rows of depth
    // at a time across the block, every strip per chunk, the first copying the chunk for the others
    // and the sums kept between chunks (sgemm_sup_chunked). The same B at another stride takes the
    // tiles one by one, and the packed path (more rows, or two threads past their limit) has the
    // same bits: every element must match them, and the reference's values, across chunks (k
    // below, at and past the chunk depth, and past a KC block), the packed edge panel, alpha and
    // beta, on one thread and on two. Depths: 31 (not chunked), 33, 64, 65, 97 and 129 (one to
    // five chunks, the last one short), past a KC block. Chunks are 64 rows deep where the block
    // spans all the columns (the narrow widths; 1029 columns at up to 29 rows), 32 elsewhere
    // (1029 columns at 44 and 55 rows).
    for (const auto *uk : host_kernels()) {
        const std::string kernel_name = uk->name;
        CAPTURE(kernel_name);
        const int64_t MR = uk->mr, NR = uk->nr;
        // Chunks for a B larger than the packed block (KC x NC), or one under it whose depth takes
        // one or two chunks: default tiles with 1029 columns, and a block of two panels for the
        // narrower B.
        RuntimeOptions o2 = default_tiles(*uk, 2), o_narrow = default_tiles(*uk, 1);
        o2.tiles->parallel_min_flops = 0;  // two threads at any size
        o_narrow.tiles->nc = 2 * NR;
        Runtime rt1(default_tiles(*uk, 1)), rt2(o2), rt_narrow(o_narrow);
        const int64_t kc = rt1.state().tiles.kc;
        // The narrow NC runs the narrow widths at every depth; the default tiles run 1029 columns
        // (at 97 rows deep under the block, on 14x32: chunks of 64 up to 29 rows on one thread and
        // 15 on two, B packed at 44 and 55).
        for (Runtime *rt : {&rt1, &rt2, &rt_narrow})
            for (int64_t n : {NR + 1, 4 * NR + 5, int64_t{300}, int64_t{1029}})
                for (int64_t k : {int64_t{31}, int64_t{33}, int64_t{64}, int64_t{65}, int64_t{97}, int64_t{129}, kc + 37}) {
                    if (rt == &rt_narrow ? n == 1029 : n != 1029 || k < 97) continue;
                    const int64_t ldb = n > 1024 ? 2048 : 1024;
                    same_bits_at_another_stride(*rt, {MR + 1, 2 * MR, 2 * MR + 1, 3 * MR + 2, 4 * MR - 1}, n, k, ldb, 51,
                                                rt == &rt2 ? "2 threads" : rt == &rt1 ? "1 thread" : "1 thread, NC 2 NR");
                    // The values, against the double reference (C's padding untouched), A as is
                    // and transposed.
                    check_gemm(*rt, GemmCase{'N', 'N', 2 * MR + 1, n, k, 0.5f, 1.0f, 0, ldb - n, 2, false, 9});
                    check_gemm(*rt, GemmCase{'T', 'N', 3 * MR + 2, n, k, 1.0f, 0.0f, 3, ldb - n, 2, false, 10});
                }
        // Four strips or more against such B under the packed block (in L2) that do not go in
        // chunks pack each block of it (sgemm_sup): past chunked_rows, or at depth 20 (under a
        // chunk); on 14x32, one thread, 43 and 55 rows at depths 64 and 97 go in chunks. The bits
        // of the tiles on B in place at the other stride, and the values.
        for (Runtime *rt : {&rt1, &rt2})
            for (int64_t n : {NR + 1, int64_t{300}})
                for (int64_t k : {int64_t{20}, int64_t{64}, int64_t{97}}) {
                    same_bits_at_another_stride(*rt, {3 * MR + 1, 4 * MR - 1, 6 * MR + 3, 8 * MR - 1}, n, k, 1024, 61,
                                                rt == &rt2 ? "packed B, 2 threads" : "packed B, 1 thread");
                    check_gemm(*rt, GemmCase{'N', 'N', 6 * MR + 3, n, k, 0.5f, 1.0f, 0, 1024 - n, 2, false, 11});
                }
    }
}

TEST_CASE("8 host threads share one runtime") {
    Runtime rt(RuntimeOptions{2, {}, {}, {}});
    const int64_t m = 150, n = 170, k = 300;
    auto a = test::random_floats(static_cast<size_t>(m * k), 1), b = test::random_floats(static_cast<size_t>(k * n), 2);
    std::vector<float> want(static_cast<size_t>(m * n));
    sgemm(rt, Trans::N, Trans::N, m, n, k, 1.0f, a.data(), k, b.data(), n, 0.0f, want.data(), n);
    for (const auto &got : test::on_host_threads(want.size(), 10, [&](float *c) {
             sgemm(rt, Trans::N, Trans::N, m, n, k, 1.0f, a.data(), k, b.data(), n, 0.0f, c, n);
         }))
        CHECK(test::same_bits(got, want));
}

TEST_CASE("tile configs that break a kernel constraint are refused, naming the field") {
    const Isa isa = best_isa();
    auto bad = [&](auto mutate, const char *field) {
        TileConfig t = default_tile_config(isa, detect_cache_sizes());
        mutate(t);
        try {
            Runtime rt(RuntimeOptions{1, isa, t, {}});
            FAIL("accepted a config with a bad ", field);
        } catch (const Error &e) {
            CHECK(e.status() == Status::invalid_argument);
            CHECK(std::string(e.what()).find(field) != std::string::npos);
        }
    };
    bad([](TileConfig &t) { t.mc = t.mc + 1; }, "mc");
    bad([](TileConfig &t) { t.kc = 0; }, "kc");
    bad([](TileConfig &t) { t.nc = 3; }, "nc");
    bad([](TileConfig &t) { t.sup_max_n = -1; }, "sup_max_n");
    bad([](TileConfig &t) { t.gemm_ukernel = "avx512_99x99"; }, "gemm_ukernel");
    if (isa == Isa::avx512) bad([](TileConfig &t) { t.gemm_ukernel = "avx2_6x16"; }, "gemm_ukernel");
}
