"""The Python package against numpy double-precision references: attention (masks, valid lengths,
GQA, weights), ragged attention, the KV cache, sgemm, softmax, the layer; bad input; zero copies;
threads sharing a runtime; no leaks. Run by tools/test with Debian's /usr/bin/python3."""
import gc
import sys
import threading

import numpy as np
import pytest

import mha

RNG = np.random.default_rng(7)


def rand(*shape):
    return RNG.uniform(-1, 1, size=shape).astype(np.float32)


def ref_attention(q, k, v, causal=False, mask=None, valid=None, scale=None, window=0, softcap=0.0, slopes=None, sinks=None):
    """q (B, Lq, H, D), k (B, Lk, Hkv, D), v (B, Lk, Hkv, Dv) -> out, weights in float64. Query i is at
    position p = i + Lk - Lq and key j at j; key j is visible iff j > p - window (window > 0), j <= p
    (causal), j < valid[b] and the mask allows it; s = scale q.k, then s = cap tanh(s / cap), then s += slope[h] (j - p);
    a sink adds exp(sink[h]) to each row's denominator with no value."""
    q, k, v = (x.astype(np.float64) for x in (q, k, v))
    B, Lq, H, D = q.shape
    Lk, Hkv, Dv = k.shape[1], k.shape[2], v.shape[3]
    scale = 1 / np.sqrt(D) if scale is None else scale
    pos = np.arange(Lq)[:, None] + Lk - Lq
    j = np.arange(Lk)[None, :]
    out = np.zeros((B, Lq, H, Dv))
    weights = np.zeros((B, H, Lq, Lk))
    for b in range(B):
        for h in range(H):
            g = h // (H // Hkv)
            s = q[b, :, h] @ k[b, :, g].T * scale
            if softcap:
                s = softcap * np.tanh(s / softcap)
            if slopes is not None:
                s = s + float(slopes[h]) * (j - pos)
            ok = np.ones((Lq, Lk), dtype=bool)
            if causal:
                ok &= j <= pos
            if window:
                ok &= j > pos - window
            if valid is not None:
                ok &= j < valid[b]
            if mask is not None:
                ok &= np.broadcast_to(mask, (B, Lq, Lk))[b].astype(bool)
            s = np.where(ok, s, -np.inf)
            m = s.max(axis=1, keepdims=True)
            if sinks is not None:
                m = np.maximum(m, float(sinks[h]))
            m = np.where(np.isfinite(m), m, 0)
            e = np.where(ok, np.exp(s - m), 0)
            tot = e.sum(axis=1, keepdims=True)
            if sinks is not None:
                tot = tot + np.where(ok.any(axis=1, keepdims=True), np.exp(float(sinks[h]) - m), 0)
            p = np.divide(e, tot, out=np.zeros_like(e), where=tot > 0)
            weights[b, h] = p
            out[b, :, h] = p @ v[b, :, g]
    return out, weights


def close(got, want, tol=1e-4):
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)


def test_runtime_properties():
    rt = mha.Runtime(threads=2)
    assert rt.threads == 2
    assert rt.isa in ("avx2", "avx512")
    assert rt.scratch_bytes >= 0
    assert mha.default_runtime() is mha.default_runtime()


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("H,Hkv", [(4, 4), (8, 2), (4, 1)])
def test_attention_against_double(causal, H, Hkv):
    B, Lq, Lk, D, Dv = 2, 7, 11, 13, 6
    q, k, v = rand(B, Lq, H, D), rand(B, Lk, Hkv, D), rand(B, Lk, Hkv, Dv)
    mask = RNG.uniform(size=(B, 1, Lk)) > 0.3
    valid = np.array([11, 4], dtype=np.int32)
    out, w = mha.attention(q, k, v, causal=causal, mask=mask, valid_lens=valid, need_weights=True)
    want, want_w = ref_attention(q, k, v, causal, mask, valid)
    close(out, want)
    close(w, want_w)
    assert out.shape == (B, Lq, H, Dv) and w.shape == (B, H, Lq, Lk)


def test_attention_scale_and_full_mask_shapes():
    q, k, v = rand(1, 5, 2, 8), rand(1, 6, 2, 8), rand(1, 6, 2, 8)
    for mask in (RNG.uniform(size=(5, 6)) > 0.5, RNG.uniform(size=(1, 5, 6)) > 0.5):
        close(mha.attention(q, k, v, mask=mask, scale=0.3), ref_attention(q, k, v, mask=mask, scale=0.3)[0])


def test_attention_out_is_written_in_place():
    q, k, v = rand(1, 4, 2, 8), rand(1, 4, 2, 8), rand(1, 4, 2, 8)
    out = np.empty((1, 4, 2, 8), dtype=np.float32)
    res = mha.attention(q, k, v, out=out)
    assert res is out or np.shares_memory(res, out)
    close(out, ref_attention(q, k, v)[0])


def test_attention_out_may_be_q_itself():
    # in place: the bits of a separate out (GQA, causal); refused with the weights
    q, k, v = rand(2, 37, 4, 16), rand(2, 37, 2, 16), rand(2, 37, 2, 16)
    want = mha.attention(q, k, v, causal=True)
    x = q.copy()
    res = mha.attention(x, k, v, causal=True, out=x)
    assert np.shares_memory(res, x)
    assert np.array_equal(x.view(np.uint32), want.view(np.uint32))
    x = q.copy()
    with pytest.raises(ValueError, match="in-place attention"):
        mha.attention(x, k, v, need_weights=True, out=x)
    assert np.array_equal(x, q)


def test_bad_input_raises_naming_the_argument():
    q, k, v = rand(1, 4, 2, 8), rand(1, 4, 2, 8), rand(1, 4, 2, 8)
    with pytest.raises(TypeError, match=r"\bq\b.*float32.*float64"):
        mha.attention(q.astype(np.float64), k, v)
    with pytest.raises(ValueError, match=r"\bk\b.*C-contiguous"):
        mha.attention(q, np.asfortranarray(k), v)
    with pytest.raises(TypeError, match=r"\bv\b"):
        mha.attention(q, k, [[1.0]])
    with pytest.raises(ValueError, match=r"\bq\b.*4-D"):
        mha.attention(q[0], k, v)
    with pytest.raises(ValueError, match="out"):
        mha.attention(q, k, v, out=np.empty((1, 4, 2, 7), dtype=np.float32))
    with pytest.raises(ValueError, match="mask"):
        mha.attention(q, k, v, mask=np.ones((3, 3), dtype=bool))
    with pytest.raises(ValueError, match="valid_lens"):  # the library's check, as ValueError
        mha.attention(q, k, v, valid_lens=np.array([9], dtype=np.int32))
    # copy=True converts instead of refusing
    close(mha.attention(q.astype(np.float64), np.asfortranarray(k), v, copy=True), ref_attention(q, k, v)[0])


def test_attention_varlen_gives_each_sequence_its_own_bits():
    H, Hkv, D = 4, 2, 16
    lens = [5, 0, 1, 300]
    seqs = [(rand(n, H, D), rand(n, Hkv, D), rand(n, Hkv, D)) for n in lens]
    off = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    q = np.concatenate([s[0] for s in seqs])
    k = np.concatenate([s[1] for s in seqs])
    v = np.concatenate([s[2] for s in seqs])
    out = mha.attention_varlen(q, k, v, off, off, causal=True)
    for i, (sq, sk, sv) in enumerate(seqs):
        if lens[i] == 0:
            continue
        alone = mha.attention(sq[None], sk[None], sv[None], causal=True)[0]
        assert np.array_equal(out[off[i]:off[i + 1]], alone)
        close(alone, ref_attention(sq[None], sk[None], sv[None], causal=True)[0][0])


def test_kv_cache_prefill_and_decode_match_dense_bits():
    H, Hkv, D, L = 4, 2, 16, 70
    q, k, v = rand(L, H, D), rand(L, Hkv, D), rand(L, Hkv, D)
    full = mha.attention(q[None], k[None], v[None], causal=True)[0]
    cache = mha.KVCache(Hkv, D, D, 1024)
    cache.append(3, k[:40], v[:40])
    got = [cache.attention(q[:40], [3], [0, 40], causal=True)]
    for t in range(40, L):
        cache.append(3, k[t:t + 1], v[t:t + 1])
        got.append(cache.attention(q[t:t + 1], [3], [0, 1], causal=True))
    assert np.array_equal(np.concatenate(got), full)
    assert cache.seq_len(3) == L and 3 in cache
    rk, rv = cache.read(3)
    assert np.array_equal(rk, k) and np.array_equal(rv, v)
    free = cache.free_tokens
    cache.fork(3, 4)
    cache.release(3)
    assert cache.free_tokens == free  # the fork still holds the blocks
    cache.release(4)
    assert cache.free_tokens == 1024 // cache.block_tokens * cache.block_tokens


def test_kv_cache_errors():
    cache = mha.KVCache(2, 8, 8, 64)
    with pytest.raises(ValueError, match="seq_id"):
        cache.seq_len(9)
    with pytest.raises(MemoryError, match="nothing was appended"):
        cache.append(1, rand(1000, 2, 8), rand(1000, 2, 8))
    with pytest.raises(ValueError, match="seq_ids"):
        cache.attention(rand(1, 4, 8), [5], [0, 1])
    with pytest.raises(ValueError, match="k must be"):
        cache.append(1, rand(3, 1, 8), rand(3, 2, 8))


def test_sgemm_and_softmax_against_numpy():
    a, b = rand(37, 19), rand(23, 19)
    close(mha.sgemm(a, b, trans_b=True), a.astype(np.float64) @ b.T.astype(np.float64), 1e-4)
    c = rand(37, 23)
    c0 = c.copy()
    res = mha.sgemm(a, b, trans_b=True, alpha=0.5, beta=2.0, c=c)
    assert np.shares_memory(res, c)
    close(c, 0.5 * (a.astype(np.float64) @ b.T) + 2.0 * c0, 1e-4)
    x = rand(5, 33) * 10
    e = np.exp(x - x.max(axis=1, keepdims=True))
    close(mha.softmax(x), e / e.sum(axis=1, keepdims=True), 1e-5)
    with pytest.raises(ValueError, match="chain"):
        mha.sgemm(a, b)


def test_packed_b_gives_sgemm_bits():
    rt = mha.Runtime(threads=2)
    w, x = rand(70, 600), rand(37, 600)  # w as nn.Linear stores a weight: (out, in)
    pb = mha.PackedB(w, trans_b=True, runtime=rt)
    assert (pb.k, pb.n) == (600, 70) and pb.nbytes >= 600 * 70 * 4
    got = pb.matmul(x)
    want = mha.sgemm(x, w, trans_b=True, runtime=rt)
    assert got.tobytes() == want.tobytes()
    close(got, x.astype(np.float64) @ w.T.astype(np.float64), 1e-4)
    c = rand(37, 70)
    c0 = c.copy()
    res = pb.matmul(x.T.copy(), trans_a=True, alpha=0.5, beta=2.0, c=c)
    assert np.shares_memory(res, c)
    close(c, 0.5 * (x.astype(np.float64) @ w.T) + 2.0 * c0, 1e-4)
    with pytest.raises(ValueError, match="chain"):
        pb.matmul(rand(3, 599))
    with pytest.raises(ValueError, match="beta"):
        pb.matmul(x, beta=1.0)
    with pytest.raises(TypeError, match="float32"):
        mha.PackedB(w.astype(np.float64))


def test_layer_against_numpy_reference():
    E, H, B, L = 16, 4, 2, 5
    w = {n: rand(E, E) * 0.5 for n in ("q", "k", "v", "o")}
    bias = {n: rand(E) for n in ("q", "k", "v", "o")}
    layer = mha.Layer(E, H, q_weight=w["q"], k_weight=w["k"], v_weight=w["v"], out_weight=w["o"],
                      q_bias=bias["q"], k_bias=bias["k"], v_bias=bias["v"], out_bias=bias["o"])
    x = rand(B, L, E)
    x64 = x.astype(np.float64)
    proj = {n: x64 @ w[n].T.astype(np.float64) + bias[n] for n in ("q", "k", "v")}
    o, _ = ref_attention(*(proj[n].reshape(B, L, H, E // H) for n in ("q", "k", "v")), causal=True)
    want = o.reshape(B, L, E) @ w["o"].T.astype(np.float64) + bias["o"]
    close(layer.forward(x, causal=True), want)
    out, weights = layer.forward(x, x, x, need_weights=True)
    assert weights.shape == (B, H, L, L)
    with pytest.raises(ValueError, match="q_weight"):
        mha.Layer(E, H, q_weight=rand(3, 3), k_weight=w["k"], v_weight=w["v"], out_weight=w["o"])


def test_threads_share_one_runtime_with_the_lone_callers_bits():
    rt = mha.Runtime(threads=2)
    q, k, v = rand(2, 64, 4, 32), rand(2, 64, 4, 32), rand(2, 64, 4, 32)
    want = mha.attention(q, k, v, causal=True, runtime=rt)
    results, errors = [None] * 8, []

    def run(i):
        try:
            for _ in range(5):
                results[i] = mha.attention(q, k, v, causal=True, runtime=rt)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert all(np.array_equal(r, want) for r in results)


def test_repeated_calls_leak_no_objects():
    q, k, v = rand(1, 8, 2, 8), rand(1, 8, 2, 8), rand(1, 8, 2, 8)
    out = np.empty((1, 8, 2, 8), dtype=np.float32)
    for _ in range(10):
        mha.attention(q, k, v, out=out)
    gc.collect()
    refs = [sys.getrefcount(a) for a in (q, k, v, out)]
    objects = len(gc.get_objects())
    for _ in range(200):
        mha.attention(q, k, v, out=out)
        try:
            mha.attention(q.astype(np.float64), k, v)
        except TypeError:
            pass
    gc.collect()
    assert [sys.getrefcount(a) for a in (q, k, v, out)] == refs
    assert len(gc.get_objects()) <= objects + 10
