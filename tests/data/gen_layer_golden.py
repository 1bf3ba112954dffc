#!/usr/bin/python3
"""Golden files for the multi-head attention layer (tests/test_layer.cpp, tests/test_mha_run.sh),
from PyTorch's nn.MultiheadAttention(batch_first=True) with random weights. Run with Debian's
/usr/bin/python3 (python3-torch, python3-numpy):

    /usr/bin/python3 tests/data/gen_layer_golden.py

Each case is a directory tests/data/layer/<name>/ holding
  weights/            the module's state_dict, one <key>.npy per tensor (as mha-run --weights reads)
  weights.safetensors the same tensors in one safetensors file, under the prefix "attn."
  query.npy [B, Lq, E], and key.npy [B, Lk, kdim], value.npy [B, Lk, vdim] for cross-attention
  key_padding_mask.npy [B, Lk] bool (True = padding), attn_mask.npy [Lq, Lk] bool (True = not allowed)
  out.npy [B, Lq, E], weights.npy [B, H, Lq, Lk] (per head), weights_avg.npy [B, Lq, Lk]
  case.txt            "num_heads <H>" and, for causal cases, "causal"
All inputs are float32; the expected outputs come from the module run in float64 on the same values.
"""
import json
import os
import shutil
import struct

import numpy as np
import torch

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "layer")
CASES = [
    # name, E, H, B, Lq, Lk, kdim, vdim, bias, key_padding, causal
    ("self", 16, 4, 2, 5, 5, None, None, True, False, False),
    ("cross_kdim_vdim", 16, 2, 2, 3, 6, 12, 10, True, False, False),
    ("no_bias", 16, 4, 1, 4, 4, None, None, False, False, False),
    ("key_padding", 16, 4, 2, 5, 5, None, None, True, True, False),
    ("causal", 16, 4, 2, 6, 6, None, None, True, False, True),
]


def save(path, array):
    np.save(path, np.ascontiguousarray(array))


def save_safetensors(path, tensors):
    header, blobs, offset = {}, [], 0
    for name, t in tensors.items():
        data = np.ascontiguousarray(t, dtype=np.float32).tobytes()
        header[name] = {"dtype": "F32", "shape": list(t.shape), "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def main():
    torch.manual_seed(2024)
    for name, E, H, B, Lq, Lk, kdim, vdim, bias, key_padding, causal in CASES:
        d = os.path.join(HERE, name)
        shutil.rmtree(d, ignore_errors=True)
        os.makedirs(os.path.join(d, "weights"))
        m = torch.nn.MultiheadAttention(E, H, bias=bias, batch_first=True, kdim=kdim, vdim=vdim)
        with torch.no_grad():  # biases are zero at init: make them count
            for key, p in m.named_parameters():
                if "bias" in key:
                    p.uniform_(-0.5, 0.5)
        state = {k: v.detach().float().numpy() for k, v in m.state_dict().items()}
        for key, t in state.items():
            save(os.path.join(d, "weights", key + ".npy"), t)
        save_safetensors(os.path.join(d, "weights.safetensors"), {"attn." + k: v for k, v in state.items()})

        query = torch.rand(B, Lq, E) * 2 - 1
        cross = kdim is not None
        key = torch.rand(B, Lk, kdim or E) * 2 - 1 if cross else query
        value = torch.rand(B, Lk, vdim or E) * 2 - 1 if cross else query
        save(os.path.join(d, "query.npy"), query.numpy())
        if cross:
            save(os.path.join(d, "key.npy"), key.numpy())
            save(os.path.join(d, "value.npy"), value.numpy())
        kpm = attn_mask = None
        if key_padding:
            kpm = torch.zeros(B, Lk, dtype=torch.bool)
            kpm[1, Lk - 2:] = True  # the second sequence is 2 keys shorter
            save(os.path.join(d, "key_padding_mask.npy"), kpm.numpy())
        if causal:
            attn_mask = torch.triu(torch.ones(Lq, Lk, dtype=torch.bool), diagonal=1)
            save(os.path.join(d, "attn_mask.npy"), attn_mask.numpy())

        m64 = m.double()
        with torch.no_grad():
            out, w = m64(query.double(), key.double(), value.double(), key_padding_mask=kpm, attn_mask=attn_mask,
                         need_weights=True, average_attn_weights=False)
            _, w_avg = m64(query.double(), key.double(), value.double(), key_padding_mask=kpm, attn_mask=attn_mask,
                           need_weights=True, average_attn_weights=True)
        save(os.path.join(d, "out.npy"), out.float().numpy())
        save(os.path.join(d, "weights.npy"), w.float().numpy())
        save(os.path.join(d, "weights_avg.npy"), w_avg.float().numpy())
        with open(os.path.join(d, "case.txt"), "w") as f:
            f.write(f"num_heads {H}\n" + ("causal\n" if causal else ""))
        print(name, "->", d)


if __name__ == "__main__":
    main()
