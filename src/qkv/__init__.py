"""qkv: exact attention for Python — one meaning, many fast implementations.

    import qkv
    out = qkv.attention(q, k, v, qkv.causal())             # (..., Hq, Lq, Dv)
    out, w = qkv.scaled_dot_product_attention(q, k, v)     # the seed's door
"""
from .api import attention, attention_weights, explain, scaled_dot_product_attention
from .dispatch import BackendError
from .masks import (EMPTY, FULL, PARTIAL, Mask, ScoreMod, alibi, causal, dense_mask, document, mask_fn,
                    padding, prefix_lm, score_fn, softcap, window)
from .nn import MultiHeadAttention
from .stats import AttentionStats, attention_stats

__version__ = "0.1.0"

__all__ = [
    "attention", "attention_weights", "explain", "scaled_dot_product_attention", "BackendError",
    "Mask", "ScoreMod", "EMPTY", "PARTIAL", "FULL",
    "causal", "window", "padding", "document", "prefix_lm", "mask_fn", "dense_mask",
    "alibi", "softcap", "score_fn", "MultiHeadAttention", "attention_stats", "AttentionStats",
]


def __getattr__(name):
    """Submodules that need torch (or are rarely used) load on first use: qkv.torch, qkv.distributed, ..."""
    if name in ("torch", "demo", "positional", "distributed", "models", "viz"):
        import importlib

        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'qkv' has no attribute {name!r}")
