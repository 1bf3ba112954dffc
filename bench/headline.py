#!/usr/bin/python3
"""The headline ratios of mha-bench runs, against the performance targets the README quotes.

    mha-bench --threads 1,2 --filter '^(gemm|attention|layer)/' --json > run.json
    mha-bench --quick --json > quick.json
    /usr/bin/python3 bench/headline.py run.json quick.json

For each file: the machine and FMA probe, then one line per target whose row the run holds (the
GEMM against oneDNN's sgemm and the FMA probe, the layer against PyTorch, the fused attention
against the blocked oneDNN composition, all on one thread), and every row timed on 2 threads beside
the same call on 1. A ratio whose anchor ran on the wrong thread count reads "invalid"; a target
whose row is not in the file is left out.
"""
import json
import sys

# (row name, shape, what it is measured against, the least ratio asked)
TARGETS = [
    ('gemm/square', '1024x1024x1024 NN', 'oneDNN', 1.0),
    ('gemm/square', '1024x1024x1024 NN', 'probe', 0.9),
    ('gemm/square', '2048x2048x2048 NN', 'oneDNN', 1.0),
    ('gemm/attn QK^T', '512x512x64 NT', 'oneDNN', 1.0),
    ('gemm/attn PV', '512x64x512 NN', 'oneDNN', 1.0),
    ('gemm/proj QKV', '4096x1536x512 NT', 'oneDNN', 1.0),
    ('layer/forward', 'B8 L128 E512 H8', 'PyTorch', 1.4),
    ('layer/forward', 'B1 L2048 E512 H8', 'PyTorch', 2.2),
    ('attention/fused', 'L128 H8 D64', 'blocked', 1.1),
    ('attention/fused', 'L128 H8 D128', 'blocked', 1.1),
    ('attention/fused', 'L512 H8 D64', 'blocked', 1.1),
    ('attention/fused', 'L512 H8 D128', 'blocked', 1.1),
]


def ratio(row, against):
    """The row's ratio against `against` (the FMA probe's fraction for 'probe'), or None if invalid."""
    if against == 'probe':
        return row.get('peak_fraction')
    if not row.get('anchor_valid', {}).get(against, True):
        return None
    return row.get('vs', {}).get(against)


def report(path):
    with open(path) as f:
        run = json.load(f)
    rows = {(r['name'], r['shape'], r['threads']): r for r in run['results']}
    probe = run.get('peak_gflops_by_threads', {})
    print(f"{path}: {run.get('machine', '?')}; FMA probe {probe.get('1', 0):.1f} / {probe.get('2', 0):.1f} GFLOP/s")
    for name, shape, against, least in TARGETS:
        row = rows.get((name, shape, 1))
        if row is None or (against != 'probe' and against not in row.get('vs', {})):
            continue
        r = ratio(row, against)
        what = f"{name} {shape}"
        if r is None:
            print(f"  {what:<42} vs {against:<8} invalid (the anchor's threads)")
            continue
        shown = f"{r * 100:.1f}%" if against == 'probe' else f"{r:.3f}x"
        asked = f"{least * 100:.0f}%" if against == 'probe' else f"{least:.1f}x"
        print(f"  {what:<42} vs {against:<8} {shown:>8}  (at least {asked}: {'met' if r >= least else 'short'})")
    two = [(k, r['vs']['1 thread']) for k, r in rows.items() if k[2] == 2 and '1 thread' in r.get('vs', {})]
    if two:
        low = [(k, x) for k, x in two if x < 1.0]
        print(f"  2 threads against 1: {len(two)} rows, {min(x for _, x in two):.2f}x to {max(x for _, x in two):.2f}x;"
              f" {len(low)} below 1.0x{':' if low else ''}")
        for (name, shape, _), x in sorted(low, key=lambda e: e[1]):
            print(f"    {name} {shape}: {x:.3f}x")


def main(paths):
    if not paths:
        print(__doc__.strip())
        return 2
    for i, path in enumerate(paths):
        if i:
            print()
        report(path)
    return 0


if __name__ == '__main__':
    sys.exit(main(sys.argv[1:]))
