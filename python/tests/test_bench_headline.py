"""bench/headline.py (the headline ratios of mha-bench runs against the performance targets) on a
run file written here: met, short, invalid anchors, missing rows and the 2-thread rows under 1.0x."""
import importlib.util
import json
import pathlib

HEADLINE = pathlib.Path(__file__).resolve().parents[2] / 'bench' / 'headline.py'
spec = importlib.util.spec_from_file_location('headline', HEADLINE)
headline = importlib.util.module_from_spec(spec)
spec.loader.exec_module(headline)


def row(name, shape, threads, vs, peak=0.5, valid=None):
    return {'name': name, 'shape': shape, 'threads': threads, 'ms': 1.0, 'vs': vs, 'peak_fraction': peak,
            'anchor_valid': valid or {k: True for k in vs}}


def report(tmp_path, capsys, results):
    path = tmp_path / 'run.json'
    path.write_text(json.dumps({'machine': {'cpu': 'test cpu'}, 'peak_gflops_by_threads': {'1': 100.0, '2': 200.0},
                                'results': results}))
    assert headline.main([str(path)]) == 0
    return capsys.readouterr().out


def line(out, what, against):
    found = [l for l in out.splitlines() if what in l and f'vs {against}' in l]
    assert len(found) == 1, out
    return found[0]


def test_met_short_and_the_probe(tmp_path, capsys):
    out = report(tmp_path, capsys, [
        row('gemm/square', '1024x1024x1024 NN', 1, {'oneDNN': 1.02}, peak=0.89),
        row('gemm/attn QK^T', '512x512x64 NT', 1, {'oneDNN': 0.98}),
        row('attention/fused', 'L128 H8 D64', 1, {'blocked': 1.10}),
        row('gemm/square', '1024x1024x1024 NN', 2, {'oneDNN': 0.5}),  # 2 threads: not a target row
    ])
    assert 'test cpu' in out and '100.0 / 200.0' in out
    assert line(out, '1024x1024x1024', 'oneDNN').endswith('1.020x  (at least 1.0x: met)')
    assert line(out, '1024x1024x1024', 'probe').endswith('89.0%  (at least 90%: short)')
    assert line(out, '512x512x64 NT', 'oneDNN').endswith('(at least 1.0x: short)')
    assert line(out, 'L128 H8 D64', 'blocked').endswith('(at least 1.1x: met)')
    assert 'B8 L128' not in out and 'L512' not in out  # rows the run does not hold are left out
    assert '2 threads against 1' not in out


def test_an_anchor_on_the_wrong_threads_is_invalid(tmp_path, capsys):
    out = report(tmp_path, capsys, [
        row('layer/forward', 'B8 L128 E512 H8', 1, {'PyTorch': 1.5, 'oneDNN': 1.2}, valid={'PyTorch': False, 'oneDNN': True}),
        row('layer/forward', 'B1 L2048 E512 H8', 1, {'PyTorch': 2.0}),
    ])
    assert 'met' not in line(out, 'B8 L128', 'PyTorch') and 'invalid' in line(out, 'B8 L128', 'PyTorch')
    assert line(out, 'B1 L2048', 'PyTorch').endswith('(at least 2.2x: short)')


def test_two_thread_rows_under_one_thread_are_listed(tmp_path, capsys):
    out = report(tmp_path, capsys, [
        row('softmax/rows', '64x4096', 2, {'1 thread': 0.97}),
        row('gemm/square', '256x256x256 NN', 2, {'1 thread': 1.4, 'oneDNN': 1.0}),
        row('threads/sgemm', '32^3', 2, {'1 thread': 0.87, 'all threads': 1.2}),
        row('gemm/square', '256x256x256 NN', 1, {'oneDNN': 1.0}),
    ])
    assert '2 threads against 1: 3 rows, 0.87x to 1.40x; 2 below 1.0x:' in out
    listed = out.split('below 1.0x:')[1].split()
    assert ' '.join(listed) == 'threads/sgemm 32^3: 0.870x softmax/rows 64x4096: 0.970x'  # lowest first


def test_no_file_prints_the_usage(capsys):
    assert headline.main([]) == 2
    assert 'mha-bench' in capsys.readouterr().out
