import numpy as np
# Minimax-style fit (Lawson's iteratively reweighted least squares) of
#   e^t ~ 1 + t*(c1 + t*(c2 + t*(c3 + t*(c4 + t*c5))))  on t in [-ln2/2, ln2/2], relative error.
a = np.log(2) / 2
t = np.cos(np.linspace(0, np.pi, 4001)) * a
f = np.exp(t)
A = np.stack([t**k for k in range(1, 6)], axis=1) / f[:, None]
b = (f - 1) / f
w = np.ones_like(t)
for it in range(200):
    W = np.sqrt(w)
    c, *_ = np.linalg.lstsq(A * W[:, None], b * W, rcond=None)
    err = np.abs(A @ c - b)
    w = w * err
    w /= w.sum()
c32 = c.astype(np.float32)
p = 1 + t * (c32[0] + t * (c32[1] + t * (c32[2] + t * (c32[3] + t * c32[4]))))
print("max rel err (float coeffs, exact arithmetic):", np.max(np.abs(p / f - 1)))
for i, x in enumerate(c32, 1):
    print(f"c{i} = {float(x).hex()}  ({x:.9g})")
