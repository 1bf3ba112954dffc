// A GEMM operand packed once (SgemmPackedB, mha_sgemm_pack_b) against the double-precision
// reference and against sgemm's bits: every microkernel the host supports, A and B transposed or
// not, the tile edges, odd leading dimensions, alpha and beta, 1 and 2 threads, a row's bits
// whatever m is, runtimes of another kernel or KC, and bad input (nothing written).
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "gemm_test_util.hpp"
#include "mha/error.hpp"
#include "mha/gemm.hpp"
#include "mha/mha.h"
#include "reference.hpp"
#include "test_util.hpp"

using namespace mha;
using mha::test::kSentinel;

namespace {

// One product: A (op(A) m x k) and B (op(B) k x n) stored with padded leading dimensions.
struct Operands {
    char ta, tb;
    int64_t m, n, k, lda, ldb, ldc;
    std::vector<float> a, b;
    Operands(char ta_, char tb_, int64_t m_, int64_t n_, int64_t k_, uint32_t seed)
        : ta(ta_), tb(tb_), m(m_), n(n_), k(k_) {
        const int64_t a_rows = ta == 'N' ? m : k, a_cols = ta == 'N' ? k : m;
        const int64_t b_rows = tb == 'N' ? k : n, b_cols = tb == 'N' ? n : k;
        lda = a_cols + 3;  // odd
        ldb = b_cols + 5;
        ldc = n + 2;
        a = test::random_floats(static_cast<size_t>(a_rows * lda), seed);
        b = test::random_floats(static_cast<size_t>(b_rows * ldb), seed + 1);
    }
    // C's start: NaN in the window (beta = 0 must overwrite it), kSentinel in the padding.
    std::vector<float> c_start(bool nan) const {
        std::vector<float> c(static_cast<size_t>(m * ldc + 1), kSentinel);
        for (int64_t i = 0; i < m; ++i)
            for (int64_t j = 0; j < n; ++j)
                c[static_cast<size_t>(i * ldc + j)] = nan ? std::numeric_limits<float>::quiet_NaN()
                                                          : 0.25f * static_cast<float>((i * 7 + j * 3) % 11) - 1.0f;
        return c;
    }
};

// How many elements of C's window are off the reference's bound, plus any padding written.
int64_t off_reference(const Operands &o, float alpha, float beta, const std::vector<float> &c0,
                      const std::vector<float> &c) {
    std::vector<double> want, mag;
    std::vector<float> start = c0;
    ref::sgemm(o.ta, o.tb, o.m, o.n, o.k, alpha, o.a.data(), o.lda, o.b.data(), o.ldb, beta, start.data(), o.ldc, want,
               mag);
    int64_t bad = 0;
    for (int64_t i = 0; i < o.m; ++i)
        for (int64_t j = 0; j < o.ldc; ++j) {
            const float got = c[static_cast<size_t>(i * o.ldc + j)];
            if (j >= o.n) {
                bad += got != kSentinel;
                continue;
            }
            const size_t r = static_cast<size_t>(i * o.n + j);
            const double tol = 2.0 * std::numeric_limits<float>::epsilon() * static_cast<double>(o.k + 2) * mag[r] + 1e-30;
            bad += !(std::fabs(got - want[r]) <= tol);
        }
    return bad + (c.back() != kSentinel);
}

} // namespace

TEST_CASE("B packed once: every kernel, both transposes, edge tiles, odd lds, alpha and beta; the reference and sgemm's bits, on 1 and 2 threads") {
    for (const auto *uk : test::host_kernels()) {
        const std::string kernel_name = uk->name;
        CAPTURE(kernel_name);
        for (bool small : {true, false}) {
            Runtime r1(small ? test::small_tiles(*uk, 1) : test::default_tiles(*uk, 1));
            Runtime r2(small ? test::small_tiles(*uk, 2) : test::default_tiles(*uk, 2));
            const int64_t MR = uk->mr, NR = uk->nr, KC = r1.tiles().kc;
            for (char ta : {'N', 'T'})
                for (char tb : {'N', 'T'})
                    for (int64_t m : {int64_t{1}, MR - 1, MR + 1, 3 * MR + 2})
                        for (int64_t n : {int64_t{1}, NR + 1, 2 * NR + 3})
                            for (int64_t k : {int64_t{1}, KC, KC + 1, 2 * KC + 3}) {
                                CAPTURE(ta); CAPTURE(tb); CAPTURE(m); CAPTURE(n); CAPTURE(k); CAPTURE(small);
                                const Operands o(ta, tb, m, n, k, static_cast<uint32_t>(m * 131 + n * 7 + k));
                                const SgemmPackedB pb(r1, static_cast<Trans>(tb), k, n, o.b.data(), o.ldb);
                                REQUIRE(pb.k() == k);
                                REQUIRE(pb.n() == n);
                                for (auto [alpha, beta] : {std::pair{1.0f, 0.0f}, {0.5f, 2.0f}, {1.0f, 1.0f}}) {
                                    CAPTURE(alpha); CAPTURE(beta);
                                    const auto c0 = o.c_start(beta == 0.0f);
                                    auto c = c0, c2 = c0, want_bits = c0;
                                    sgemm(r1, static_cast<Trans>(ta), m, alpha, o.a.data(), o.lda, pb, beta, c.data(), o.ldc);
                                    CHECK(off_reference(o, alpha, beta, c0, c) == 0);
                                    sgemm(r1, static_cast<Trans>(ta), static_cast<Trans>(tb), m, n, k, alpha, o.a.data(),
                                          o.lda, o.b.data(), o.ldb, beta, want_bits.data(), o.ldc);
                                    CHECK(test::same_bits(c, want_bits));
                                    // The same packed B on a runtime of the same kernel and tiles, 2 threads.
                                    sgemm(r2, static_cast<Trans>(ta), m, alpha, o.a.data(), o.lda, pb, beta, c2.data(), o.ldc);
                                    CHECK(test::same_bits(c, c2));
                                }
                            }
        }
    }
}

TEST_CASE("B packed once: a row of C has the same bits whatever m is") {
    for (const auto *uk : test::host_kernels()) {
        const std::string kernel_name = uk->name;
        CAPTURE(kernel_name);
        Runtime rt(test::small_tiles(*uk, 2));
        const int64_t m = 3 * uk->mr + 5, n = 2 * uk->nr + 7, k = 3 * rt.tiles().kc + 1;
        const Operands o('N', 'T', m, n, k, 91);
        const SgemmPackedB pb(rt, Trans::T, k, n, o.b.data(), o.ldb);
        auto all = o.c_start(true);
        sgemm(rt, Trans::N, m, 1.0f, o.a.data(), o.lda, pb, 0.0f, all.data(), o.ldc);
        for (int64_t i0 : {int64_t{0}, int64_t{1}, int64_t{uk->mr} - 1, m - 3})
            for (int64_t rows : {int64_t{1}, int64_t{2}, int64_t{3}}) {
                CAPTURE(i0); CAPTURE(rows);
                std::vector<float> part(static_cast<size_t>(rows * o.ldc), kSentinel);
                sgemm(rt, Trans::N, rows, 1.0f, o.a.data() + i0 * o.lda, o.lda, pb, 0.0f, part.data(), o.ldc);
                CHECK(std::memcmp(part.data(), all.data() + i0 * o.ldc, static_cast<size_t>(rows * o.ldc - 2) * sizeof(float)) == 0);
            }
    }
}

TEST_CASE("B packed once: 8 host threads share one runtime and one packed B") {
    Runtime rt(RuntimeOptions{2, {}, {}, {}});
    const int64_t m = 150, n = 170, k = 700;
    const auto a = test::random_floats(static_cast<size_t>(m * k), 1), b = test::random_floats(static_cast<size_t>(k * n), 2);
    const SgemmPackedB pb(rt, Trans::N, k, n, b.data(), n);
    std::vector<float> want(static_cast<size_t>(m * n));
    sgemm(rt, Trans::N, Trans::N, m, n, k, 1.0f, a.data(), k, b.data(), n, 0.0f, want.data(), n);
    for (const auto &got : test::on_host_threads(want.size(), 5, [&](float *c) {
             sgemm(rt, Trans::N, m, 1.0f, a.data(), k, pb, 0.0f, c, n);
         }))
        CHECK(test::same_bits(got, want));
}

TEST_CASE("B packed once: empty sizes, k = 0 (C = beta C) and alpha = 0 (A unread)") {
    Runtime rt(RuntimeOptions{1, {}, {}, {}});
    const auto b = test::random_floats(64, 1);
    const SgemmPackedB k0(rt, Trans::N, 0, 5, nullptr, 5), n0(rt, Trans::N, 4, 0, nullptr, 1);
    CHECK(k0.k() == 0);
    CHECK(n0.n() == 0);
    std::vector<float> c(3 * 5, 2.0f);
    const auto a = test::random_floats(3 * 4, 2);
    sgemm(rt, Trans::N, 3, 1.0f, a.data(), 1, k0, 0.5f, c.data(), 5);
    for (float x : c) CHECK(x == 1.0f);
    sgemm(rt, Trans::N, 3, 1.0f, a.data(), 4, n0, 0.5f, c.data(), 1);  // nothing to compute
    for (float x : c) CHECK(x == 1.0f);
    const SgemmPackedB pb(rt, Trans::N, 4, 5, b.data(), 5);
    sgemm(rt, Trans::N, 3, 0.0f, a.data(), 4, pb, 0.0f, c.data(), 5);
    for (float x : c) CHECK(x == 0.0f);
    sgemm(rt, Trans::N, 0, 1.0f, nullptr, 4, pb, 0.0f, nullptr, 5);  // m = 0: a valid empty call
    SgemmPackedB moved(rt, Trans::N, 4, 5, b.data(), 5);
    const SgemmPackedB taken(std::move(moved));
    CHECK(taken.n() == 5);
    CHECK_THROWS_WITH_AS(sgemm(rt, Trans::N, 3, 1.0f, a.data(), 4, moved, 0.0f, c.data(), 5),  // NOLINT(bugprone-use-after-move)
                         doctest::Contains("moved from"), Error);
    CHECK_THROWS_AS((void)moved.k(), Error);  // NOLINT(bugprone-use-after-move)
    for (float x : c) CHECK(x == 0.0f);
}

TEST_CASE("B packed once is refused by a runtime with another kernel or KC, and bad input writes nothing") {
    const auto kernels = test::host_kernels();
    const auto *uk = kernels.front();
    Runtime small(test::small_tiles(*uk)), normal(test::default_tiles(*uk));
    const auto b = test::random_floats(40 * 64, 1), a = test::random_floats(4 * 40, 2);
    const SgemmPackedB pb(small, Trans::N, 40, 64, b.data(), 64);
    std::vector<float> c(4 * 64, kSentinel);
    CHECK_THROWS_WITH_AS(sgemm(normal, Trans::N, 4, 1.0f, a.data(), 40, pb, 0.0f, c.data(), 64),
                         doctest::Contains("packed for microkernel"), Error);
    for (const auto *other : kernels)
        if (other->name != uk->name) {
            Runtime rt(test::default_tiles(*other));
            CHECK_THROWS_WITH_AS(sgemm(rt, Trans::N, 4, 1.0f, a.data(), 40, pb, 0.0f, c.data(), 64),
                                 doctest::Contains(uk->name), Error);
        }
    auto pack_error = [&](Trans tb, int64_t k, int64_t n, const float *src, int64_t ldb) {
        try {
            SgemmPackedB p(small, tb, k, n, src, ldb);
        } catch (const Error &e) {
            CHECK(e.status() == Status::invalid_argument);
            return std::string(e.what());
        }
        return std::string("no error");
    };
    CHECK(pack_error(static_cast<Trans>('X'), 40, 64, b.data(), 64).find("transb") != std::string::npos);
    CHECK(pack_error(Trans::N, -1, 64, b.data(), 64).find("k = -1") != std::string::npos);
    CHECK(pack_error(Trans::N, 40, -2, b.data(), 64).find("n = -2") != std::string::npos);
    CHECK(pack_error(Trans::N, 40, 64, b.data(), 63).find("ldb") != std::string::npos);
    CHECK(pack_error(Trans::T, 40, 64, b.data(), 39).find("ldb") != std::string::npos);
    CHECK(pack_error(Trans::N, 40, 64, nullptr, 64).find("NULL") != std::string::npos);
    CHECK(pack_error(Trans::N, INT64_MAX / 2, 64, b.data(), 64).find("overflow") != std::string::npos);
    CHECK(pack_error(Trans::T, 3, INT64_MAX - 1, b.data(), 3).find("overflow") != std::string::npos);
    auto call_error = [&](Trans ta, int64_t m, const float *src, int64_t lda, float *dst, int64_t ldc) {
        try {
            sgemm(small, ta, m, 1.0f, src, lda, pb, 0.0f, dst, ldc);
        } catch (const Error &e) {
            CHECK(e.status() == Status::invalid_argument);
            return std::string(e.what());
        }
        return std::string("no error");
    };
    CHECK(call_error(static_cast<Trans>('x'), 4, a.data(), 40, c.data(), 64).find("transa") != std::string::npos);
    CHECK(call_error(Trans::N, -4, a.data(), 40, c.data(), 64).find("m = -4") != std::string::npos);
    CHECK(call_error(Trans::N, 4, nullptr, 40, c.data(), 64).find("NULL") != std::string::npos);
    CHECK(call_error(Trans::N, 4, a.data(), 39, c.data(), 64).find("lda") != std::string::npos);
    CHECK(call_error(Trans::T, 4, a.data(), 3, c.data(), 64).find("lda") != std::string::npos);
    CHECK(call_error(Trans::N, 4, a.data(), 40, nullptr, 64).find("NULL") != std::string::npos);
    CHECK(call_error(Trans::N, 4, a.data(), 40, c.data(), 63).find("ldc") != std::string::npos);
    CHECK(call_error(Trans::N, INT64_MAX / 8, a.data(), 40, c.data(), 64).find("overflow") != std::string::npos);
    for (float x : c) REQUIRE(x == kSentinel);
}

TEST_CASE("the C ABI: mha_sgemm_pack_b and mha_sgemm_packed_b give mha_sgemm's bits; bad input gets a status, a message and no write") {
    mha_runtime *rt = nullptr;
    REQUIRE(mha_runtime_create(2, &rt) == MHA_OK);
    const int64_t m = 37, n = 70, k = 600;
    const auto a = test::random_floats(static_cast<size_t>(m * (k + 1)), 3);
    const auto w = test::random_floats(static_cast<size_t>(n * k), 4);  // B^T, as nn.Linear stores a weight
    mha_packed_b *pb = nullptr;
    REQUIRE(mha_sgemm_pack_b(rt, 'T', k, n, w.data(), k, &pb) == MHA_OK);
    REQUIRE(pb != nullptr);
    uint64_t bytes = 0;
    CHECK(mha_packed_b_bytes(pb, &bytes) == MHA_OK);
    CHECK(bytes >= static_cast<uint64_t>(k * n) * sizeof(float));
    std::vector<float> c(static_cast<size_t>(m * n), kSentinel), want(c.size(), kSentinel);
    CHECK(mha_sgemm_packed_b(rt, 'N', m, 1.0f, a.data(), k + 1, pb, 0.0f, c.data(), n) == MHA_OK);
    CHECK(mha_sgemm(rt, 'N', 'T', m, n, k, 1.0f, a.data(), k + 1, w.data(), k, 0.0f, want.data(), n) == MHA_OK);
    CHECK(test::same_bits(c, want));

    std::vector<float> untouched(c.size(), kSentinel);
    mha_packed_b *bad = pb;
    CHECK(mha_sgemm_pack_b(rt, 'Q', k, n, w.data(), k, &bad) == MHA_INVALID_ARGUMENT);
    CHECK(bad == nullptr);
    CHECK(std::string(mha_last_error()).find("transb") != std::string::npos);
    CHECK(mha_sgemm_pack_b(nullptr, 'T', k, n, w.data(), k, &bad) == MHA_INVALID_ARGUMENT);
    CHECK(mha_sgemm_pack_b(rt, 'T', k, n, w.data(), k, nullptr) == MHA_INVALID_ARGUMENT);
    CHECK(mha_sgemm_pack_b(rt, 'T', k, n, nullptr, k, &bad) == MHA_INVALID_ARGUMENT);
    CHECK(mha_packed_b_bytes(nullptr, &bytes) == MHA_INVALID_ARGUMENT);
    CHECK(mha_packed_b_bytes(pb, nullptr) == MHA_INVALID_ARGUMENT);
    CHECK(mha_sgemm_packed_b(rt, 'N', m, 1.0f, a.data(), k + 1, nullptr, 0.0f, untouched.data(), n) == MHA_INVALID_ARGUMENT);
    CHECK(std::string(mha_last_error()).find("b is NULL") != std::string::npos);
    CHECK(mha_sgemm_packed_b(nullptr, 'N', m, 1.0f, a.data(), k + 1, pb, 0.0f, untouched.data(), n) == MHA_INVALID_ARGUMENT);
    CHECK(mha_sgemm_packed_b(rt, 'N', m, 1.0f, a.data(), k - 1, pb, 0.0f, untouched.data(), n) == MHA_INVALID_ARGUMENT);
    CHECK(std::string(mha_last_error()).find("lda") != std::string::npos);
    CHECK(mha_sgemm_packed_b(rt, 'N', m, 1.0f, a.data(), k + 1, pb, 0.0f, untouched.data(), n - 1) == MHA_INVALID_ARGUMENT);
    CHECK(mha_sgemm_packed_b(rt, 'N', -1, 1.0f, a.data(), k + 1, pb, 0.0f, untouched.data(), n) == MHA_INVALID_ARGUMENT);
    for (float x : untouched) REQUIRE(x == kSentinel);
    mha_packed_b_destroy(pb);
    mha_packed_b_destroy(nullptr);
    mha_runtime_destroy(rt);
}
