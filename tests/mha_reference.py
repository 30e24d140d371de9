"""Independent float64 references for the attention modules (the tests' oracle).

`seed_mha` is the original NumPy algorithm written out literally; `reference_mha` is the
same computation grown up (grouped-query heads, biases, a boolean mask, an additive bias),
still the plain formula with nothing shared with qkv.
"""
import numpy as np


def seed_mha(Q, K, V, W_q, W_k, W_v, W_o, num_heads):
    """The original class's call([Q, K, V]), step by step."""
    batch_size, d_model = Q.shape[0], W_q.shape[0]
    depth = d_model // num_heads

    def split_heads(x):
        x = x.reshape(batch_size, -1, num_heads, depth)
        return x.transpose(0, 2, 1, 3)

    q, k, v = split_heads(Q @ W_q), split_heads(K @ W_k), split_heads(V @ W_v)
    scores = q @ k.transpose(0, 1, 3, 2) / np.sqrt(depth)
    scores = scores - np.max(scores, axis=-1, keepdims=True)
    weights = np.exp(scores)
    weights = weights / np.sum(weights, axis=-1, keepdims=True)
    out = weights @ v
    out = out.transpose(0, 2, 1, 3).reshape(batch_size, -1, d_model)
    return out @ W_o, weights


def reference_mha(query, key, value, params, num_heads, num_kv_heads=None, allowed=None, bias=None):
    """(output, weights) by the plain formula; rows with no allowed key give weights 0.

    params: dict with W_q, W_k, W_v, W_o (and optionally b_q, b_k, b_v, b_o), applied as x @ W.
    allowed: boolean, broadcastable to (B, Hq, Lq, Lk), True = attend. bias: added to the scores.
    """
    num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    p = {name: np.asarray(value, dtype=query.dtype) for name, value in params.items()}
    B, Lq, d_model = query.shape
    Lk = key.shape[1]
    depth = d_model // num_heads

    def proj(x, which):
        y = x @ p["W_" + which]
        return y + p["b_" + which] if "b_" + which in p else y

    q = proj(query, "q").reshape(B, Lq, num_heads, depth).transpose(0, 2, 1, 3)
    k = proj(key, "k").reshape(B, Lk, num_kv_heads, depth).transpose(0, 2, 1, 3)
    v = proj(value, "v").reshape(B, Lk, num_kv_heads, depth).transpose(0, 2, 1, 3)
    group = num_heads // num_kv_heads
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)  # kv head j serves q heads j*group...
    scores = q @ k.transpose(0, 1, 3, 2) / np.sqrt(depth)
    if bias is not None:
        scores = scores + bias
    ok = np.ones(scores.shape, dtype=bool) if allowed is None else np.broadcast_to(allowed, scores.shape)
    ok = ok & np.isfinite(scores)
    scores = np.where(ok, scores, -np.inf)
    row_max = np.max(scores, axis=-1, keepdims=True)
    e = np.where(ok, np.exp(scores - np.where(np.isfinite(row_max), row_max, 0)), 0)
    total = e.sum(axis=-1, keepdims=True)
    weights = e / np.where(total > 0, total, 1)
    out = (weights @ v).transpose(0, 2, 1, 3).reshape(B, Lq, num_heads * depth)
    return proj(out, "o"), weights


def causal_allowed(Lq, Lk):
    """Bottom-right causal pattern: query i sees keys j <= i + Lk - Lq."""
    return np.arange(Lk)[None, :] <= np.arange(Lq)[:, None] + Lk - Lq


def seed_sdpa(query, key, value, mask=None):
    """The original torch function, written out literally (any float dtype, torch tensors)."""
    import math

    import torch

    d_k = query.size(-1)
    scores = torch.matmul(query, key.transpose(-2, -1)) / math.sqrt(d_k)
    if mask is not None:
        scores = scores.masked_fill(mask == 0, float("-inf"))
    weights = torch.softmax(scores, dim=-1)
    return torch.matmul(weights, value), weights
