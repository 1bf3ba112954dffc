"""Drop-ins for PyTorch modules (imported only when torch is installed: `import mha.torch`).

    m = torch.nn.MultiheadAttention(512, 8, batch_first=True).eval()
    fast = mha.torch.MultiheadAttention.from_module(m)
    out, weights = fast(x, x, x)          # m(x, x, x)'s signature and return values

Tensors must be CPU float32; they are shared with mha through numpy, without copies, when they are
contiguous in the layout mha reads (batch first); otherwise they are made contiguous first.
Where results differ from PyTorch: a query row that no key may see gives zeros (PyTorch gives
NaN); float (additive) masks, per-head 3-D attn_masks, add_bias_kv and add_zero_attn raise
NotImplementedError.
"""
import numpy as np
import torch

import mha


def _array(t, name):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu" or t.dtype != torch.float32:
        raise TypeError(f"{name} must be a CPU float32 tensor, got {t.dtype} on {t.device}")
    return t.detach().contiguous().numpy()


def _bool_mask(m, name):
    if m is None:
        return None
    if m.dtype != torch.bool:
        if m.is_floating_point():
            raise NotImplementedError(f"{name}: float (additive) masks are not supported; pass a bool mask")
        m = m != 0
    return m.detach().cpu().numpy()


def _combined_mask(key_padding_mask, attn_mask, B, Lq, Lk):
    """PyTorch's masks (True = not allowed) as mha's (nonzero = may attend), [B, Lq, Lk] or broadcastable."""
    kpm = _bool_mask(key_padding_mask, "key_padding_mask")
    am = _bool_mask(attn_mask, "attn_mask")
    if am is not None and am.ndim == 3:
        raise NotImplementedError("attn_mask: per-head (3-D) masks are not supported; pass (Lq, Lk)")
    if kpm is None and am is None:
        return None
    allowed = np.ones((B if kpm is not None else 1, Lq if am is not None else 1, Lk), dtype=bool)
    if kpm is not None:
        allowed &= ~kpm[:, None, :]
    if am is not None:
        allowed &= ~am[None, :, :]
    return allowed


class MultiheadAttention:
    """nn.MultiheadAttention's forward on mha.Layer, built from the module's weights."""

    def __init__(self, layer, batch_first, num_heads, runtime=None):
        self.layer, self.batch_first, self.num_heads, self.runtime = layer, batch_first, num_heads, runtime

    @classmethod
    def from_module(cls, m, runtime=None):
        if not isinstance(m, torch.nn.MultiheadAttention):
            raise TypeError(f"from_module takes an nn.MultiheadAttention, got {type(m).__name__}")
        if m.bias_k is not None or m.add_zero_attn:
            raise NotImplementedError("add_bias_kv and add_zero_attn are not supported")
        E = m.embed_dim

        def np_(t):
            return None if t is None else t.detach().float().contiguous().numpy()

        if m._qkv_same_embed_dim:
            w = np_(m.in_proj_weight)
            wq, wk, wv = w[:E], w[E:2 * E], w[2 * E:]
        else:
            wq, wk, wv = np_(m.q_proj_weight), np_(m.k_proj_weight), np_(m.v_proj_weight)
        b = np_(m.in_proj_bias)
        bq, bk, bv = (None, None, None) if b is None else (b[:E], b[E:2 * E], b[2 * E:])
        layer = mha.Layer(E, m.num_heads, q_weight=wq, k_weight=wk, v_weight=wv, out_weight=np_(m.out_proj.weight),
                          q_bias=bq, k_bias=bk, v_bias=bv, out_bias=np_(m.out_proj.bias), kdim=m.kdim, vdim=m.vdim,
                          runtime=runtime)
        return cls(layer, m.batch_first, m.num_heads, runtime)

    def __call__(self, query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None,
                 average_attn_weights=True, is_causal=False):
        if not self.batch_first:
            query, key, value = (t.transpose(0, 1) for t in (query, key, value))
        q = _array(query, "query")
        self_attn = key is query and value is query
        k = q if self_attn else _array(key, "key")
        v = q if self_attn else _array(value, "value")
        B, Lq, Lk = q.shape[0], q.shape[1], k.shape[1]
        mask = _combined_mask(key_padding_mask, attn_mask, B, Lq, Lk)
        kwargs = dict(causal=bool(is_causal), mask=mask, need_weights=need_weights, runtime=self.runtime)
        if self_attn:
            res = self.layer.forward(q, **kwargs)
        else:
            res = self.layer.forward(q, k, v, **kwargs)
        out, weights = res if need_weights else (res, None)
        out = torch.from_numpy(out)
        if not self.batch_first:
            out = out.transpose(0, 1)
        if weights is not None:
            weights = torch.from_numpy(weights)
            if average_attn_weights:
                weights = weights.mean(dim=1)
        return out, weights

    forward = __call__


class TransformerEncoderLayer:
    """nn.TransformerEncoderLayer's forward (eval) on mha.EncoderLayer."""

    def __init__(self, layer, batch_first, runtime=None):
        self.layer, self.batch_first, self.runtime = layer, batch_first, runtime

    @classmethod
    def from_module(cls, m, runtime=None):
        if not isinstance(m, torch.nn.TransformerEncoderLayer):
            raise TypeError(f"from_module takes an nn.TransformerEncoderLayer, got {type(m).__name__}")
        act = m.activation
        if act is torch.nn.functional.relu or isinstance(act, torch.nn.ReLU):
            activation = "relu"
        elif act is torch.nn.functional.gelu or isinstance(act, torch.nn.GELU):
            activation = "gelu"
        else:
            raise NotImplementedError(f"activation {act} is not supported (relu or gelu)")
        if abs(m.norm1.eps - m.norm2.eps) > 0:
            raise NotImplementedError("norm1 and norm2 must share their eps")
        state = {k: v.detach().float().contiguous().numpy() for k, v in m.state_dict().items()}
        layer = mha.EncoderLayer(m.self_attn.embed_dim, m.self_attn.num_heads, m.linear1.out_features, state,
                                 activation=activation, norm_first=m.norm_first, norm_eps=m.norm1.eps, runtime=runtime)
        return cls(layer, m.self_attn.batch_first, runtime)

    def __call__(self, src, src_mask=None, src_key_padding_mask=None, is_causal=False):
        if not self.batch_first:
            src = src.transpose(0, 1)
        x = _array(src, "src")
        B, L = x.shape[0], x.shape[1]
        mask = _combined_mask(src_key_padding_mask, src_mask, B, L, L)
        out = torch.from_numpy(self.layer.forward(x, causal=bool(is_causal), mask=mask, runtime=self.runtime))
        return out if self.batch_first else out.transpose(0, 1)

    forward = __call__
