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


def keep_freed_memory():
    """glibc's malloc returns a freed block over its mmap threshold to the kernel, and PyTorch's
    CPU allocator frees a call's intermediates (6 MiB of QKV at B8 L128 E512) when the call ends:
    every call then page-faults them in again. Measured on Zen 5, 1 thread: B8 L128 E512 19-20 ms
    a call by default, 14 ms with these settings (and 14 ms when an earlier, larger layer in the
    same process had raised glibc's adaptive threshold, which made the anchor bimodal). glibc reads
    them when the process starts, so this restarts the script once with them set. (mha-bench sets
    the same values for its PyTorch child: bench_support.cpp, torch_malloc_env.)"""
    tunables = {"MALLOC_MMAP_THRESHOLD_": "1073741824", "MALLOC_TRIM_THRESHOLD_": "4294967296"}
    if any(name not in os.environ for name in tunables):
        for name, value in tunables.items():
            os.environ.setdefault(name, value)
        os.execv(sys.executable, [sys.executable] + sys.argv)


def import_torch(threads):
    """Pins every thread pool PyTorch may use to `threads` (unless the environment already does),
    keeps glibc's malloc from unmapping freed memory (keep_freed_memory), then imports torch:
    OMP_NUM_THREADS, OPENBLAS_NUM_THREADS and MKL_NUM_THREADS are read once, when the libraries
    load, and torch.set_num_threads alone leaves Debian's OpenBLAS on every core.
    OPENBLAS_CORETYPE=SkylakeX (Haswell on a CPU without AVX-512, whose SkylakeX kernels die with
    SIGILL): Debian's OpenBLAS misdetects these CPUs otherwise."""
    keep_freed_memory()
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
