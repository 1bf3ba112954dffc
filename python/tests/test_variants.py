"""The score modifiers (window, softcap, ALiBi slopes, sinks), RoPE in the layer and the KV cache's
storage type and window, from Python, against numpy float64 references written here straight from
the definitions in mha.h; and their bad values as ValueError naming the field. Run by tools/test
with Debian's /usr/bin/python3."""
import numpy as np
import pytest

import mha
from test_core import ref_attention  # the one float64 reference, modifiers included

RNG = np.random.default_rng(11)


def rand(*shape):
    return RNG.uniform(-1, 1, size=shape).astype(np.float32)


def close(got, want, tol=1e-5):
    np.testing.assert_allclose(got, want, rtol=0, atol=tol)


def slopes_for(H):
    return (2.0 ** (-8.0 * np.arange(1, H + 1) / H)).astype(np.float32)  # ALiBi's geometric slopes


def sinks_for(H):
    return RNG.uniform(-1, 2, size=H).astype(np.float32)


MODIFIERS = {
    "window": lambda H: dict(window=4),
    "softcap": lambda H: dict(softcap=1.5),
    "alibi": lambda H: dict(alibi_slopes=slopes_for(H)),
    "sinks": lambda H: dict(sinks=sinks_for(H)),
    "all": lambda H: dict(window=5, softcap=2.0, alibi_slopes=slopes_for(H), sinks=sinks_for(H)),
}


def ref_kwargs(kw):
    return dict(window=kw.get("window", 0), softcap=kw.get("softcap", 0.0), slopes=kw.get("alibi_slopes"),
                sinks=kw.get("sinks"))


@pytest.mark.parametrize("which", list(MODIFIERS))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("H,Hkv", [(4, 4), (6, 2), (4, 1)])
def test_attention_modifiers_against_double(which, causal, H, Hkv):
    B, Lq, Lk, D, Dv = 2, 5, 12, 16, 8
    q, k, v = rand(B, Lq, H, D) * 3, rand(B, Lk, Hkv, D) * 3, rand(B, Lk, Hkv, Dv)  # scores up to ~10: caps bite
    kw = MODIFIERS[which](H)
    out, w = mha.attention(q, k, v, causal=causal, need_weights=True, **kw)
    want, want_w = ref_attention(q, k, v, causal=causal, **ref_kwargs(kw))
    close(out, want)
    close(w, want_w)
    # The modifier does something here (so the test would notice one that is ignored).
    plain = ref_attention(q, k, v, causal=causal)[0]
    assert np.abs(want - plain).max() > 1e-3


def test_attention_modifiers_with_masks_and_scale():
    B, Lq, Lk, H, D = 2, 6, 9, 4, 8
    q, k, v = rand(B, Lq, H, D), rand(B, Lk, 2, D), rand(B, Lk, 2, D)
    mask = RNG.uniform(size=(B, 1, Lk)) > 0.3
    kw = MODIFIERS["all"](H)
    out = mha.attention(q, k, v, causal=True, mask=mask, scale=0.7, **kw)
    close(out, ref_attention(q, k, v, causal=True, mask=mask, scale=0.7, **ref_kwargs(kw))[0])


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("Lq,Lk,W", [(7, 7, 3), (4, 40, 9), (33, 70, 1), (16, 100, 64)])
def test_window_has_the_bits_of_the_same_band_as_a_mask(causal, Lq, Lk, W):
    B, H, D = 2, 4, 16
    q, k, v = rand(B, Lq, H, D), rand(B, Lk, 2, D), rand(B, Lk, 2, D)
    pos = np.arange(Lq)[:, None] + Lk - Lq
    j = np.arange(Lk)[None, :]
    band = j > pos - W
    if causal:
        band &= j <= pos
    by_window = mha.attention(q, k, v, causal=causal, window=W)
    by_mask = mha.attention(q, k, v, mask=band)
    assert np.array_equal(by_window, by_mask)
    close(by_window, ref_attention(q, k, v, causal=causal, window=W)[0])


def test_varlen_and_cache_take_the_modifiers_with_positions_per_sequence():
    H, Hkv, D = 4, 2, 16
    kw = MODIFIERS["all"](H)
    lens = [(3, 10), (6, 6), (1, 17)]  # (q_len, kv_len)
    seqs = [(rand(lq, H, D) * 2, rand(lk, Hkv, D) * 2, rand(lk, Hkv, D)) for lq, lk in lens]
    qo = np.concatenate([[0], np.cumsum([lq for lq, _ in lens])]).astype(np.int64)
    ko = np.concatenate([[0], np.cumsum([lk for _, lk in lens])]).astype(np.int64)
    q, k, v = (np.concatenate([s[i] for s in seqs]) for i in range(3))
    out = mha.attention_varlen(q, k, v, qo, ko, causal=True, **kw)
    cache = mha.KVCache(Hkv, D, D, 1024)
    for sid, (_, sk, sv) in enumerate(seqs):
        cache.append(sid, sk, sv)
    cached = cache.attention(q, [0, 1, 2], qo, causal=True, **kw)
    for s, (sq, sk, sv) in enumerate(seqs):
        dense = mha.attention(sq[None], sk[None], sv[None], causal=True, **kw)[0]
        assert np.array_equal(out[qo[s]:qo[s + 1]], dense)
        assert np.array_equal(cached[qo[s]:qo[s + 1]], dense)
        close(dense, ref_attention(sq[None], sk[None], sv[None], causal=True, **ref_kwargs(kw))[0][0])


# ---- RoPE in the layer -------------------------------------------------------------------------

def rotate(x, positions, dims, theta, scale, interleaved):
    """x (B, L, heads, head_dim) float64: the first dims of every head turned by positions[t] * scale *
    theta^(-2d/dims), pairs (x[d], x[d + dims/2]) or, interleaved, (x[2d], x[2d+1])."""
    x = x.copy()
    half = dims // 2
    ang = positions[:, None] * scale * theta ** (-2.0 * np.arange(half) / dims)  # (L, half)
    c, s = np.cos(ang)[None, :, None, :], np.sin(ang)[None, :, None, :]
    if interleaved:
        a, b = x[..., 0:dims:2].copy(), x[..., 1:dims:2].copy()
        x[..., 0:dims:2], x[..., 1:dims:2] = a * c - b * s, b * c + a * s
    else:
        a, b = x[..., :half].copy(), x[..., half:dims].copy()
        x[..., :half], x[..., half:dims] = a * c - b * s, b * c + a * s
    return x


def make_layer_weights(E, H, Hkv, hd, kdim):
    return dict(q_weight=rand(H * hd, E) * 0.5, k_weight=rand(Hkv * hd, kdim) * 0.5,
                v_weight=rand(Hkv * hd, kdim) * 0.5, out_weight=rand(E, H * hd) * 0.5,
                q_bias=rand(H * hd), k_bias=rand(Hkv * hd), v_bias=rand(Hkv * hd), out_bias=rand(E))


def ref_layer(w, x, kv, H, Hkv, hd, causal, rope=None, **variant):
    x64, kv64 = x.astype(np.float64), kv.astype(np.float64)
    B, Lq, _ = x.shape
    Lk = kv.shape[1]
    f = {n: w[n].astype(np.float64) for n in w}
    q = (x64 @ f["q_weight"].T + f["q_bias"]).reshape(B, Lq, H, hd)
    k = (kv64 @ f["k_weight"].T + f["k_bias"]).reshape(B, Lk, Hkv, hd)
    v = (kv64 @ f["v_weight"].T + f["v_bias"]).reshape(B, Lk, Hkv, hd)
    if rope:
        q = rotate(q, np.arange(Lq) + Lk - Lq, **rope)
        k = rotate(k, np.arange(Lk), **rope)
    o, _ = ref_attention(q, k, v, causal=causal, **variant)
    return o.reshape(B, Lq, H * hd) @ f["out_weight"].T + f["out_bias"]


ROPES = [  # (rope_dims, rope_theta, rope_interleaved, rope_position_scale)
    (8, 0.0, False, 0.0),
    (8, 0.0, True, 0.0),
    (4, 500.0, False, 0.5),
    (6, 20.0, True, 3.0),
]


@pytest.mark.parametrize("dims,theta,interleaved,pscale", ROPES)
@pytest.mark.parametrize("cross", [False, True])
def test_layer_rope_against_double(dims, theta, interleaved, pscale, cross):
    E, H, Hkv, hd, B, Lq = 24, 4, 2, 8, 2, 5
    Lk = 9 if cross else Lq
    w = make_layer_weights(E, H, Hkv, hd, E)
    x = rand(B, Lq, E)
    kv = rand(B, Lk, E) if cross else x
    rope = dict(rope_dims=dims, rope_theta=theta, rope_interleaved=interleaved, rope_position_scale=pscale)
    layer = mha.Layer(E, H, num_kv_heads=Hkv, head_dim=hd, value_dim=hd, **w, **rope)
    plain = mha.Layer(E, H, num_kv_heads=Hkv, head_dim=hd, value_dim=hd, **w)
    args = (x, kv, kv) if cross else (x,)
    out = layer.forward(*args, causal=True)
    ref_rope = dict(dims=dims, theta=theta or 10000.0, scale=pscale or 1.0, interleaved=interleaved)
    want = ref_layer(w, x, kv, H, Hkv, hd, True, rope=ref_rope)
    close(out, want, 2e-5)
    assert np.abs(out - plain.forward(*args, causal=True)).max() > 1e-3  # the rotation does something
    # the other pair order gives another result (so a swapped order would fail above)
    other = dict(ref_rope, interleaved=not interleaved)
    assert np.abs(want - ref_layer(w, x, kv, H, Hkv, hd, True, rope=other)).max() > 1e-3


def test_layer_variant_and_rope_together_against_double():
    E, H, Hkv, hd, B, L = 24, 4, 2, 8, 2, 11
    w = make_layer_weights(E, H, Hkv, hd, E)
    kw = MODIFIERS["all"](H)
    layer = mha.Layer(E, H, num_kv_heads=Hkv, head_dim=hd, value_dim=hd, **w, **kw, rope_dims=8)
    x = rand(B, L, E) * 2
    out = layer.forward(x, causal=True)
    rope = dict(dims=8, theta=10000.0, scale=1.0, interleaved=False)
    close(out, ref_layer(w, x, x, H, Hkv, hd, True, rope=rope, **ref_kwargs(kw)), 2e-5)
    # the layer copied the slopes and sinks: changing the arrays afterwards changes nothing
    kw["alibi_slopes"][:] = 0
    kw["sinks"][:] = -100
    assert np.array_equal(layer.forward(x, causal=True), out)


# ---- The KV cache's dtype and window ------------------------------------------------------------

def test_int8_cache_reads_back_within_half_a_step_and_attends_as_over_those_values():
    H, Hkv, D, Dv, L = 4, 2, 32, 16, 90
    q, k, v = rand(L, H, D), rand(L, Hkv, D) * 4, rand(L, Hkv, Dv)
    k[5] = 0.0  # a zero row: scale 0, reads back as zeros
    cache = mha.KVCache(Hkv, D, Dv, 256, dtype="i8")
    f32 = mha.KVCache(Hkv, D, Dv, 256)
    assert cache.dtype == "i8" and f32.dtype == "f32" and cache.window == 0
    assert cache.bytes < f32.bytes / 2
    cache.append(0, k[:60], v[:60])
    got = [cache.attention(q[:60], [0], [0, 60], causal=True)]  # the queries are the last cached tokens
    for t in range(60, L):
        cache.append(0, k[t:t + 1], v[t:t + 1])
        got.append(cache.attention(q[t:t + 1], [0], [0, 1], causal=True))
    got = np.concatenate(got)
    rk, rv = cache.read(0)
    for x, r in ((k, rk), (v, rv)):
        step = np.abs(x).max(axis=2, keepdims=True).astype(np.float64) / 127
        err = np.abs(r.astype(np.float64) - x)
        assert np.all(err <= 0.5 * step * (1 + 1e-5) + 1e-30)
        assert err.max() > 0  # it really is quantized
    assert not rk[5].any()
    want = ref_attention(q[None], rk[None], rv[None], causal=True)[0][0]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    # and not the fp32 values' result to that precision: the quantization is visible
    assert np.abs(want - ref_attention(q[None], k[None], v[None], causal=True)[0][0]).max() > 1e-5
    # with the score modifiers too
    kw = MODIFIERS["all"](H)
    got = cache.attention(q, [0], [0, L], causal=True, **kw)
    want = ref_attention(q[None], rk[None], rv[None], causal=True, **ref_kwargs(kw))[0][0]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_cache_dtype_names():
    with pytest.raises(ValueError, match="dtype"):
        mha.KVCache(2, 8, 8, 64, dtype="f16")
    with pytest.raises(NotImplementedError):  # the library's answer for bf16 storage, for now
        mha.KVCache(2, 8, 8, 64, dtype="bf16")


def test_windowed_cache_releases_blocks_and_keeps_the_bits():
    H, Hkv, D, L, W = 4, 2, 16, 400, 24
    q, k, v = rand(L, H, D), rand(L, Hkv, D), rand(L, Hkv, D)
    cache = mha.KVCache(Hkv, D, D, 1024, window=W)
    assert cache.window == W
    full = mha.attention(q[None], k[None], v[None], causal=True, window=W)[0]
    cache.append(0, k[:100], v[:100])
    got = [cache.attention(q[:100], [0], [0, 100], causal=True, window=W)]
    for t in range(100, L):
        cache.append(0, k[t:t + 1], v[t:t + 1])
        got.append(cache.attention(q[t:t + 1], [0], [0, 1], causal=True, window=W))
    assert np.array_equal(np.concatenate(got), full)
    held = 1024 // cache.block_tokens * cache.block_tokens - cache.free_tokens
    assert held < L  # blocks outside the window went back
    with pytest.raises(ValueError, match="variant.window"):  # a wider window than the cache keeps
        cache.attention(q[-1:], [0], [0, 1], causal=True, window=2 * W)


# ---- Bad values ---------------------------------------------------------------------------------

def test_bad_modifier_values_raise_value_error_naming_the_field():
    H = 4
    q, k, v = rand(1, 4, H, 8), rand(1, 4, 2, 8), rand(1, 4, 2, 8)
    for kw, field in [(dict(window=-1), "variant.window"), (dict(softcap=float("nan")), "variant.softcap"),
                      (dict(softcap=-1.0), "variant.softcap"), (dict(softcap=float("inf")), "variant.softcap"),
                      (dict(alibi_slopes=np.array([0, np.nan, 0, 0], np.float32)), r"variant.alibi_slopes\[1\]"),
                      (dict(sinks=np.array([0, 0, np.inf, 0], np.float32)), r"variant.sink_logits\[2\]")]:
        with pytest.raises(ValueError, match=field):
            mha.attention(q, k, v, **kw)
        with pytest.raises(ValueError, match=field):
            mha.attention_varlen(q[0], k[0], v[0], [0, 4], [0, 4], **kw)
    # the arrays themselves, as every array: wrong length / rank -> ValueError, wrong dtype -> TypeError
    for name in ("alibi_slopes", "sinks"):
        with pytest.raises(ValueError, match=name):
            mha.attention(q, k, v, **{name: np.zeros(3, np.float32)})
        with pytest.raises(ValueError, match=name):
            mha.attention(q, k, v, **{name: np.zeros((1, H), np.float32)})
        with pytest.raises(TypeError, match=name):
            mha.attention(q, k, v, **{name: np.zeros(H)})
        close(mha.attention(q, k, v, copy=True, **{name: np.zeros(H)}),  # copy=True converts
              mha.attention(q, k, v, **{name: np.zeros(H, np.float32)}), 0)
    cache = mha.KVCache(2, 8, 8, 64)
    cache.append(0, k[0], v[0])
    with pytest.raises(ValueError, match="variant.softcap"):
        cache.attention(q[0], [0], [0, 4], softcap=float("nan"))
    with pytest.raises(ValueError, match="sinks"):
        cache.attention(q[0], [0], [0, 4], sinks=np.zeros(5, np.float32))
    with pytest.raises(ValueError, match="window"):
        mha.KVCache(2, 8, 8, 64, window=-1)


def test_bad_layer_values_raise_value_error_naming_the_field():
    E, H = 16, 4
    w = make_layer_weights(E, H, H, 4, E)
    for kw, field in [(dict(rope_dims=3), "rope.dims"), (dict(rope_dims=6), "rope.dims"),
                      (dict(rope_dims=-2), "rope.dims"), (dict(rope_dims=4, rope_theta=-1.0), "rope.theta"),
                      (dict(rope_dims=4, rope_theta=float("nan")), "rope.theta"),
                      (dict(rope_dims=4, rope_position_scale=float("inf")), "rope.position_scale"),
                      (dict(window=-3), "variant.window"), (dict(softcap=float("nan")), "variant.softcap"),
                      (dict(alibi_slopes=np.full(H, np.inf, np.float32)), "variant.alibi_slopes"),
                      (dict(sinks=np.full(H, np.nan, np.float32)), "variant.sink_logits"),
                      (dict(alibi_slopes=np.zeros(H + 1, np.float32)), "alibi_slopes"),
                      (dict(sinks=np.zeros(2, np.float32)), "sinks")]:
        with pytest.raises(ValueError, match=field):
            mha.Layer(E, H, **w, **kw)
