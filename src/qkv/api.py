"""The public functions: attention, attention_weights, scaled_dot_product_attention, explain.

Shape legend (everywhere in qkv):
    q   (..., Hq, Lq, D)     queries      ... = batch dims, matched exactly by k and v
    k   (..., Hkv, Lk, D)    keys         with 4 or more dims Hq may be a multiple of Hkv (grouped-
                                          query attention); 3-D (H, L, D) inputs have equal heads
    v   (..., Hkv, Lk, Dv)   values
    out (..., Hq, Lq, Dv)    lse (..., Hq, Lq)    weights (..., Hq, Lq, Lk)
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from . import _arrays, dispatch, inputs
from .backends import reference
from .backends.base import compute_dtype_name


def attention(q, k, v, mask=None, *, score_mod=None, scale=None, dropout_p=0.0, seed=None,
              return_lse=False, backend=None):
    """Exact scaled dot-product attention: softmax(q·kᵀ·scale + modifiers, masked)·v.

    Args:
        q, k, v: NumPy arrays or torch tensors (one kind, one dtype: float64, float32,
            bfloat16 or float16), shapes in the legend above; 2-D (L, D) inputs are one head.
        mask: None; a qkv mask (``qkv.causal() & qkv.padding(lengths)``, ...); a boolean
            array broadcastable to (..., Hq, Lq, Lk), True = attend; or a float array of
            q's dtype, added to the scores (a bias; one that requires grad is refused while
            gradients are recorded: qkv gives it no gradient).
        score_mod: a score modifier (``qkv.alibi``, ``qkv.softcap``, ``qkv.score_fn``)
            or a list of them, applied in order to the scaled scores.
        scale: multiplies q·kᵀ; default 1/sqrt(D).
        dropout_p, seed: dropout on the attention weights (torch, numpy and reference
            backends); the same seed drops the same entries on every backend.
            seed=None draws one from torch's (or NumPy's) global generator.
        return_lse: also return the log-sum-exp of each row, (..., Hq, Lq), float32
            (float64 for float64 inputs); -inf for a row with no allowed key.
        backend: None chooses automatically; a backend's name ('native', 'triton', 'torch',
            'numpy', 'reference') runs that backend, or raises qkv.BackendError with its
            reasons when it cannot run these inputs; any other name raises ValueError.

    Returns:
        out (..., Hq, Lq, Dv) in q's dtype, or (out, lse) with return_lse=True.
        A query row with no allowed key gives 0 (never NaN).
    """
    inp = inputs.prepare(q, k, v, mask, score_mod=score_mod, scale=scale, dropout_p=dropout_p, seed=seed)
    return_lse = inputs.check_bool("return_lse", return_lse)
    inputs.refuse_trainable_rules(inp)  # attention_weights records the rule instead
    if inp.dropout_p > 0 and inp.seed is None:
        inp.seed = _draw_seed(inp.kind)
    inp.needs_lse = return_lse
    chosen = dispatch.choose(inp, backend).backend
    with _arrays.autocast_off(inp.q):
        out, lse = inp.to_caller(*chosen.forward(inp))
    return (out, lse) if return_lse else out


def _draw_seed(kind: str) -> int:
    if kind == "torch":
        import torch

        return int(torch.randint(0, 2**62, ()).item())
    return int(np.random.randint(0, 2**62, dtype=np.int64))


def attention_weights(q, k, mask=None, *, score_mod=None, scale=None, rows=None):
    """The attention weights softmax(q·kᵀ·scale + modifiers, masked), shape (..., Hq, Lq, Lk).

    Explicit O(Lq·Lk) memory: this is the matrix fused kernels never hold. Rows with no
    allowed key are all zeros. Torch inputs keep autograd.

    rows: only these query rows, as ``w[..., rows, :]`` of the full matrix would give them
    (an int drops the row axis; a slice or 1-D sequence of positions gives (..., Hq, n, Lk)),
    in O(n·Lk) memory: the weights of chosen tokens of a long sequence.
    For statistics of every row in O(N) memory, see ``qkv.attention_stats``.
    """
    inp = inputs.prepare(q, k, k, mask, score_mod=score_mod, scale=scale, records_graph=True)
    if rows is not None:
        from .stats import weights_of_rows

        with _arrays.autocast_off(inp.q):
            return weights_of_rows(inp, rows)
    return _formula(inp)[2].reshape(inp.output_shape(inp.Lk))


def _formula(inp):
    """(out, lse, weights) by the plain formula, in the compute dtype, cast back to q's dtype."""
    cdt = compute_dtype_name(inp.dtype)
    q, k, v = (_arrays.astype(x, cdt) for x in (inp.q, inp.k, inp.v))
    with _arrays.autocast_off(q):
        out, lse, weights = reference.formula(inp, q, k, v)
    return _arrays.astype(out, inp.dtype), lse, _arrays.astype(weights, inp.dtype)


def scaled_dot_product_attention(query, key, value, mask=None):
    """The seed's door: ``(output, attention_weights)`` for (batch, seq, d_k) inputs.

    Scores are query·keyᵀ/sqrt(d_k); positions where ``mask == 0`` are masked (any dtype,
    broadcastable to (batch, seq_q, seq_k)); softmax over the keys; weighted sum of value.
    Works on torch tensors and NumPy arrays. Where every key of a row is masked the
    output row and weights are 0 (the plain formula would give NaN).

    >>> q = k = v = torch.randn(2, 10, 64)
    >>> out, w = qkv.scaled_dot_product_attention(q, k, v)   # (2, 10, 64), (2, 10, 10)
    """
    inputs.check_qkv(query, key, value, names=("query", "key", "value"), heads=False)
    if mask is not None:
        inputs.check_seed_mask(mask, query, key)
        mask = mask != 0
        mask = mask.reshape((1,) * (2 - mask.ndim) + tuple(mask.shape)) if mask.ndim < 2 else mask
        mask = mask[..., None, :, :] if mask.ndim >= 3 else mask  # room for the head axis
    q, k, v = (x[..., None, :, :] for x in (query, key, value))  # (..., 1, L, D): one head
    inp = inputs.prepare(q, k, v, mask, records_graph=True)
    out, _, weights = _formula(inp)
    return (out.reshape(tuple(query.shape[:-1]) + (inp.Dv,)),
            weights.reshape(tuple(query.shape[:-1]) + (inp.Lk,)))


@dataclass
class Report:
    """What `qkv.explain` found: the backend that runs, why others were refused, memory."""

    backend: str
    refused: dict = field(default_factory=dict)
    workspace_bytes: int = 0
    formula_bytes: int = 0
    shapes: str = ""

    def __str__(self):
        lines = [f"inputs: {self.shapes}", f"backend: {self.backend}",
                 f"extra memory: {_human(self.workspace_bytes)} "
                 f"(the plain formula would hold {_human(self.formula_bytes)})"]
        for name, reasons in self.refused.items():
            lines.append(f"not {name}: " + "; ".join(reasons))
        return "\n".join(lines)


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def explain(q, k, v, mask=None, *, score_mod=None, scale=None, dropout_p=0.0, seed=None, backend=None) -> Report:
    """Which backend `attention` would run for these arguments, why the others were refused,
    and the extra memory it will use. Raises like `attention` would.

    Takes `attention`'s arguments (q (..., Hq, Lq, D), k (..., Hkv, Lk, D), v (..., Hkv, Lk, Dv),
    mask, modifiers) and runs nothing; returns a `Report`, whose str() is the explanation.
    """
    inp = inputs.prepare(q, k, v, mask, score_mod=score_mod, scale=scale, dropout_p=dropout_p, seed=seed)
    inputs.refuse_trainable_rules(inp)
    choice = dispatch.choose(inp, backend, every_refusal=True)
    if inp.needs_grad and choice.backend.rereads_rules:
        inp.held_tensors()  # refuses NumPy arrays there, as the chosen backend's forward does
    mask_text = repr(inp.mask) if inp.dropped_mask is None else \
        f"{inp.dropped_mask!r} (allows every pair at these sizes: not applied)"
    shapes = (f"{inp.kind} {inp.dtype} on {inp.device}; q {tuple(q.shape)}, k {tuple(k.shape)}, "
              f"v {tuple(v.shape)}; mask {mask_text}; score_mod {list(inp.score_mods)}")
    formula = dispatch.REGISTRY["reference"].workspace_bytes(inp)  # the plain formula is the oracle
    return Report(choice.backend.name, choice.refused, choice.backend.workspace_bytes(inp), formula, shapes)
