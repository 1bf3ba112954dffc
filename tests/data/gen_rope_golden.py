#!/usr/bin/python3
"""Golden files for rotary position embeddings in the layer (tests/test_layer.cpp), from PyTorch:
a causal self-attention layer whose q and k heads rotate right after their projection, written as
Hugging Face's Llama (rotate_half on pairs (x[d], x[d + R/2])) and as GPT-J / Meta's reference
Llama (adjacent pairs (x[2d], x[2d+1])), with partial rotation (the first R of D dims) and GQA.
The angles are computed as Hugging Face does, in float32: inv_freq = 1 / theta^(arange(0, R, 2) / R),
angle = (position * position_scale) * inv_freq, then cos and sin in float32; the rest runs in
float64. Run with Debian's /usr/bin/python3 (python3-torch, python3-numpy):

    /usr/bin/python3 tests/data/gen_rope_golden.py

Each case is a directory tests/data/rope/<name>/ holding x.npy [B, L, E], q_weight.npy, k_weight.npy,
v_weight.npy, out_weight.npy (nn.Linear layout), q_bias.npy, k_bias.npy, v_bias.npy, out_bias.npy,
out.npy [B, L, E] (the float64 results, rounded to float32), and case.txt: "num_heads H num_kv_heads Hkv head_dim D
rope_dims R theta T interleaved I position_scale S".
"""
import os
import shutil

import numpy as np
import torch

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "rope")
CASES = [
    # name, E, H, Hkv, D, B, L, R, theta, interleaved, position_scale
    ("half_partial_gqa", 32, 4, 2, 8, 2, 7, 6, 10000.0, 0, 1.0),
    ("interleaved_full", 32, 4, 4, 8, 1, 9, 8, 500000.0, 1, 0.25),
]


def rotate(x, cos, sin, R, interleaved):
    """x [B, L, heads, D] float64; cos, sin [L, R/2] float32 -> x with its first R dims rotated."""
    c = cos.double()[None, :, None, :]
    s = sin.double()[None, :, None, :]
    rot, rest = x[..., :R], x[..., R:]
    if interleaved:  # GPT-J: rotate_every_two
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        out = torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2)
    else:  # Hugging Face: rotate_half
        x1, x2 = rot[..., : R // 2], rot[..., R // 2:]
        out = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    return torch.cat((out, rest), dim=-1)


def main():
    torch.manual_seed(77)
    for name, E, H, Hkv, D, B, L, R, theta, interleaved, pscale in CASES:
        d = os.path.join(HERE, name)
        shutil.rmtree(d, ignore_errors=True)
        os.makedirs(d)
        w = {
            "q_weight": torch.randn(H * D, E) / E ** 0.5, "k_weight": torch.randn(Hkv * D, E) / E ** 0.5,
            "v_weight": torch.randn(Hkv * D, E) / E ** 0.5, "out_weight": torch.randn(E, H * D) / (H * D) ** 0.5,
            "q_bias": torch.randn(H * D) * 0.1, "k_bias": torch.randn(Hkv * D) * 0.1,
            "v_bias": torch.randn(Hkv * D) * 0.1, "out_bias": torch.randn(E) * 0.1,
        }
        x = torch.randn(B, L, E)
        wd = {k: v.double() for k, v in w.items()}
        xd = x.double()
        q = (xd @ wd["q_weight"].T + wd["q_bias"]).view(B, L, H, D)
        k = (xd @ wd["k_weight"].T + wd["k_bias"]).view(B, L, Hkv, D)
        v = (xd @ wd["v_weight"].T + wd["v_bias"]).view(B, L, Hkv, D)
        inv_freq = 1.0 / (theta ** (torch.arange(0, R, 2, dtype=torch.int64).float() / R))
        t = torch.arange(L, dtype=torch.int64).float() * pscale
        freqs = torch.outer(t, inv_freq)  # float32, as Hugging Face
        cos, sin = freqs.cos(), freqs.sin()
        q, k = rotate(q, cos, sin, R, interleaved), rotate(k, cos, sin, R, interleaved)
        g = H // Hkv
        qh = q.permute(0, 2, 1, 3)
        kh = k.permute(0, 2, 1, 3).repeat_interleave(g, dim=1)
        vh = v.permute(0, 2, 1, 3).repeat_interleave(g, dim=1)
        scores = qh @ kh.transpose(-1, -2) / D ** 0.5
        causal = torch.ones(L, L, dtype=torch.bool).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
        o = (torch.softmax(scores, dim=-1) @ vh).permute(0, 2, 1, 3).reshape(B, L, H * D)
        out = o @ wd["out_weight"].T + wd["out_bias"]
        for key, val in w.items():
            np.save(os.path.join(d, key + ".npy"), val.numpy().astype(np.float32))
        np.save(os.path.join(d, "x.npy"), x.numpy().astype(np.float32))
        np.save(os.path.join(d, "out.npy"), out.numpy().astype(np.float32))
        with open(os.path.join(d, "case.txt"), "w") as f:
            f.write(f"num_heads {H} num_kv_heads {Hkv} head_dim {D} rope_dims {R} theta {theta!r} "
                    f"interleaved {interleaved} position_scale {pscale!r}\n")


if __name__ == "__main__":
    main()
