#!/usr/bin/python3
"""What the KV cache's storage type costs in accuracy (the README's table): a causal self-attention
layer's prompt rows through `mha-run --generate --kv-dtype f32|i8` against the layer computed in
float64 with numpy, on the golden layer tests/data/layer/causal and on a larger random layer; the
same float64 layer with K and V rounded to bf16 (round to nearest even) and to int8 (mha's scheme)
puts the measured int8 error beside what bf16 storage would cost (mha has no bf16 cache yet).

    /usr/bin/python3 tools/kv_dtype_accuracy.py build/tools/mha-run
"""
import os
import subprocess
import sys
import tempfile

import numpy as np


def bf16(x):
    u = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    u = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
    return u.astype(np.uint32).view(np.float32).astype(np.float64)


def int8(x):  # per row of the last axis: scale = max|x| / 127, round to nearest
    x32 = x.astype(np.float32)
    m = np.abs(x32).max(axis=-1, keepdims=True)
    scale = (m / np.float32(127)).astype(np.float32)
    safe = np.where(scale == 0, np.float32(1), scale)
    q = np.clip(np.rint(x32 / safe), -127, 127)
    return (q.astype(np.float32) * scale).astype(np.float64)


def layer(x, w_in, b_in, w_out, b_out, H, store=None):
    B, L, E = x.shape
    D = E // H
    qkv = x.astype(np.float64) @ w_in.T.astype(np.float64) + b_in
    q, k, v = (qkv[..., i * E:(i + 1) * E].reshape(B, L, H, D) for i in range(3))
    if store is not None:  # K and V as the cache stores them: per token and head
        k = store(k.astype(np.float32))
        v = store(v.astype(np.float32))
    s = np.einsum("blhd,bmhd->bhlm", q, k) / np.sqrt(D)
    s = np.where(np.tril(np.ones((L, L), bool)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    o = np.einsum("bhlm,bmhd->blhd", p, v).reshape(B, L, E)
    return o @ w_out.T.astype(np.float64) + b_out


def main():
    mha_run = sys.argv[1] if len(sys.argv) > 1 else "build/tools/mha-run"
    here = os.path.dirname(os.path.abspath(__file__))
    rng = np.random.default_rng(20)
    with tempfile.TemporaryDirectory() as tmp:
        big = os.path.join(tmp, "big")
        os.makedirs(os.path.join(big, "weights"))
        E, H, B, L = 256, 8, 2, 384
        a = 1 / np.sqrt(E)
        arrays = {"in_proj_weight": rng.uniform(-a, a, (3 * E, E)), "in_proj_bias": rng.uniform(-0.1, 0.1, 3 * E),
                  "out_proj.weight": rng.uniform(-a, a, (E, E)), "out_proj.bias": rng.uniform(-0.1, 0.1, E)}
        for k, v in arrays.items():
            np.save(os.path.join(big, "weights", k + ".npy"), v.astype(np.float32))
        np.save(os.path.join(big, "query.npy"), rng.standard_normal((B, L, E)).astype(np.float32))
        cases = [("golden layer 'causal' (B2 L6 E16 H4)", os.path.join(here, "..", "tests", "data", "layer", "causal"), 4),
                 ("random layer B2 L384 E256 H8, x ~ N(0, 1)", big, H)]
        print("| layer | K/V storage | max abs error | max abs error / max abs output |")
        print("|---|---|---|---|")
        for name, d, heads in cases:
            w = {k: np.load(os.path.join(d, "weights", k + ".npy")).astype(np.float64) for k in
                 ("in_proj_weight", "in_proj_bias", "out_proj.weight", "out_proj.bias")}
            x = np.load(os.path.join(d, "query.npy"))
            exact = layer(x, w["in_proj_weight"], w["in_proj_bias"], w["out_proj.weight"], w["out_proj.bias"], heads)
            top = np.abs(exact).max()
            Lq = x.shape[1]
            for dtype in ("f32", "i8"):
                out = os.path.join(tmp, "o.npy")
                subprocess.run([mha_run, "--weights", os.path.join(d, "weights"), "--num-heads", str(heads), "--query",
                                os.path.join(d, "query.npy"), "--generate", "1", "--kv-dtype", dtype, "--out", out],
                               check=True, stdout=subprocess.DEVNULL)
                got = np.load(out)[:, :Lq].astype(np.float64)
                err = np.abs(got - exact).max()
                print(f"| {name} | {dtype} (mha-run, measured) | {err:.2e} | {err / top:.2e} |")
            for label, fn in (("bf16 (float64 model)", bf16), ("i8 (float64 model)", int8)):
                err = np.abs(layer(x, w["in_proj_weight"], w["in_proj_bias"], w["out_proj.weight"], w["out_proj.bias"],
                                   heads, fn) - exact).max()
                print(f"| {name} | {label} | {err:.2e} | {err / top:.2e} |")


if __name__ == "__main__":
    main()
