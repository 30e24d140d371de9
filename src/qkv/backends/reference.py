"""The reference backend: the formula, line by line.

    weights = softmax(Q·Kᵀ·scale + modifiers, masked)      # (B, Hq, Lq, Lk)
    output  = weights · V                                  # (B, Hq, Lq, Dv)

It holds the whole Lq x Lk matrix, so it is never chosen automatically; it is the
oracle of every test (in float64) and the first code a learner should read. The same
functions run on NumPy arrays and torch tensors (`formula`), so `attention_weights`
keeps torch autograd; the backend itself computes in NumPy.
"""
from __future__ import annotations

import numpy as np

from .. import _arrays
from ..masks import apply_score_mods, tile_indices
from .base import Backend, Capabilities, compute_dtype_name, dropout_scale_tile, nbytes


def scores(inp, q, k):
    """Scaled, modified scores and the allowed pattern, both (B, Hq, Lq, Lk)."""
    k = _arrays.repeat_heads(k, inp.group)  # (B, Hq, Lk, D)
    s = (q @ k.swapaxes(-1, -2)) * inp.scale  # (B, Hq, Lq, Lk)
    b, h, qi, ki = tile_indices(q, np.arange(inp.B), np.arange(inp.Hq), 0, inp.Lq, 0, inp.Lk)
    s = apply_score_mods(inp.score_mods, s, b, h, qi, ki, inp.geom)
    return s, None if inp.mask is None else _allowed(inp, q)


def _allowed(inp, q):
    """The mask (B|1, H|1, Lq, Lk) as q's kind, its rules given index arrays of the inputs' kind
    (torch ones for torch inputs, also where q was upcast to NumPy), as every backend gives them."""
    like = q if _arrays.kind_of(q) == inp.kind else inp.geom.host_probe()
    b, h, qi, ki = tile_indices(like, np.arange(inp.B), np.arange(inp.Hq), 0, inp.Lq, 0, inp.Lk)
    allowed = inp.mask.allowed(b, h, qi, ki, inp.geom)
    return allowed if like is q else _arrays.to_numpy(allowed)


def softmax_with_lse(s, allowed):
    """Row softmax of s over allowed keys, and its log-sum-exp. Rows with no key give 0 and -inf."""
    xp = _arrays.namespace(s)
    if allowed is not None:
        s = xp.where(allowed, s, -np.inf)
    m = _arrays.amax_last(s)  # (B, Hq, Lq, 1) row max, subtracted before exp for stability
    m = xp.where(m == -np.inf, 0, m)
    e = xp.exp(s - m)
    total = _arrays.sum_last(e)  # (B, Hq, Lq, 1)
    has_key = total != 0  # exactly 0 where no key is allowed; NaN (from NaN inputs) propagates
    weights = e / xp.where(has_key, total, 1)
    lse = xp.where(has_key, m + xp.log(xp.where(has_key, total, 1)), -np.inf)[..., 0]  # (B, Hq, Lq)
    return weights, lse


def formula(inp, q, k, v):
    """(output, lse, weights) in the arrays' own dtype: NumPy or torch, differentiable in torch."""
    s, allowed = scores(inp, q, k)
    weights, lse = softmax_with_lse(s, allowed)
    keep = _dropout(inp, weights)
    dropped = weights if keep is None else weights * keep
    out = dropped @ _arrays.repeat_heads(v, inp.group)  # (B, Hq, Lq, Dv)
    return out, lse, weights


def _dropout(inp, like):
    b, h, qi, ki = tile_indices(like, np.arange(inp.B), np.arange(inp.Hq), 0, inp.Lq, 0, inp.Lk)
    return dropout_scale_tile(inp, b, h, qi, ki, like)


def upcast(inp, *arrays):
    """The arrays as NumPy in the compute dtype (float64 stays, the rest go to float32)."""
    return [_arrays.astype(_arrays.to_numpy(_arrays.astype(x, "float32") if inp.dtype == "bfloat16" else x),
                           compute_dtype_name(inp.dtype)) for x in arrays]


class ReferenceBackend(Backend):
    name = "reference"
    automatic = False
    caps = Capabilities(kinds=("numpy", "torch"), devices=("cpu",),
                        dtypes=("float64", "float32", "bfloat16", "float16"),
                        dropout=True, materializes=True)

    def forward(self, inp):
        q, k, v = upcast(inp, inp.q, inp.k, inp.v)
        out, lse, _ = formula(inp, q, k, v)  # in the compute dtype
        out = _arrays.astype(_arrays.like(out, inp.q), inp.dtype)  # rounded to the inputs' dtype, like any backend
        return out, _arrays.like(lse.astype(compute_dtype_name(inp.dtype)), inp.q)

    def backward(self, inp, dout, dlse=None):
        """(dq, dk, dv) of sum(out * dout) + sum(lse * dlse), in NumPy (the gradient oracle)."""
        if any(type(m).__name__ == "ScoreFn" for m in inp.score_mods):
            raise NotImplementedError("the reference backward cannot differentiate score_fn")
        q, k, v, dout = upcast(inp, inp.q, inp.k, inp.v, dout)
        k_rep, v_rep = _arrays.repeat_heads(k, inp.group), _arrays.repeat_heads(v, inp.group)
        raw = (q @ k_rep.swapaxes(-1, -2)) * inp.scale  # (B, Hq, Lq, Lk) before modifiers
        s, allowed = scores(inp, q, k)
        weights, _ = softmax_with_lse(s, allowed)
        out = formula(inp, q, k, v)[0]
        keep = _dropout(inp, weights)
        keep = 1.0 if keep is None else keep
        dv = (weights * keep).swapaxes(-1, -2) @ dout  # (B, Hq, Lk, Dv)
        dp = (dout @ v_rep.swapaxes(-1, -2)) * keep  # (B, Hq, Lq, Lk)
        row_dot = (dout * out).sum(-1, keepdims=True)  # (B, Hq, Lq, 1) = rowsum(P∘dP)
        extra = 0.0 if dlse is None else upcast(inp, dlse)[0][..., None]
        ds = weights * (dp - row_dot + extra)  # (B, Hq, Lq, Lk) gradient at modified scores
        ds = ds * score_mod_derivative(inp, raw)
        dq = ds @ k_rep * inp.scale  # (B, Hq, Lq, D)
        dk = ds.swapaxes(-1, -2) @ q * inp.scale  # (B, Hq, Lk, D)
        return tuple(_arrays.sum_groups(g, inp.group) if g is not dq else g for g in (dq, dk, dv))

    def workspace_bytes(self, inp):
        """Its (B, Hq, Lq, Lk) temporaries alive at once: the scores, their exp and the weights."""
        return 3 * inp.B * inp.Hq * inp.Lq * inp.Lk * nbytes(compute_dtype_name(inp.dtype))


def score_mod_derivative(inp, raw):
    """d(modified score)/d(raw score), through the chain of modifiers (1 for additive ones)."""
    b, h, qi, ki = tile_indices(raw, np.arange(inp.B), np.arange(inp.Hq), 0, inp.Lq, 0, inp.Lk)
    derivative, s = 1.0, raw
    for mod in inp.score_mods:
        if not mod.additive:
            derivative = derivative * mod.derivative(s)
        s = mod.apply(s, b, h, qi, ki, inp.geom)
    return derivative
