import numpy as np
# Minimax-style fits (Lawson's iteratively reweighted least squares), relative error, of
#   f(t) ~ 1 + t*(c1 + t*(c2 + t*(c3 + t*(c4 + t*c5))))
# for the vector exps of src/softmax/vexp.hpp:
#   e^t on t in [-ln2/2, ln2/2]   (exp_poly: vexp, vexp_nonpositive)
#   2^t on t in [0, 1)            (exp2_poly: vexp2_nonpositive, AVX-512, t = x - floor(x))


def fit(f, lo, hi):
    t = lo + (np.cos(np.linspace(0, np.pi, 8001)) + 1) / 2 * (hi - lo)
    y = f(t)
    A = np.stack([t**k for k in range(1, 6)], axis=1) / y[:, None]
    b = (y - 1) / y
    w = np.ones_like(t)
    for it in range(300):
        W = np.sqrt(w)
        c, *_ = np.linalg.lstsq(A * W[:, None], b * W, rcond=None)
        err = np.abs(A @ c - b)
        w = w * err
        w /= w.sum()
    c32 = c.astype(np.float32)
    tt = np.linspace(lo, hi, 200001)
    p = 1 + tt * (c32[0] + tt * (c32[1] + tt * (c32[2] + tt * (c32[3] + tt * c32[4]))))
    return c32, np.max(np.abs(p / f(tt) - 1))


for name, f, lo, hi in [("exp_poly", np.exp, -np.log(2) / 2, np.log(2) / 2),
                        ("exp2_poly", np.exp2, 0.0, 1.0)]:
    c32, err = fit(f, lo, hi)
    print(f"{name}: max rel err (float coeffs, exact arithmetic): {err:.3g}")
    for i, x in enumerate(c32, 1):
        print(f"  c{i} = {float(x).hex()}  ({x:.9g})")
