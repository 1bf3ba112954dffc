"""mha: SIMD-optimized CPU multi-head attention, from numpy.

    import numpy as np, mha
    q = np.random.rand(1, 128, 8, 64).astype(np.float32)   # (batch, len, heads, head_dim)
    out = mha.attention(q, q, q, causal=True)               # fused, the scores never stored

Every function takes float32, C-contiguous numpy arrays (anything else raises TypeError or
ValueError naming the argument, unless copy=True converts it) and `runtime=` (default: one
process-wide mha.Runtime on all cores, mha.default_runtime()). Errors of the library raise
ValueError (invalid arguments), MemoryError and NotImplementedError with its message. The GIL is
released during every call, so Python threads run calls in parallel on one runtime.
"""
from ._mha import (  # noqa: F401
    EncoderLayer,
    KVCache,
    Layer,
    PackedB,
    Runtime,
    attention,
    attention_varlen,
    default_runtime,
    sgemm,
    softmax,
)

__all__ = ["Runtime", "default_runtime", "sgemm", "PackedB", "softmax", "attention", "attention_varlen", "KVCache",
           "Layer", "EncoderLayer"]
