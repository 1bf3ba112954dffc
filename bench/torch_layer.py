#!/usr/bin/python3
"""Times PyTorch's nn.MultiheadAttention(batch_first=True) forward pass, the anchor of the mha-bench
layer suite and bench_layer. Run with Debian's /usr/bin/python3 (python3-torch):

    /usr/bin/python3 bench/torch_layer.py --threads 1 --budget 1.0 B8,L128,E512,H8 B1,L2048,E512,H8

Prints one JSON object: {"torch": "<version>", "threads": N, "ms": {"<shape>": median ms, ...},
"cpu_per_wall": {"<shape>": process CPU time / wall time over the timed runs, ...}}.

    /usr/bin/python3 bench/torch_layer.py --threads 1 --serve B8,L128,E512,H8 ...

is how mha-bench runs it, so that PyTorch's runs interleave with mha's: it builds every layer, prints
one JSON line {"ready": true, "torch": ..., "threads": N}, then for each line "<shape>" read from
stdin runs that layer once and prints "<wall ms> <process CPU ms>", until "quit" or the end of stdin.

Threads: OMP_NUM_THREADS, OPENBLAS_NUM_THREADS and MKL_NUM_THREADS are set to --threads before torch
loads unless the environment sets them (torch.set_num_threads alone leaves Debian's OpenBLAS on every
core), then torch.set_num_threads(N).
With --save DIR, also writes each shape's layer as mha-run reads it: DIR/<shape>/weights/<key>.npy
and DIR/<shape>/query.npy, so `mha-run --weights DIR/<shape>/weights --num-heads H --query
DIR/<shape>/query.npy --threads N --repeat 5 --json` times the same layer on the same input.
need_weights=False, as a server calls it; OPENBLAS_CORETYPE=SkylakeX (Haswell on a CPU without
AVX-512; Debian's OpenBLAS misdetects the CPU otherwise) unless the environment sets it.
"""
import argparse
import json
import os
import sys
import time

def _has_avx512():
    try:
        with open("/proc/cpuinfo") as f:
            return " avx512f" in f.read()
    except OSError:
        return False


def median_ms(fn, budget):
    """Median wall ms of fn, and the process's CPU time over wall time across the timed runs."""
    fn()
    times, cpu, start = [], 0.0, time.perf_counter()
    while len(times) < 3 or time.perf_counter() - start < budget:
        t, c = time.perf_counter(), time.process_time()
        fn()
        cpu += time.process_time() - c
        times.append(time.perf_counter() - t)
    wall = sum(times)
    times.sort()
    return times[len(times) // 2] * 1e3, cpu / wall


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--budget", type=float, default=1.0)
    ap.add_argument("--serve", action="store_true", help="run shapes named on stdin, one line each")
    ap.add_argument("--save", help="write each layer's weights and input as .npy under this directory")
    ap.add_argument("shapes", nargs="+", help="B<b>,L<l>,E<e>,H<h>")
    args = ap.parse_args()
    # Before torch loads: its OpenMP pool and OpenBLAS read these once, when they start.
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(var, str(args.threads))
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # idle threads must not spin on mha's cores
    # SkylakeX's kernels are AVX-512: on a CPU without it (AMD Zen 3) they die with SIGILL.
    os.environ.setdefault("OPENBLAS_CORETYPE", "SkylakeX" if _has_avx512() else "Haswell")
    import torch

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    out, ratio, layers = {}, {}, {}
    with torch.inference_mode():
        for shape in args.shapes:
            dims = {p[0]: int(p[1:]) for p in shape.split(",")}
            m = torch.nn.MultiheadAttention(dims["E"], dims["H"], batch_first=True).eval()
            x = torch.rand(dims["B"], dims["L"], dims["E"])
            layers[shape] = (m, x)
            if args.serve:
                continue
            out[shape], ratio[shape] = median_ms(lambda: m(x, x, x, need_weights=False), args.budget)
            if args.save:
                import numpy as np
                d = os.path.join(args.save, shape.replace(",", "_"))
                os.makedirs(os.path.join(d, "weights"), exist_ok=True)
                for key, t in m.state_dict().items():
                    np.save(os.path.join(d, "weights", key + ".npy"), t.numpy())
                np.save(os.path.join(d, "query.npy"), x.numpy())
        if args.serve:
            for m, x in layers.values():
                m(x, x, x, need_weights=False)  # warm-up
            print(json.dumps({"ready": True, "torch": torch.__version__, "threads": args.threads}), flush=True)
            for line in sys.stdin:
                shape = line.strip()
                if shape == "quit":
                    break
                m, x = layers[shape]
                t, c = time.perf_counter(), time.process_time()
                m(x, x, x, need_weights=False)
                print(f"{(time.perf_counter() - t) * 1e3:.6f} {(time.process_time() - c) * 1e3:.6f}", flush=True)
            return
    print(json.dumps({"torch": torch.__version__, "threads": args.threads, "ms": out, "cpu_per_wall": ratio}))


if __name__ == "__main__":
    main()
