// A float result against a reference, for the doctest suites.
#pragma once

#include <doctest/doctest.h>

#include <cmath>
#include <cstddef>
#include <string>

namespace mha::test {

// got against want element by element: the worst |got - want| / (1 + |want|) within tol, reported
// with where it is and both values.
template <class A, class B>
void check_close(const A &got, const B &want, double tol, const std::string &what) {
    REQUIRE(got.size() == want.size());
    double worst = 0;
    size_t at = 0;
    for (size_t i = 0; i < got.size(); ++i) {
        const double err = std::abs(static_cast<double>(got[i]) - static_cast<double>(want[i])) /
                           (1.0 + std::abs(static_cast<double>(want[i])));
        if (!(err <= worst)) {
            worst = err;
            at = i;
        }
    }
    INFO(what << ": worst error " << worst << " at " << at << " (got " << static_cast<double>(got[at]) << ", want "
              << static_cast<double>(want[at]) << ")");
    CHECK(worst <= tol);
}

} // namespace mha::test
