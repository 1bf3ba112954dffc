#!/usr/bin/python3
"""Golden files for Add & Norm and the encoder layer (tests/test_encoder.cpp, and mha-run's encoder
mode), from PyTorch 1.13. Run with Debian's /usr/bin/python3 (python3-torch, python3-numpy):

    /usr/bin/python3 tests/data/gen_encoder_golden.py

Each case is a directory tests/data/encoder/<name>/. All inputs are float32; the expected outputs come
from the module run in float64 (module.double()) on the same values, and are checked against the
module's slow (non-fused) path in float64 before they are written.

seed002_mha: seed 002's MultiHeadAttention (n_head 8, d_model 512, d_k 64, d_v 32, no biases,
  residual = q, post-norm LayerNorm(eps 1e-6)), written out below as the seed defines it, in eval mode
  (dropout off). Self-attention: q = k = v = x.
    weights/            the weights under mha's layer names, one <name>.npy each: q_weight [H*64, 512],
                        k_weight [H*64, 512], v_weight [H*32, 512], out_weight [512, H*32],
                        norm_weight [512], norm_bias [512] (no safetensors: 3 MiB is enough once)
    query.npy, key.npy, value.npy [B, L, 512] (the same values: self-attention)
    mask.npy [B, 1, L] bool, the seed's convention: True = may attend (its masked_fill(mask == 0, -1e9))
    out.npy [B, L, 512]
    case.txt            num_heads, head_dim, value_dim, norm post, eps
nn.TransformerEncoderLayer(E 16, nhead 4, dim_feedforward 32, batch_first=True) cases, and encoder2, an
nn.TransformerEncoder of 2 such layers (state_dict keys with the "layers.N." prefix):
    weights/            the module's state_dict, one <key>.npy per tensor (self_attn.in_proj_weight.npy,
                        self_attn.in_proj_bias.npy, self_attn.out_proj.weight.npy, ..., linear1.weight.npy,
                        linear2.bias.npy, norm1.weight.npy, norm2.bias.npy; layers.0.self_attn... for encoder2)
    weights.safetensors the same tensors in one safetensors file, under the same keys (no prefix)
    query.npy [B, L, E]  the input (src)
    key_padding_mask.npy [B, L] bool (True = padding), attn_mask.npy [L, L] bool (True = not allowed;
                        the causal triu mask) when the case has them
    out.npy [B, L, E]
    case.txt            num_layers, num_heads, ffn_dim, activation relu|gelu, norm_first 0|1, eps, causal 0|1
Every bias (and LayerNorm's weight and bias) is random and nonzero, so a dropped term shows.
"""
import math
import os
import shutil

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from gen_layer_golden import save, save_safetensors  # the same files as the layer's goldens

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "encoder")


def write_case_txt(d, fields):
    with open(os.path.join(d, "case.txt"), "w") as f:
        for k, v in fields:
            f.write(f"{k} {v}\n")


def new_dir(name):
    d = os.path.join(HERE, name)
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(os.path.join(d, "weights"))
    return d


# ---- seed 002 ------------------------------------------------------------------------------------

class ScaledDotProductAttention(nn.Module):
    """Seed 002's scaled dot-product attention."""

    def __init__(self, temperature, attn_dropout=0.1):
        super().__init__()
        self.temperature = temperature
        self.dropout = nn.Dropout(attn_dropout)

    def forward(self, q, k, v, mask=None):
        attn = torch.matmul(q / self.temperature, k.transpose(2, 3))
        if mask is not None:
            attn = attn.masked_fill(mask == 0, -1e9)
        attn = self.dropout(F.softmax(attn, dim=-1))
        output = torch.matmul(attn, v)
        return output, attn


class MultiHeadAttention(nn.Module):
    """Seed 002's multi-head attention module: projections without biases, attention, the output
    projection, then Add & Norm with residual = q and LayerNorm(eps 1e-6)."""

    def __init__(self, n_head, d_model, d_k, d_v, dropout=0.1):
        super().__init__()
        self.n_head = n_head
        self.d_k = d_k
        self.d_v = d_v
        self.w_qs = nn.Linear(d_model, n_head * d_k, bias=False)
        self.w_ks = nn.Linear(d_model, n_head * d_k, bias=False)
        self.w_vs = nn.Linear(d_model, n_head * d_v, bias=False)
        self.fc = nn.Linear(n_head * d_v, d_model, bias=False)
        self.attention = ScaledDotProductAttention(temperature=d_k ** 0.5)
        self.dropout = nn.Dropout(dropout)
        self.layer_norm = nn.LayerNorm(d_model, eps=1e-6)

    def forward(self, q, k, v, mask=None):
        d_k, d_v, n_head = self.d_k, self.d_v, self.n_head
        sz_b, len_q, len_k, len_v = q.size(0), q.size(1), k.size(1), v.size(1)
        residual = q
        q = self.w_qs(q).view(sz_b, len_q, n_head, d_k)
        k = self.w_ks(k).view(sz_b, len_k, n_head, d_k)
        v = self.w_vs(v).view(sz_b, len_v, n_head, d_v)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if mask is not None:
            mask = mask.unsqueeze(1)  # for the head axis
        q, attn = self.attention(q, k, v, mask=mask)
        q = q.transpose(1, 2).contiguous().view(sz_b, len_q, -1)
        q = self.dropout(self.fc(q))
        q += residual
        q = self.layer_norm(q)
        return q, attn


def gen_seed002():
    H, E, DK, DV, B, L = 8, 512, 64, 32, 2, 5
    d = new_dir("seed002_mha")
    m = MultiHeadAttention(H, E, DK, DV).eval()
    with torch.no_grad():  # LayerNorm starts as 1 and 0: make both count
        m.layer_norm.weight.uniform_(0.5, 1.5)
        m.layer_norm.bias.uniform_(-0.5, 0.5)
    names = {"q_weight": m.w_qs.weight, "k_weight": m.w_ks.weight, "v_weight": m.w_vs.weight,
             "out_weight": m.fc.weight, "norm_weight": m.layer_norm.weight, "norm_bias": m.layer_norm.bias}
    for key, p in names.items():
        save(os.path.join(d, "weights", key + ".npy"), p.detach().float().numpy())
    x = torch.rand(B, L, E) * 2 - 1
    mask = torch.ones(B, 1, L, dtype=torch.bool)
    mask[1, :, L - 2:] = False  # the second sequence's last 2 keys are padding
    for name in ("query", "key", "value"):
        save(os.path.join(d, name + ".npy"), x.numpy())
    save(os.path.join(d, "mask.npy"), mask.numpy())
    m64 = m.double()
    with torch.no_grad():
        x64 = x.double()
        out, _ = m64(x64, x64.clone(), x64.clone(), mask=mask)
    # The seed's -1e9 fill is exactly a masked key in float64 (exp underflows to 0).
    assert torch.isfinite(out).all()
    save(os.path.join(d, "out.npy"), out.float().numpy())
    write_case_txt(d, [("num_heads", H), ("head_dim", DK), ("value_dim", DV), ("norm", "post"), ("eps", "1e-06")])
    print("seed002_mha ->", d)


# ---- nn.TransformerEncoderLayer / nn.TransformerEncoder -------------------------------------------

ENCODER_CASES = [
    # name, num_layers, activation, norm_first, eps, key_padding, causal
    ("post_relu", 1, "relu", False, 1e-5, False, False),
    ("post_gelu", 1, "gelu", False, 1e-5, False, False),
    ("pre_relu", 1, "relu", True, 1e-5, False, False),
    ("pre_gelu", 1, "gelu", True, 1e-2, False, False),  # a large eps, so a dropped eps shows
    ("post_gelu_key_padding", 1, "gelu", False, 1e-5, True, False),
    ("pre_relu_causal", 1, "relu", True, 1e-5, False, True),
    ("encoder2", 2, "gelu", False, 1e-5, False, False),
]
E, NHEAD, FFN, B, L = 16, 4, 32, 2, 5


def randomize(module):
    """Every parameter random: weights as nn.Linear's init, biases uniform(-0.5, 0.5), LayerNorm
    weights uniform(0.5, 1.5). (nn.TransformerEncoder deep-copies one layer: this makes its layers
    differ.)"""
    with torch.no_grad():
        for key, p in module.named_parameters():
            if "norm" in key and key.endswith("weight"):
                p.uniform_(0.5, 1.5)
            elif key.endswith("bias"):
                p.uniform_(-0.5, 0.5)
            else:
                a = 1.0 / math.sqrt(p.shape[1])
                p.uniform_(-a, a)


def gen_encoder(name, num_layers, activation, norm_first, eps, key_padding, causal):
    d = new_dir(name)
    layer = nn.TransformerEncoderLayer(E, NHEAD, dim_feedforward=FFN, dropout=0.1, activation=activation,
                                       layer_norm_eps=eps, batch_first=True, norm_first=norm_first)
    m = layer if num_layers == 1 else nn.TransformerEncoder(layer, num_layers, enable_nested_tensor=False)
    randomize(m)
    m.eval()
    state = {k: v.detach().float().numpy() for k, v in m.state_dict().items()}
    for key, t in state.items():
        save(os.path.join(d, "weights", key + ".npy"), t)
    save_safetensors(os.path.join(d, "weights.safetensors"), state)

    x = torch.rand(B, L, E) * 2 - 1
    save(os.path.join(d, "query.npy"), x.numpy())
    kpm = attn_mask = None
    if key_padding:
        kpm = torch.zeros(B, L, dtype=torch.bool)
        kpm[1, L - 2:] = True  # the second sequence is 2 tokens shorter
        save(os.path.join(d, "key_padding_mask.npy"), kpm.numpy())
    if causal:
        attn_mask = torch.triu(torch.ones(L, L, dtype=torch.bool), diagonal=1)
        save(os.path.join(d, "attn_mask.npy"), attn_mask.numpy())

    m64 = m.double()
    x64 = x.double()
    with torch.no_grad():  # the inference fast path where PyTorch takes it
        out = m64(x64, attn_mask, src_key_padding_mask=kpm)
    # The slow path (parameters that require grad keep PyTorch off its fused kernels) must agree.
    slow = m64(x64, attn_mask, src_key_padding_mask=kpm).detach()
    assert torch.isfinite(out).all(), name
    assert torch.allclose(out, slow, rtol=0, atol=1e-10), (name, (out - slow).abs().max().item())
    save(os.path.join(d, "out.npy"), out.float().numpy())
    write_case_txt(d, [("num_layers", num_layers), ("num_heads", NHEAD), ("ffn_dim", FFN),
                       ("activation", activation), ("norm_first", int(norm_first)), ("eps", repr(eps)),
                       ("causal", int(causal))])
    print(name, "->", d)


def main():
    torch.manual_seed(2025)
    gen_seed002()
    for case in ENCODER_CASES:
        gen_encoder(*case)


if __name__ == "__main__":
    main()
