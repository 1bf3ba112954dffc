#!/usr/bin/python3
"""Times PyTorch's nn.TransformerEncoderLayer(batch_first=True) in eval mode under
torch.inference_mode() (its fused fast path, torch._transformer_encoder_layer_fwd), the anchor of
mha-bench's encoder suite. Run with Debian's /usr/bin/python3 (python3-torch 1.13):

    /usr/bin/python3 bench/torch_encoder.py --threads 1 --budget 1.0 B8,L128,E512,H8,F2048

prints one JSON object: {"torch": "<version>", "threads": N, "fast_path": {"<shape>": true, ...},
"ms": {"<shape>": median ms, ...}}. fast_path says whether the profiler saw the fused kernel.

    /usr/bin/python3 bench/torch_encoder.py --threads 1 --serve B8,L128,E512,H8,F2048 ...

is how mha-bench runs it, so that PyTorch's runs interleave with mha's and oneDNN's: it builds every
layer, prints one JSON line {"ready": true, "torch": ..., "threads": N, "fast_path": {...}}, then for
each line "<shape>" read from stdin runs that layer once and prints its wall time and the process's
CPU time in ms ("<ms> <cpu ms>") on one line, until "quit" or the end of stdin.

Threads: OMP_NUM_THREADS, OPENBLAS_NUM_THREADS and MKL_NUM_THREADS are set to --threads before torch
loads (torch.set_num_threads alone leaves Debian's OpenBLAS on every core), then
torch.set_num_threads(N). OPENBLAS_CORETYPE=SkylakeX (Haswell on a CPU without AVX-512; Debian's
OpenBLAS misdetects the CPU otherwise) unless the environment sets it.

With --save DIR, also writes each shape's layer as mha-run reads it: DIR/<shape>/weights/<key>.npy
and DIR/<shape>/query.npy, so `mha-run --weights DIR/<shape>/weights --num-heads H --encoder-layers 1
--query DIR/<shape>/query.npy --threads N --repeat 5 --json` times the same layer on the same input.
--activation gelu and --norm-first build those layers instead of the default (relu, post-norm).
"""
import argparse
import json
import os

from torch_anchor import import_torch, median_ms, serve


def parse_shape(shape):
    dims = {p[0]: int(p[1:]) for p in shape.split(",")}
    for k in "BLEHF":
        if k not in dims:
            raise SystemExit(f"torch_encoder.py: shape {shape!r} lacks {k} (expected B<b>,L<l>,E<e>,H<h>,F<f>)")
    return dims


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--budget", type=float, default=1.0)
    ap.add_argument("--serve", action="store_true", help="run shapes named on stdin, one line each")
    ap.add_argument("--save", help="write each layer's weights and input as .npy under this directory")
    ap.add_argument("--activation", choices=["relu", "gelu"], default="relu")
    ap.add_argument("--norm-first", action="store_true")
    ap.add_argument("shapes", nargs="+", help="B<b>,L<l>,E<e>,H<h>,F<f>")
    args = ap.parse_args()

    torch = import_torch(args.threads)
    layers, fast = {}, {}
    with torch.inference_mode():
        for shape in args.shapes:
            d = parse_shape(shape)
            m = torch.nn.TransformerEncoderLayer(d["E"], d["H"], dim_feedforward=d["F"], dropout=0.0,
                                                 activation=args.activation, batch_first=True,
                                                 norm_first=args.norm_first).eval()
            x = torch.rand(d["B"], d["L"], d["E"])
            layers[shape] = (m, x)
            # Did it take the fused path? Ask the profiler on a short input.
            with torch.autograd.profiler.profile() as prof:
                m(torch.rand(1, 4, d["E"]))
            fast[shape] = any("_transformer_encoder_layer_fwd" in e.name for e in prof.function_events)
            if args.save:
                import numpy as np
                out = os.path.join(args.save, shape.replace(",", "_"))
                os.makedirs(os.path.join(out, "weights"), exist_ok=True)
                for key, t in m.state_dict().items():
                    np.save(os.path.join(out, "weights", key + ".npy"), t.numpy())
                np.save(os.path.join(out, "query.npy"), x.numpy())

        if args.serve:
            serve({shape: (lambda m=m, x=x: m(x)) for shape, (m, x) in layers.items()},
                  {"torch": torch.__version__, "threads": args.threads, "fast_path": fast})
            return

        timed = {shape: median_ms(lambda: m(x), args.budget) for shape, (m, x) in layers.items()}
    print(json.dumps({"torch": torch.__version__, "threads": args.threads, "fast_path": fast,
                      "ms": {s: t[0] for s, t in timed.items()}, "cpu_per_wall": {s: t[1] for s, t in timed.items()}}))


if __name__ == "__main__":
    main()
