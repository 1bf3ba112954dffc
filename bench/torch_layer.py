#!/usr/bin/python3
"""Times PyTorch's nn.MultiheadAttention(batch_first=True) forward pass, the anchor of the mha-bench
layer suite and bench_layer. Run with Debian's /usr/bin/python3 (python3-torch):

    /usr/bin/python3 bench/torch_layer.py --threads 1 --budget 1.0 B8,L128,E512,H8 B1,L2048,E512,H8

Prints one JSON object: {"torch": "<version>", "threads": N, "ms": {"<shape>": median ms, ...}}.
With --save DIR, also writes each shape's layer as mha-run reads it: DIR/<shape>/weights/<key>.npy
and DIR/<shape>/query.npy, so `mha-run --weights DIR/<shape>/weights --num-heads H --query
DIR/<shape>/query.npy --threads N --repeat 5 --json` times the same layer on the same input.
need_weights=False, as a server calls it; OPENBLAS_CORETYPE=SkylakeX (Haswell on a CPU without
AVX-512; Debian's OpenBLAS misdetects the CPU otherwise) unless the environment sets it.
"""
import argparse
import json
import os
import time

def _has_avx512():
    try:
        with open("/proc/cpuinfo") as f:
            return " avx512f" in f.read()
    except OSError:
        return False


# SkylakeX's kernels are AVX-512: on a CPU without it (AMD Zen 3) they die with SIGILL.
os.environ.setdefault("OPENBLAS_CORETYPE", "SkylakeX" if _has_avx512() else "Haswell")

import torch  # noqa: E402


def median_ms(fn, budget):
    fn()
    times, start = [], time.perf_counter()
    while len(times) < 3 or time.perf_counter() - start < budget:
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    times.sort()
    return times[len(times) // 2] * 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--budget", type=float, default=1.0)
    ap.add_argument("--save", help="write each layer's weights and input as .npy under this directory")
    ap.add_argument("shapes", nargs="+", help="B<b>,L<l>,E<e>,H<h>")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    out = {}
    with torch.inference_mode():
        for shape in args.shapes:
            dims = {p[0]: int(p[1:]) for p in shape.split(",")}
            m = torch.nn.MultiheadAttention(dims["E"], dims["H"], batch_first=True).eval()
            x = torch.rand(dims["B"], dims["L"], dims["E"])
            out[shape] = median_ms(lambda: m(x, x, x, need_weights=False), args.budget)
            if args.save:
                import numpy as np
                d = os.path.join(args.save, shape.replace(",", "_"))
                os.makedirs(os.path.join(d, "weights"), exist_ok=True)
                for key, t in m.state_dict().items():
                    np.save(os.path.join(d, "weights", key + ".npy"), t.numpy())
                np.save(os.path.join(d, "query.npy"), x.numpy())
    print(json.dumps({"torch": torch.__version__, "threads": args.threads, "ms": out}))


if __name__ == "__main__":
    main()
