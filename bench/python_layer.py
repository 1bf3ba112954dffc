#!/usr/bin/python3
"""The Python package's benchmark: mha.torch.MultiheadAttention against the nn.MultiheadAttention it
was made from, timed interleaved (E 512, H 8, self-attention, need_weights=False, eval under
torch.inference_mode()), and the cost of a call through Python: a tiny attention through mha.attention
against the same call through the C ABI by ctypes (the difference is the binding's overhead).

    OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 PYTHONPATH=build/python /usr/bin/python3 bench/python_layer.py --threads 1

Set the thread variables before Python starts: Debian's OpenBLAS ignores torch.set_num_threads.
Prints one JSON object.
"""
import argparse
import ctypes
import json
import os
import sys
import time

# Both sides at their best, as for mha-bench's PyTorch rows: glibc's malloc keeps freed memory
# mapped, so PyTorch does not page-fault a call's intermediates in again on every call.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_anchor import keep_freed_memory  # noqa: E402

keep_freed_memory()

os.environ.setdefault("OPENBLAS_CORETYPE", "SkylakeX" if " avx512f" in open("/proc/cpuinfo").read() else "Haswell")

import numpy as np  # noqa: E402
import torch  # noqa: E402

import mha  # noqa: E402
import mha.torch as mt  # noqa: E402


def interleaved(fns, reps):
    times = [[] for _ in fns]
    for f in fns:
        f()
    for _ in range(reps):
        for i, f in enumerate(fns):
            t = time.perf_counter()
            f()
            times[i].append(time.perf_counter() - t)
    return [sorted(t)[len(t) // 2] for t in times]


class AttentionVariant(ctypes.Structure):  # mha_attention_variant (all zero: none)
    _fields_ = [("window", ctypes.c_int64), ("softcap", ctypes.c_float), ("alibi_slopes", ctypes.c_void_p),
                ("sink_logits", ctypes.c_void_p)]


class AttentionParams(ctypes.Structure):  # mha_attention_params, field for field (include/mha/mha.h)
    _fields_ = [("batch", ctypes.c_int64), ("q_len", ctypes.c_int64), ("kv_len", ctypes.c_int64),
                ("num_heads", ctypes.c_int64), ("num_kv_heads", ctypes.c_int64), ("head_dim", ctypes.c_int64),
                ("value_dim", ctypes.c_int64), ("scale", ctypes.c_float), ("causal", ctypes.c_int),
                ("kv_valid_lens", ctypes.c_void_p), ("mask", ctypes.c_void_p), ("mask_batch_stride", ctypes.c_int64),
                ("mask_row_stride", ctypes.c_int64), ("weights", ctypes.c_void_p), ("variant", AttentionVariant)]


def call_overhead_us(threads):
    """Median time of a 1-query attention through mha.attention minus the same through ctypes."""
    built = os.path.join(os.path.dirname(mha._mha.__file__), "..", "..", "src", "libmha.so")
    lib = ctypes.CDLL(built if os.path.exists(built) else "libmha.so.0")  # the build tree, or installed
    rt_c = ctypes.c_void_p()
    lib.mha_runtime_create(threads, ctypes.byref(rt_c))
    q = np.random.rand(1, 1, 1, 8).astype(np.float32)
    out = np.empty_like(q)
    p = AttentionParams(1, 1, 1, 1, 1, 8, 8, 0.0, 0, None, None, 0, 0, None)
    ptr = ctypes.c_void_p(q.ctypes.data)
    optr = ctypes.c_void_p(out.ctypes.data)
    rt = mha.Runtime(threads=threads)
    py_call = lambda: mha.attention(q, q, q, out=out, runtime=rt)  # noqa: E731
    c_call = lambda: lib.mha_attention(rt_c, ctypes.byref(p), ptr, ptr, ptr, optr)  # noqa: E731
    status = c_call()
    if status != 0:  # an early error return would time nothing
        lib.mha_last_error.restype = ctypes.c_char_p
        raise RuntimeError(f"mha_attention through ctypes returned {status}: {lib.mha_last_error().decode()}")
    t_py, t_c = interleaved([py_call, c_call], 2000)
    lib.mha_runtime_destroy(rt_c)
    return (t_py - t_c) * 1e6, t_py * 1e6, t_c * 1e6


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=9)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rt = mha.Runtime(threads=args.threads)
    rows = []
    for B, L in ((8, 128), (1, 2048)):
        m = torch.nn.MultiheadAttention(512, 8, batch_first=True).eval()
        fast = mt.MultiheadAttention.from_module(m, runtime=rt)
        x = torch.rand(B, L, 512)
        with torch.inference_mode():
            t_torch, t_mha = interleaved([lambda: m(x, x, x, need_weights=False),
                                          lambda: fast(x, x, x, need_weights=False)], args.reps)
        rows.append({"shape": f"B{B} L{L} E512 H8", "torch_ms": t_torch * 1e3, "mha_ms": t_mha * 1e3,
                     "speedup": t_torch / t_mha})
    overhead, t_py, t_c = call_overhead_us(args.threads)
    print(json.dumps({"threads": args.threads, "torch": torch.__version__, "rows": rows,
                      "call_overhead_us": overhead, "tiny_call_python_us": t_py, "tiny_call_c_us": t_c}, indent=1))


if __name__ == "__main__":
    main()
