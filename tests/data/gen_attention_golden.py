#!/usr/bin/python3
"""Golden files for tests/test_attention.cpp, from PyTorch's scaled-dot-product math in float64:
matmul, masked softmax, matmul. Run with Debian's /usr/bin/python3 (python3-torch, python3-numpy):

    /usr/bin/python3 tests/data/gen_attention_golden.py

Each case is one text file, attention_<name>.txt: a header line
    B Lq Lk H Hkv D Dv causal has_valid mask_kind
(mask_kind: 0 none, 1 [B,1,Lk], 2 [B,Lq,Lk]), then one line per array, whitespace-separated:
q [B,Lq,H,D], k [B,Lk,Hkv,D], v [B,Lk,Hkv,Dv], valid [B] (if has_valid), mask (if mask_kind),
out [B,Lq,H,Dv], weights [B,H,Lq,Lk]. Inputs are float32 values; outputs are the float64 results.
"""
import os

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
CASES = [
    # name, B, Lq, Lk, H, Hkv, D, Dv, causal, valid, mask_kind
    ("self_mask_b1l", 2, 6, 6, 2, 2, 8, 8, False, False, 1),
    ("cross_valid_lens", 2, 4, 7, 2, 2, 8, 8, False, True, 0),
    ("causal_kvcache_gqa", 2, 3, 9, 4, 2, 8, 8, True, False, 0),
    ("dv_ne_dqk_full_mask", 2, 5, 6, 2, 1, 6, 10, False, False, 2),
]


def reference(q, k, v, causal, valid, mask):
    B, Lq, H, D = q.shape
    Lk, Hkv = k.shape[1], k.shape[2]
    g = H // Hkv
    qh = q.permute(0, 2, 1, 3)                                       # B H Lq D
    kh = k.permute(0, 2, 1, 3).repeat_interleave(g, dim=1)            # B H Lk D
    vh = v.permute(0, 2, 1, 3).repeat_interleave(g, dim=1)
    scores = qh @ kh.transpose(-1, -2) / D ** 0.5                     # B H Lq Lk
    allowed = torch.ones(B, 1, Lq, Lk, dtype=torch.bool)
    if causal:
        i = torch.arange(Lq)[:, None]
        j = torch.arange(Lk)[None, :]
        allowed &= (j <= i + Lk - Lq)
    if valid is not None:
        allowed &= (torch.arange(Lk)[None, :] < valid[:, None])[:, None, None, :]
    if mask is not None:
        allowed &= (mask != 0)[:, None, :, :]
    scores = scores.masked_fill(~allowed, float("-inf"))
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)          # fully masked rows -> zeros
    out = (weights @ vh).permute(0, 2, 1, 3)                          # B Lq H Dv
    return out, weights


def line(t):
    return " ".join(repr(float(x)) for x in t.flatten().tolist())


def main():
    gen = torch.Generator().manual_seed(1234)
    for name, B, Lq, Lk, H, Hkv, D, Dv, causal, has_valid, mask_kind in CASES:
        q = torch.rand(B, Lq, H, D, generator=gen).float() * 2 - 1
        k = torch.rand(B, Lk, Hkv, D, generator=gen).float() * 2 - 1
        v = torch.rand(B, Lk, Hkv, Dv, generator=gen).float() * 2 - 1
        valid = torch.tensor([0, Lk - 2][:B] if B == 2 else [Lk] * B, dtype=torch.int32) if has_valid else None
        mask = None
        if mask_kind:
            rows = 1 if mask_kind == 1 else Lq
            mask = (torch.rand(B, rows, Lk, generator=gen) > 0.3).to(torch.uint8)
            mask[0, 0, :] = 0  # a fully masked row (or query block) too
        out, weights = reference(q.double(), k.double(), v.double(), causal,
                                 None if valid is None else valid.long(), None if mask is None else mask.expand(B, Lq, Lk))
        with open(os.path.join(HERE, f"attention_{name}.txt"), "w") as f:
            f.write(f"{B} {Lq} {Lk} {H} {Hkv} {D} {Dv} {int(causal)} {int(has_valid)} {mask_kind}\n")
            for t in (q, k, v):
                f.write(line(t) + "\n")
            if valid is not None:
                f.write(line(valid) + "\n")
            if mask is not None:
                f.write(line(mask) + "\n")
            f.write(line(out) + "\n")
            f.write(line(weights) + "\n")


if __name__ == "__main__":
    main()
