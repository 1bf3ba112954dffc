#!/usr/bin/python3
"""Fits the polynomial of the vector erfc in src/layer/activation.hpp (GELU's erf form):

    erfc(u) = t * exp(-u^2 + P(t)),  t = 1 / (1 + u / 2),  u >= 0

(the form of the classic Chebyshev-fitted erfcc; these coefficients are our own least-squares
fit). Prints the coefficients (highest degree first) and the largest relative error of the
formula evaluated in double on [0, 9], where below float's range erfc is 0 anyway.
Run: /usr/bin/python3 tests/data/fit_erfc_poly.py
"""
import math

import numpy as np

DEGREE = 9
u = np.concatenate([np.linspace(0.0, 9.0, 20001), 9.0 * (1 - np.cos(np.linspace(0, np.pi / 2, 2001)))])
t = 1.0 / (1.0 + 0.5 * u)
target = np.array([math.log(math.erfc(x)) for x in u]) - np.log(t) + u * u
# Weighted least squares in t on the Chebyshev basis (well conditioned), then to monomials.
cheb = np.polynomial.chebyshev.Chebyshev.fit(t, target, DEGREE, domain=[t.min(), 1.0])
poly = cheb.convert(kind=np.polynomial.Polynomial, domain=[-1, 1], window=[-1, 1])
coef = poly.coef  # lowest degree first, in t
approx = t * np.exp(-u * u + np.polyval(coef[::-1], t))
exact = np.array([math.erfc(x) for x in u])
rel = np.abs(approx - exact) / exact
print("coefficients, highest degree first:")
for c in coef[::-1]:
    print(f"  {float(np.float32(c)).hex()}  ({c:.10e})")
print(f"max relative error of erfc on [0, 9]: {rel.max():.3e}")
