"""What bench/torch_layer.py and bench/torch_encoder.py share: pinning PyTorch's threads before it
loads, timing a module with its CPU time, and the --serve loop through which mha-bench interleaves
PyTorch's runs with its own."""
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


def import_torch(threads):
    """Pins every thread pool PyTorch may use to `threads` (unless the environment already does),
    then imports torch: OMP_NUM_THREADS, OPENBLAS_NUM_THREADS and MKL_NUM_THREADS are read once,
    when the libraries load, and torch.set_num_threads alone leaves Debian's OpenBLAS on every core.
    OPENBLAS_CORETYPE=SkylakeX (Haswell on a CPU without AVX-512, whose SkylakeX kernels die with
    SIGILL): Debian's OpenBLAS misdetects these CPUs otherwise."""
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(var, str(threads))
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # idle threads must not spin on mha's cores
    os.environ.setdefault("OPENBLAS_CORETYPE", "SkylakeX" if _has_avx512() else "Haswell")
    import torch

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    return torch


def median_ms(fn, budget):
    """Median wall ms of fn after a warm-up, and the process's CPU time over wall time across the
    timed runs (how many threads it kept busy)."""
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


def serve(runs, ready):
    """runs: {shape: fn}. Warms each up, prints `ready` as one JSON line, then for each line
    "<shape>" on stdin runs that fn once and prints "<wall ms> <process CPU ms>", until "quit"."""
    for fn in runs.values():
        fn()
    print(json.dumps(dict(ready, ready=True)), flush=True)
    for line in sys.stdin:
        shape = line.strip()
        if shape == "quit":
            break
        t, c = time.perf_counter(), time.process_time()
        runs[shape]()
        print(f"{(time.perf_counter() - t) * 1e3:.6f} {(time.process_time() - c) * 1e3:.6f}", flush=True)
