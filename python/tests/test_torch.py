"""mha.torch's drop-ins against the PyTorch modules they were made from (skipped only when torch is
absent): nn.MultiheadAttention self/cross, kdim/vdim, no bias, masks, weights, batch_first both
ways; nn.TransformerEncoderLayer post/pre, relu/gelu, padding."""
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="python3-torch is not installed")
import mha.torch as mt  # noqa: E402

torch.manual_seed(5)


def close(a, b, tol=1e-4):
    np.testing.assert_allclose(a.detach().numpy(), b.detach().numpy(), rtol=tol, atol=tol)


def randomize_biases(m):
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "bias" in name:
                p.uniform_(-0.5, 0.5)


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("bias", [True, False])
def test_multihead_attention_self(batch_first, bias):
    E, H, B, L = 16, 4, 2, 5
    m = torch.nn.MultiheadAttention(E, H, bias=bias, batch_first=batch_first).eval()
    randomize_biases(m)
    x = torch.rand(B, L, E) if batch_first else torch.rand(L, B, E)
    fast = mt.MultiheadAttention.from_module(m)
    # The reference with grad on: PyTorch 1.13's no_grad fast path fails on bias=False.
    want, _ = m(x, x, x)
    for avg in (True, False):
        got, got_w = fast(x, x, x, average_attn_weights=avg)
        want_w = m(x, x, x, average_attn_weights=avg)[1]
        close(got, want)
        close(got_w, want_w)
    got, none = fast(x, x, x, need_weights=False)
    assert none is None
    close(got, want)


def test_multihead_attention_cross_kdim_vdim_and_masks():
    E, H, B, Lq, Lk = 16, 2, 2, 3, 6
    m = torch.nn.MultiheadAttention(E, H, kdim=12, vdim=10, batch_first=True).eval()
    randomize_biases(m)
    q, k, v = torch.rand(B, Lq, E), torch.rand(B, Lk, 12), torch.rand(B, Lk, 10)
    kpm = torch.zeros(B, Lk, dtype=torch.bool)
    kpm[1, -2:] = True
    am = torch.rand(Lq, Lk) > 0.7
    am[:, 0] = False  # every row keeps a key
    fast = mt.MultiheadAttention.from_module(m)
    with torch.no_grad():
        want, want_w = m(q, k, v, key_padding_mask=kpm, attn_mask=am)
        got, got_w = fast(q, k, v, key_padding_mask=kpm, attn_mask=am)
    close(got, want)
    close(got_w, want_w)


def test_multihead_attention_refuses_float_masks():
    m = torch.nn.MultiheadAttention(8, 2, batch_first=True).eval()
    x = torch.rand(1, 3, 8)
    with pytest.raises(NotImplementedError, match="attn_mask"):
        mt.MultiheadAttention.from_module(m)(x, x, x, attn_mask=torch.zeros(3, 3))
    with pytest.raises(TypeError, match="query"):
        mt.MultiheadAttention.from_module(m)(x.double(), x, x)


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_transformer_encoder_layer(norm_first, activation):
    E, H, F, B, L = 16, 4, 32, 2, 5
    m = torch.nn.TransformerEncoderLayer(E, H, F, activation=activation, batch_first=True,
                                         norm_first=norm_first).eval()
    randomize_biases(m)
    x = torch.rand(B, L, E)
    kpm = torch.zeros(B, L, dtype=torch.bool)
    kpm[1, -1] = True
    fast = mt.TransformerEncoderLayer.from_module(m)
    with torch.no_grad():
        close(fast(x), m(x))
        close(fast(x, src_key_padding_mask=kpm), m(x, src_key_padding_mask=kpm))
