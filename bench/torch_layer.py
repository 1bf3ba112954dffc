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

from torch_anchor import import_torch, median_ms, serve


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--budget", type=float, default=1.0)
    ap.add_argument("--serve", action="store_true", help="run shapes named on stdin, one line each")
    ap.add_argument("--save", help="write each layer's weights and input as .npy under this directory")
    ap.add_argument("shapes", nargs="+", help="B<b>,L<l>,E<e>,H<h>")
    args = ap.parse_args()
    torch = import_torch(args.threads)
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
            serve({shape: (lambda m=m, x=x: m(x, x, x, need_weights=False)) for shape, (m, x) in layers.items()},
                  {"torch": torch.__version__, "threads": args.threads})
            return
    print(json.dumps({"torch": torch.__version__, "threads": args.threads, "ms": out, "cpu_per_wall": ratio}))


if __name__ == "__main__":
    main()
