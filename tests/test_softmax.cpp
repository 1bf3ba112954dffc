// The vector exp, the row softmax and the online softmax against double precision, on every ISA
// the host supports: tails, -inf patterns, NaN rows, huge logits, in-place use, padding, threads
// and bad input.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>

#include "mha/mha.h"
#include "mha/softmax.hpp"
#include "reference.hpp"
#include "runtime/runtime_state.hpp"
#include "test_util.hpp"

using namespace mha;
using mha::test::kSentinel;

namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

// The tolerance: 2e-6 relative to double, plus what no float32 softmax can avoid: x - max rounded
// to float is off by up to half an ulp of |x - max|, which scales exp(x - max) by up to
// |x - max| * 2^-24 relative (that matters for tiny probabilities, where |x - max| is large), and
// an absolute floor for probabilities that underflow float.
bool close(double got, double want, double gap) {
    return std::fabs(got - want) <= (2e-6 + gap * 0x1p-24) * std::fabs(want) + 1e-37;
}

// Checks rows x cols of y (ld ldy) against the double softmax of x; returns the number of misses.
int check_rows(const float *x, int64_t ldx, const float *y, int64_t ldy, int64_t rows, int64_t cols,
               const std::string &what) {
    int bad = 0;
    for (int64_t r = 0; r < rows; ++r) {
        const auto want = ref::softmax_row(x + r * ldx, cols);
        float mx = -kInf;
        for (int64_t c = 0; c < cols; ++c) mx = std::max(mx, x[r * ldx + c]);
        for (int64_t c = 0; c < cols; ++c) {
            const float got = y[r * ldy + c];
            double gap = std::fabs(static_cast<double>(x[r * ldx + c]) - mx);
            if (!std::isfinite(gap)) gap = 0;  // -inf entries: want exactly 0
            if (!close(got, want[static_cast<size_t>(c)], gap) && bad++ < 3)
                FAIL_CHECK(what << " row " << r << " col " << c << ": got " << got << " want " << want[static_cast<size_t>(c)]);
        }
    }
    return bad;
}

std::vector<Isa> isas() { return supported_isas(); }

} // namespace

namespace {

using ExpFn = void (*)(int64_t n, const float *x, float *y);

// One of the vector exps (e^x, or 2^x with base2) on `x` (its domain's points, then its
// specials): relative error under 5e-7 (about 4 ulp: the one-constant range reduction of e^x costs
// up to 127 * 1.9e-9), exactly 0 below the cutoff (FLT_MIN: e^-87.3365, 2^-126) and for -inf, NaN
// stays NaN, e^+-0 = 2^+-0 = 1, and a tail shorter than a vector neither read nor written past its
// end.
void check_exp(ExpFn exp, std::vector<float> x, bool base2 = false) {
    auto want = [&](float v) { return base2 ? std::exp2(static_cast<double>(v)) : std::exp(static_cast<double>(v)); };
    std::vector<float> y(x.size());
    exp(static_cast<int64_t>(x.size()), x.data(), y.data());
    double worst = 0;
    for (size_t i = 0; i < x.size(); ++i) worst = std::max(worst, std::fabs(y[i] / want(x[i]) - 1));
    CHECK(worst < 5e-7);
    const float special[] = {-kInf, -1e30f, -200.0f, base2 ? -126.01f : -87.4f, kNaN, 0.0f, -0.0f};
    float out[7];
    exp(7, special, out);
    for (int i = 0; i < 4; ++i) CHECK(out[i] == 0.0f);
    CHECK(std::isnan(out[4]));
    CHECK(out[5] == 1.0f);
    CHECK(out[6] == 1.0f);
    float tail_in[3] = {-1.0f, -2.5f, -3.0f}, tail_out[4] = {kSentinel, kSentinel, kSentinel, kSentinel};
    exp(3, tail_in, tail_out);
    for (int i = 0; i < 3; ++i) CHECK(std::fabs(tail_out[i] / want(tail_in[i]) - 1) < 5e-7);
    CHECK(tail_out[3] == kSentinel);
}

} // namespace

TEST_CASE("vector exps: the general one over the float range, tanh's (x <= 0) and softmax's 2^x down to the cutoff") {
    for (Isa isa : isas()) {
        CAPTURE(std::string(isa_name(isa)));
        Runtime rt(RuntimeOptions{1, isa, {}, {}});
        std::vector<float> x;
        for (double v = -87.3; v <= 88.0; v += 0.0137) x.push_back(static_cast<float>(v));
        for (float v : {0.0f, -0.0f, 1e-8f, -1e-8f, 0.34657359f, -0.34657359f, 1.0f, -1.0f}) x.push_back(v);
        check_exp(rt.state().softmax_kernels->exp, x);
        std::vector<float> nonpositive;
        for (double v = -87.33; v <= 0.0; v += 0.00731) nonpositive.push_back(static_cast<float>(v));
        // the cutoff and its neighbours, the rounding's half-way points
        for (float v : {-87.33654f, -87.3365f, -0.0f, 0.0f, -1e-30f, -1e-8f, -0.34657359f, -0.34657362f, -1.0397208f,
                        -86.9900f, -43.6682f})
            nonpositive.push_back(v);
        check_exp(rt.state().softmax_kernels->exp_nonpositive, nonpositive);
        // AVX-512's softmax's 2^x: down to its cutoff, the floors at and between the integers
        if (!rt.state().softmax_kernels->exp2_nonpositive) continue;
        std::vector<float> base2;
        for (double v = -126.0; v <= 0.0; v += 0.00931) base2.push_back(static_cast<float>(v));
        for (float v : {-126.0f, -125.99999f, -125.5f, -125.49999f, -0.0f, 0.0f, -1e-30f, -1e-8f, -0.5f, -0.49999997f,
                        -0.50000006f, -1.0f, -0.99999994f, -1.5f, -2.0f, -63.5f, -64.0f})
            base2.push_back(v);
        check_exp(rt.state().softmax_kernels->exp2_nonpositive, base2, true);
    }
}

TEST_CASE("softmax against double: tails, spreads up to 1e3, padding never written") {
    std::vector<int64_t> widths;
    for (int64_t c = 1; c <= 33; ++c) widths.push_back(c);
    for (int64_t c : {63, 64, 65, 127, 128, 129, 1000, 4097}) widths.push_back(c);
    for (Isa isa : isas()) {
        CAPTURE(std::string(isa_name(isa)));
        Runtime rt(RuntimeOptions{1, isa, {}, {}});
        for (int64_t cols : widths)
            for (float spread : {1.0f, 30.0f, 1000.0f}) {
                const int64_t rows = 3, ld = cols + 5;
                auto x = test::random_floats(static_cast<size_t>(rows * ld), static_cast<uint32_t>(cols), -spread, spread);
                std::vector<float> y(static_cast<size_t>(rows * ld), kSentinel);
                softmax(rt, rows, cols, x.data(), ld, y.data(), ld);
                const std::string what = "cols=" + std::to_string(cols) + " spread=" + std::to_string(spread);
                CHECK_MESSAGE(check_rows(x.data(), ld, y.data(), ld, rows, cols, what) == 0, what);
                for (int64_t r = 0; r < rows; ++r)
                    for (int64_t c = cols; c < ld; ++c) CHECK(y[static_cast<size_t>(r * ld + c)] == kSentinel);
            }
    }
}

TEST_CASE("rows exactly as long as their buffers: tails never read past the row (ASan checks)") {
    for (Isa isa : isas()) {
        Runtime rt(RuntimeOptions{1, isa, {}, {}});
        for (int64_t cols : {1, 7, 15, 17, 31, 33}) {
            auto x = test::random_floats(static_cast<size_t>(cols), 9);
            std::vector<float> y(static_cast<size_t>(cols));
            softmax(rt, 1, cols, x.data(), cols, y.data(), cols);
            CHECK(check_rows(x.data(), cols, y.data(), cols, 1, cols, "exact") == 0);
        }
    }
}

TEST_CASE("-inf entries, all -inf rows, NaN rows, +inf, and logits of +-3e38") {
    for (Isa isa : isas()) {
        CAPTURE(std::string(isa_name(isa)));
        Runtime rt(RuntimeOptions{1, isa, {}, {}});
        const int64_t cols = 37, rows = 7;
        auto x = test::random_floats(static_cast<size_t>(rows * cols), 4, -5.0f, 5.0f);
        auto row = [&](int64_t r) { return x.data() + r * cols; };
        for (int64_t c = 0; c < cols; c += 3) row(0)[c] = -kInf;             // -inf pattern
        for (int64_t c = 0; c < cols; ++c) row(1)[c] = -kInf;                 // all -inf
        row(2)[17] = kNaN;                                                     // NaN row
        row(4)[36] = kInf;                                                     // +inf row
        for (int64_t c = 0; c < cols; ++c) row(5)[c] = (c % 2) ? 3e38f : -3e38f;
        for (int64_t c = 0; c < cols; ++c) row(6)[c] = -3e38f + static_cast<float>(c) * 1e32f;
        std::vector<float> y(x.size());
        softmax(rt, rows, cols, x.data(), cols, y.data(), cols);
        auto out = [&](int64_t r, int64_t c) { return y[static_cast<size_t>(r * cols + c)]; };
        for (int64_t c = 0; c < cols; ++c) {
            if (c % 3 == 0) CHECK(out(0, c) == 0.0f);
            CHECK(out(1, c) == 0.0f);
            CHECK(std::isnan(out(2, c)));
            CHECK(std::isnan(out(4, c)));
            CHECK(std::isfinite(out(5, c)));
            CHECK(std::isfinite(out(6, c)));
        }
        for (int64_t r : {0, 3, 5, 6}) CHECK(check_rows(row(r), cols, &y[static_cast<size_t>(r * cols)], cols, 1, cols, "row") == 0);
    }
}

TEST_CASE("in place, and the same bits on 1 and 2 threads and for a row alone or among others") {
    const int64_t rows = 300, cols = 257;
    auto x = test::random_floats(static_cast<size_t>(rows * cols), 5, -20.0f, 20.0f);
    for (Isa isa : isas()) {
        Runtime r1(RuntimeOptions{1, isa, {}, {}}), r2(RuntimeOptions{2, isa, {}, {}});
        std::vector<float> y1(x.size()), y2(x.size());
        softmax(r1, rows, cols, x.data(), cols, y1.data(), cols);
        softmax(r2, rows, cols, x.data(), cols, y2.data(), cols);
        CHECK(test::same_bits(y1, y2));
        auto inplace = x;
        softmax(r2, rows, cols, inplace.data(), cols, inplace.data(), cols);
        CHECK(test::same_bits(inplace, y1));
        std::vector<float> alone(static_cast<size_t>(cols));
        softmax(r1, 1, cols, x.data() + 123 * cols, cols, alone.data(), cols);
        CHECK(std::equal(alone.begin(), alone.end(), y1.begin() + 123 * cols));
    }
}

TEST_CASE("online softmax: folding in blocks of any size equals the one-shot softmax") {
    const int64_t rows = 5, cols = 203;
    // Logits around 0, and around 2^20, where the exps leave base 2 (kBase2Limit): below it, on
    // both sides (the running max crosses it, so the fold rescales across the two forms), above.
    for (float offset : {0.0f, 1048000.0f, 1048560.0f, 1049000.0f})
    for (Isa isa : isas()) {
        CAPTURE(offset);
        auto x = test::random_floats(static_cast<size_t>(rows * cols), 6, -30.0f, 30.0f);
        for (float &v : x) v += offset;
        for (int64_t c = 0; c < 50; ++c) x[static_cast<size_t>(cols + c)] = -kInf;  // row 1: first 50 masked
        for (int64_t c = 0; c < cols; ++c) x[static_cast<size_t>(2 * cols + c)] = -kInf;  // row 2: all masked
        CAPTURE(std::string(isa_name(isa)));
        Runtime rt(RuntimeOptions{1, isa, {}, {}});
        for (int64_t block : std::initializer_list<int64_t>{1, 3, 16, 17, 50, 64, 100, cols}) {
            CAPTURE(block);
            // With V = identity, the accumulator collects P itself, so after finishing it must be
            // the softmax of the row.
            std::vector<float> m(rows, -kInf), l(rows, 0.0f), acc(static_cast<size_t>(rows * cols), 0.0f);
            for (int64_t c0 = 0; c0 < cols; c0 += block) {
                const int64_t w = std::min(block, cols - c0);
                std::vector<float> s(static_cast<size_t>(rows * w));
                for (int64_t r = 0; r < rows; ++r)
                    for (int64_t c = 0; c < w; ++c) s[static_cast<size_t>(r * w + c)] = x[static_cast<size_t>(r * cols + c0 + c)];
                online_softmax_fold(rt, rows, w, s.data(), w, m.data(), l.data(), acc.data(), cols, cols);
                for (int64_t r = 0; r < rows; ++r)
                    for (int64_t c = 0; c < w; ++c) acc[static_cast<size_t>(r * cols + c0 + c)] += s[static_cast<size_t>(r * w + c)];
            }
            online_softmax_finish(rt, rows, l.data(), acc.data(), cols, cols);
            CHECK(check_rows(x.data(), cols, acc.data(), cols, rows, cols, "block " + std::to_string(block)) == 0);
            for (int64_t c = 0; c < cols; ++c) CHECK(acc[static_cast<size_t>(2 * cols + c)] == 0.0f);
        }
    }
}

TEST_CASE("online softmax: each row's bits its own among any rows; -inf, NaN and huge rows") {
    // Rows of six kinds, folded in blocks: 0 plain, 1 all -inf, 2 masked until its third block
    // (its max starts at -inf), 3 huge (past kBase2Limit, where the factors leave base 2), 4 a NaN
    // among numbers, 5 a NaN among -inf. The fold takes W rows at a time in vectors; any row but
    // a NaN row must come out with the bits it gets when folded alone.
    const int64_t cols = 37, block = 11;
    enum Kind { plain, empty, late, huge, nan_in_numbers, nan_in_empty };
    auto fold = [&](Runtime &rt, int64_t rows, const float *x, float *m, float *l, float *acc) {
        std::fill(m, m + rows, -kInf);
        std::fill(l, l + rows, 0.0f);
        std::fill(acc, acc + rows * cols, 0.0f);
        for (int64_t c0 = 0; c0 < cols; c0 += block) {
            const int64_t w = std::min(block, cols - c0);
            std::vector<float> s(static_cast<size_t>(rows * w));
            for (int64_t r = 0; r < rows; ++r)
                std::copy(x + r * cols + c0, x + r * cols + c0 + w, s.begin() + r * w);
            online_softmax_fold(rt, rows, w, s.data(), w, m, l, acc, cols, cols);
            for (int64_t r = 0; r < rows; ++r)
                for (int64_t c = 0; c < w; ++c) acc[r * cols + c0 + c] += s[static_cast<size_t>(r * w + c)];
        }
        online_softmax_finish(rt, rows, l, acc, cols, cols);
    };
    for (Isa isa : isas())
        for (int64_t rows : {1, 7, 15, 16, 17, 33}) {
            CAPTURE(std::string(isa_name(isa)));
            CAPTURE(rows);
            Runtime rt(RuntimeOptions{1, isa, {}, {}});
            auto x = test::random_floats(static_cast<size_t>(rows * cols), 11 + static_cast<uint32_t>(rows), -30.0f, 30.0f);
            std::vector<Kind> kind(static_cast<size_t>(rows));
            for (int64_t r = 0; r < rows; ++r) {
                float *row = x.data() + r * cols;
                kind[static_cast<size_t>(r)] = static_cast<Kind>((r * 7 + rows) % 6);
                switch (kind[static_cast<size_t>(r)]) {
                case plain: break;
                case empty: std::fill(row, row + cols, -kInf); break;
                case late: std::fill(row, row + 2 * block, -kInf); break;
                case huge: for (int64_t c = 0; c < cols; ++c) row[c] += 1049000.0f; break;
                case nan_in_numbers: row[cols / 2] = kNaN; break;
                case nan_in_empty: std::fill(row, row + cols, -kInf); row[3] = kNaN; break;
                }
            }
            std::vector<float> m(static_cast<size_t>(rows)), l(m.size()), acc(x.size());
            fold(rt, rows, x.data(), m.data(), l.data(), acc.data());
            for (int64_t r = 0; r < rows; ++r) {
                CAPTURE(r);
                const Kind k = kind[static_cast<size_t>(r)];
                const float *out = acc.data() + r * cols;
                if (k == nan_in_numbers || k == nan_in_empty) {
                    CHECK(std::isnan(l[static_cast<size_t>(r)]));
                    CHECK(std::all_of(out, out + cols, [](float v) { return std::isnan(v); }));
                    if (k == nan_in_empty) CHECK(std::isnan(m[static_cast<size_t>(r)]));
                    continue;
                }
                float m1, l1;
                std::vector<float> acc1(static_cast<size_t>(cols));
                fold(rt, 1, x.data() + r * cols, &m1, &l1, acc1.data());
                CHECK(std::memcmp(&m1, &m[static_cast<size_t>(r)], sizeof m1) == 0);
                CHECK(std::memcmp(&l1, &l[static_cast<size_t>(r)], sizeof l1) == 0);
                CHECK(std::memcmp(acc1.data(), out, sizeof(float) * static_cast<size_t>(cols)) == 0);
                if (k == empty) {
                    CHECK(m[static_cast<size_t>(r)] == -kInf);
                    CHECK(l[static_cast<size_t>(r)] == 0.0f);
                    CHECK(std::all_of(out, out + cols, [](float v) { return v == 0.0f; }));
                } else {
                    CHECK(check_rows(x.data() + r * cols, cols, out, cols, 1, cols, "row " + std::to_string(r)) == 0);
                }
            }
        }
}

TEST_CASE("softmax: bad input gets a status and a message, and y is left untouched") {
    mha_runtime *rt = nullptr;
    REQUIRE(mha_runtime_create(1, &rt) == MHA_OK);
    std::vector<float> x(12, 1.0f), y(12, 7.0f);
    auto expect = [&](mha_status st, const char *needle) {
        CHECK(st == MHA_INVALID_ARGUMENT);
        CHECK_MESSAGE(std::string(mha_last_error()).find(needle) != std::string::npos, mha_last_error());
        for (float v : y) CHECK(v == 7.0f);
    };
    expect(mha_softmax(nullptr, 2, 3, x.data(), 3, y.data(), 3), "rt");
    expect(mha_softmax(rt, -1, 3, x.data(), 3, y.data(), 3), "rows");
    expect(mha_softmax(rt, 2, -3, x.data(), 3, y.data(), 3), "cols");
    expect(mha_softmax(rt, 2, 3, x.data(), 2, y.data(), 3), "ldx");
    expect(mha_softmax(rt, 2, 3, x.data(), 3, y.data(), 2), "ldy");
    expect(mha_softmax(rt, 2, 3, nullptr, 3, y.data(), 3), "x is NULL");
    expect(mha_softmax(rt, 2, 3, x.data(), 3, nullptr, 3), "y is NULL");
    expect(mha_softmax(rt, INT64_C(1) << 62, 3, x.data(), INT64_C(1) << 62, y.data(), 3), "overflow");
    expect(mha_softmax(rt, 2, 3, y.data(), 3, y.data(), 4), "ldx == ldy");
    expect(mha_softmax(rt, 2, 3, y.data(), 3, y.data() + 1, 3), "overlap");
    CHECK(mha_softmax(rt, 0, 3, nullptr, 3, nullptr, 3) == MHA_OK);
    mha_runtime_destroy(rt);

    Runtime r(RuntimeOptions{1, {}, {}, {}});
    float s[4] = {0, 0, 0, 0}, m[2], l[2], acc[4];
    CHECK_THROWS_AS(online_softmax_fold(r, 2, 2, s, 1, m, l, acc, 2, 2), Error);
    CHECK_THROWS_AS(online_softmax_fold(r, 2, 2, s, 2, nullptr, l, acc, 2, 2), Error);
    CHECK_THROWS_AS(online_softmax_finish(r, -1, l, acc, 2, 2), Error);
}
