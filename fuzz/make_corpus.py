#!/usr/bin/python3
"""Writes the fuzzers' seed corpora, fuzz/corpus/<fuzzer>/ (checked in; rerun after changing the
C ABI fuzzer's decoder). Deterministic: the same files every run. Needs Debian's python3-numpy."""
import io
import json
import os
import random
import struct

import numpy as np

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus")


def put(fuzzer, name, data):
    d = os.path.join(ROOT, fuzzer)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)


def npy(arr, version=None):
    b = io.BytesIO()
    if version:
        np.lib.format.write_array(b, arr, version=version)
    else:
        np.save(b, arr)
    return b.getvalue()


def safetensors(tensors, metadata=None):
    header, blobs, off = {}, b"", 0
    for name, (dtype, shape, data) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [off, off + len(data)]}
        blobs += data
        off += len(data)
    if metadata:
        header["__metadata__"] = metadata
    h = json.dumps(header).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    return struct.pack("<Q", len(h)) + h + blobs


def main():
    # .npy
    put("npy", "f32_2x3.npy", npy(np.arange(6, dtype=np.float32).reshape(2, 3)))
    put("npy", "bool_4.npy", npy(np.array([True, False, True, True])))
    put("npy", "i64_scalar.npy", npy(np.array(7, dtype=np.int64)))
    put("npy", "u8_0x5_v2.npy", npy(np.zeros((0, 5), dtype=np.uint8), version=(2, 0)))
    put("npy", "f64_fortran.npy", npy(np.asfortranarray(np.ones((2, 2), dtype=np.float64))))
    put("npy", "i32_3_v3.npy", npy(np.array([1, -2, 3], dtype=np.int32), version=(3, 0)))

    # .safetensors
    f32 = struct.pack("<6f", *range(6))
    put("safetensors", "one_f32.safetensors", safetensors({"w": ("F32", [2, 3], f32)}))
    put("safetensors", "mixed.safetensors", safetensors(
        {"a": ("BOOL", [3], b"\x01\x00\x01"), "b": ("I64", [1], struct.pack("<q", -5)),
         "c": ("F64", [], struct.pack("<d", 1.5)), "d": ("U8", [0, 4], b"")},
        metadata={"format": "pt"}))
    put("safetensors", "i32_2x2.safetensors", safetensors({"x.weight": ("I32", [2, 2], struct.pack("<4i", 1, 2, 3, 4))}))
    put("safetensors", "empty.safetensors", safetensors({}))

    # tile configs (this fuzzer's machine is AVX2; an avx512 config is refused on it)
    tiles = {"gemm_ukernel": "avx2_6x16", "mc": 144, "kc": 256, "nc": 3072, "sup_max_n": 16, "sup_max_k": 64,
             "attn_block_q": 64, "attn_block_k": 128, "attn_kv_chunk": 1024}
    cfg = {"format": "mha-tile-config", "version": 1, "isa": "avx2", "cpu": "AMD EPYC", "date": "2026-01-01T00:00:00Z",
           "tiles": tiles}
    put("tile_config", "full_avx2.json", (json.dumps(cfg, indent=2) + "\n").encode())
    put("tile_config", "partial.json", json.dumps({"format": "mha-tile-config", "version": 1, "isa": "avx2",
                                                   "tiles": {"kc": 128, "attn_block_k": 64}}).encode())
    put("tile_config", "avx512.json", json.dumps(dict(cfg, isa="avx512", tiles=dict(tiles, gemm_ukernel="avx512_14x32"))).encode())
    put("tile_config", "bad_value.json", json.dumps(dict(cfg, tiles={"mc": 7})).encode())
    put("tile_config", "unknown_key.json", json.dumps(dict(cfg, extra=1)).encode())

    # The C ABI: byte 0 picks the entry point (fuzz_c_abi.cpp); the rest are its arguments, here
    # mostly small sizes (bytes < 216 give 0..9) and ordinary options, plus a few random ones.
    rnd = random.Random(17)
    crafted = {
        0: [0, 0, 0, 1, 5, 7, 9, 1, 0, 1, 2, 3, 0],                       # sgemm N,T 5x7x9
        1: [1, 0, 5, 9, 1, 1, 1],                                         # softmax 5x9
        2: [2, 1, 2, 7, 9, 2, 1, 8, 1, 4, 15, 0, 0],                      # attention, GQA, valid lens, mask, weights
        3: [3, 1, 3, 4, 5, 6, 1, 7, 3, 2, 1, 1, 2, 1, 4, 1, 0, 1, 0],     # varlen, 3 sequences
        4: [4, 0, 2, 8, 1, 0, 150, 0, 0, 0, 0, 5, 0, 0, 1, 3, 0, 6, 1, 2, 0, 1, 0, 0, 5, 0, 1, 3, 0],  # cache ops
        5: [5, 0, 2, 1, 0, 0, 0, 0, 0, 0, 1, 3, 1, 2, 0, 0],              # layer forward
        6: [6, 0, 2, 1, 5, 0, 1, 0, 0, 0, 0, 0, 0, 1, 0, 3, 1, 0, 2, 0, 1, 2, 1, 2, 0, 1, 0],  # forward_cached
        7: [7, 0, 2, 1, 5, 0, 1, 0, 16, 1, 2, 4, 0, 0, 0],                # encoder, GELU
        8: [8, 4, 4, 2],                                                  # from_in_proj
    }
    for entry, head in crafted.items():
        seed = bytes(rnd.randrange(256) for _ in range(8))
        put("c_abi", "entry%d_crafted" % entry, bytes(head) + seed + bytes(rnd.randrange(100) for _ in range(40)))
        put("c_abi", "entry%d_random" % entry, bytes([entry]) + bytes(rnd.randrange(216) for _ in range(64)))

    # The score modifiers and RoPE, decoded after every other field of their entry (each byte
    # commented; SEED stands for the 8 bytes of the tensors' generator).
    SEED = [0x5e, 0xed, 0x01, 0x23, 0x45, 0x67, 0x89, 0xab]
    variants = {
        # varlen: runtime 0, 2 sequences of 5 and 7 queries over 7 and 9 keys, 2 KV heads x 2
        # (h = 4), head_dim 8, default scale, causal; then window 4, softcap 20.5, ALiBi and sinks
        # (4 heads, slopes and sinks from the generator).
        "entry3_variant": [3, 0, 2, 5, 7, 1, 7, 9, 1, 1, 2, 1, 8, 1, 1, 1, 0] + SEED + [1 | 4 | 16 | 32, 3, 20, 1, 1, 1, 1, 1, 1, 1, 1],
        # layer forward: 2 heads, E 8 (head_dim 4), pre-norm, self-attention, batch 2 of 6 tokens,
        # causal, all biases, weights out; then window 4 and sinks, RoPE over all 4 dims (rotate_half,
        # theta 10000, position_scale 1).
        "entry5_rope_variant": [5, 0, 2, 3, 1 | 4 | 8 | 32 | 64, 0, 2, 0] + SEED +
                               [0, 2, 1, 6, 0, 1, 0, 0, 0, 4, 0] + [1 | 32, 3, 1, 1] + [1, 1, 1, 0],
        # layer forward_varlen: 2 heads, E 8, head_dim 8 (value_dim 4), post-norm, 2 sequences of 5
        # and 3 tokens, causal; then softcap 30.5 and ALiBi, interleaved RoPE over the first 4 of 8
        # dims, theta 100, position_scale 0.5.
        "entry5_varlen_rope_interleaved": [5, 0, 2, 3, 1 | 8 | 32 | 64, 8, 0, 1, 0] + SEED +
                                          [0, 2, 1, 6, 0, 1, 0, 0, 0, 3, 2, 5, 3, 1, 1, 1, 0] + [4 | 16, 30, 1, 1] + [1 | 2, 1, 2, 2],
        # layer forward_cached: 2 heads, E 8, 163 tokens of cache, five steps over sequences 0 and 1
        # (a prefill of 3 and 2 tokens, then single tokens), causal; then window 3 and RoPE over
        # all 4 dims.
        "entry6_rope_window": [6, 0, 2, 3, 1 | 4 | 8, 0, 0, 0] + SEED + [0, 0, 0, 99, 0] +
                              [2, 0, 1, 3, 2, 1, 1, 0] + [2, 0, 1, 1, 1, 1, 1, 0] * 3 + [1, 1, 1, 1, 1, 0] +
                              [1, 2] + [1, 1, 1, 0],
    }
    for name, data in variants.items():
        put("c_abi", name, bytes(data))


if __name__ == "__main__":
    main()
