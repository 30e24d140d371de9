"""Positional encodings: sinusoidal tables, rotary embeddings (RoPE) and ALiBi slopes.

Shape legend used in docstrings and comments:

- ``L``: sequence length (number of positions)
- ``D``: feature dimension per head (``d_model`` for the sinusoidal table)
- ``...``: any leading dimensions, e.g. ``(B, H)`` for batch and heads
- ``H``: number of attention heads

Everything here works in NumPy. ``rope`` also accepts torch tensors; torch is
imported only when it is handed one, so ``import qkv.positional`` never pulls
torch in. This module deliberately imports nothing from the rest of ``qkv``.
"""
from __future__ import annotations

import math
import numbers
import operator
import sys

import numpy as np

__all__ = ["alibi_slopes", "rope", "sinusoidal"]


# ---- argument checks ----------------------------------------------------------------------


def _int_arg(name: str, value, minimum: int) -> int:
    """``value`` as a Python int >= minimum, or a TypeError/ValueError naming ``name``."""
    # bool is an int subclass, but length=True is always a bug.
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be an integer, got bool {value!r}")
    try:
        ivalue = operator.index(value)  # accepts int and NumPy integers, rejects 3.0
    except TypeError:
        raise TypeError(f"{name} must be an integer, got {type(value).__name__} {value!r}") from None
    if ivalue < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {ivalue}")
    return ivalue


def _base_arg(base) -> float:
    """``base`` as a finite positive float, or a TypeError/ValueError naming it."""
    if isinstance(base, (bool, np.bool_)) or not isinstance(base, numbers.Real):
        raise TypeError(f"base must be a real number, got {type(base).__name__} {base!r}")
    try:
        fbase = float(base)
    except OverflowError:  # an int past float's range
        fbase = math.inf
    if not (math.isfinite(fbase) and fbase > 0):
        raise ValueError(f"base must be a finite number > 0, got {base!r}")
    return fbase


def _inv_freq(dim: int, base: float) -> np.ndarray:
    """Rotation frequencies base^(-2i/dim) for i in [0, ceil(dim/2)), float64, shape (ceil(dim/2),)."""
    # Float64 even for float32 callers: the exponent is where precision is lost.
    return base ** (-np.arange(0, dim, 2, dtype=np.float64) / dim)


# ---- sinusoidal ---------------------------------------------------------------------------


def sinusoidal(length, d_model, base=10000.0, dtype=np.float64) -> np.ndarray:
    """The fixed sinusoidal position table of "Attention Is All You Need".

    ``PE[pos, 2i] = sin(pos / base^(2i/d_model))`` and
    ``PE[pos, 2i+1] = cos(pos / base^(2i/d_model))``: sine on even features,
    cosine on odd ones. An odd ``d_model`` works; its last column is a sine.

    Args:
        length: number of positions ``L`` (int >= 0).
        d_model: number of features ``D`` (int >= 0).
        base: wavelength base (> 0), 10000 in the paper.
        dtype: NumPy floating dtype of the result. The table is computed in
            float64 and cast once at the end.

    Returns:
        NumPy array of shape ``(L, D)``.
    """
    length = _int_arg("length", length, 0)
    d_model = _int_arg("d_model", d_model, 0)
    base = _base_arg(base)
    try:
        out_dtype = np.dtype(dtype)
    except TypeError:
        raise TypeError(f"dtype must be a NumPy floating dtype, got {dtype!r}") from None
    if not np.issubdtype(out_dtype, np.floating):
        raise TypeError(f"dtype must be a NumPy floating dtype, got {out_dtype}")

    pos = np.arange(length, dtype=np.float64)[:, None]  # (L, 1)
    angles = pos * _inv_freq(d_model, base)  # (L, ceil(D/2))
    pe = np.empty((length, d_model), dtype=np.float64)  # (L, D)
    pe[:, 0::2] = np.sin(angles)  # (L, ceil(D/2))
    # For odd D there is one fewer odd column than even columns.
    pe[:, 1::2] = np.cos(angles[:, : d_model // 2])  # (L, floor(D/2))
    return pe.astype(out_dtype, copy=False)


# ---- rotary -------------------------------------------------------------------------------


def _is_torch_tensor(obj) -> bool:
    # If torch was never imported, obj cannot be a torch tensor: no import needed.
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Tensor)


def _check_rope_shape(shape: tuple) -> None:
    if len(shape) < 2:
        raise ValueError(f"x must have shape (..., L, D) with at least 2 dims, got shape {tuple(shape)}")
    if shape[-1] % 2:
        raise ValueError(f"x must have an even last dim D (features are rotated in pairs), got shape {tuple(shape)}")


def _check_positions_shape(pos_shape: tuple, x_shape: tuple) -> None:
    """positions must be (L,) or broadcastable to x.shape[:-1] with last dim L."""
    lead = tuple(x_shape[:-1])  # (..., L)
    L = lead[-1]
    expected = f"shape ({L},) or a shape broadcastable to x.shape[:-1] = {lead} ending in {L}"
    pos_shape = tuple(pos_shape)
    # A trailing dim of 1 would silently give every token the same position: refuse it.
    if len(pos_shape) == 0 or pos_shape[-1] != L or len(pos_shape) > len(lead):
        raise ValueError(f"positions must have {expected}, got shape {pos_shape}")
    try:
        ok = np.broadcast_shapes(pos_shape, lead) == lead
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(f"positions must have {expected}, got shape {pos_shape}")


def _numpy_positions(positions, L: int) -> np.ndarray:
    if positions is None:
        return np.arange(L, dtype=np.int64)  # (L,)
    if _is_torch_tensor(positions):
        positions = positions.detach().cpu().numpy()
    pos = np.asarray(positions)
    if pos.dtype == np.bool_ or not np.issubdtype(pos.dtype, np.integer):
        raise TypeError(f"positions must hold integers, got dtype {pos.dtype}")
    return pos


def rope(x, positions=None, base=10000.0, *, interleaved=False):
    """Apply rotary position embeddings (RoPE) to ``x``.

    Feature pairs are rotated by the angle ``pos * inv_freq[i]`` with
    ``inv_freq[i] = base^(-2i/D)``, ``i`` in ``[0, D/2)``. Because rotations
    compose, ``rope(q, m) . rope(k, n)`` depends only on ``m - n``.

    Layouts:

    - ``interleaved=False`` (default): the half-split ("rotate_half") layout of
      Llama-family models and HF transformers. Pair ``i`` is
      ``(x[..., i], x[..., i + D/2])``:
      ``out = x * cos + rotate_half(x) * sin`` with
      ``rotate_half(x) = concat(-x[..., D/2:], x[..., :D/2])``.
    - ``interleaved=True``: the GPT-J / original RoFormer layout. Pair ``i`` is
      ``(x[..., 2i], x[..., 2i+1])``.

    Args:
        x: floating array of shape ``(..., L, D)``, ``D`` even. NumPy array (or
            array-like) or torch tensor.
        positions: ``None`` for ``arange(L)``; else integers of shape ``(L,)``
            or of a shape broadcastable to ``x.shape[:-1]`` ending in ``L``,
            e.g. ``(B, 1, L)`` for per-sequence offsets when decoding with a
            KV cache. NumPy or torch.
        base: frequency base (> 0).
        interleaved: pick the pair layout, see above.

    Returns:
        Same type, shape and dtype as ``x`` (same device for torch). NumPy
        computes in float64 (float32 for float16/float32 inputs). Torch
        computes angles in float32 (float64 for float64 inputs), like HF
        transformers, and is differentiable with respect to ``x``.
    """
    base = _base_arg(base)
    if not isinstance(interleaved, (bool, np.bool_)):
        raise TypeError(f"interleaved must be a bool, got {type(interleaved).__name__} {interleaved!r}")
    if _is_torch_tensor(x):
        return _rope_torch(x, positions, base, bool(interleaved))
    return _rope_numpy(x, positions, base, bool(interleaved))


def _rope_numpy(x, positions, base: float, interleaved: bool) -> np.ndarray:
    x = np.asarray(x)
    if not np.issubdtype(x.dtype, np.floating):
        raise TypeError(f"x must be a floating array, got dtype {x.dtype}")
    _check_rope_shape(x.shape)
    L, D = x.shape[-2], x.shape[-1]
    pos = _numpy_positions(positions, L)
    if positions is not None:
        _check_positions_shape(pos.shape, x.shape)

    angles = pos.astype(np.float64)[..., None] * _inv_freq(D, base)  # (..., L, D/2)
    # Half precision is too coarse for the products; float32 is enough for float32.
    work = np.float32 if x.dtype in (np.float16, np.float32) else np.float64  # long double: float64 angles
    cos = np.cos(angles).astype(work)  # (..., L, D/2)
    sin = np.sin(angles).astype(work)  # (..., L, D/2)
    xw = x.astype(work, copy=False)  # (..., L, D)

    if interleaved:
        x1, x2 = xw[..., 0::2], xw[..., 1::2]  # (..., L, D/2) each
    else:
        x1, x2 = xw[..., : D // 2], xw[..., D // 2 :]  # (..., L, D/2) each
    # Rotate each pair (x1, x2) by its angle.
    o1 = x1 * cos - x2 * sin  # (..., L, D/2)
    o2 = x2 * cos + x1 * sin  # (..., L, D/2)
    if interleaved:
        out = np.stack([o1, o2], axis=-1)  # (..., L, D/2, 2)
        out = out.reshape(out.shape[:-2] + (D,))  # (..., L, D)
    else:
        out = np.concatenate([o1, o2], axis=-1)  # (..., L, D)
    return out.astype(x.dtype, copy=False)


def _rope_torch(x, positions, base: float, interleaved: bool):
    import torch  # lazy: only reached when x already is a torch tensor

    if not torch.is_floating_point(x):
        raise TypeError(f"x must be a floating tensor, got dtype {x.dtype}")
    _check_rope_shape(tuple(x.shape))
    L, D = x.shape[-2], x.shape[-1]

    if positions is None:
        pos = torch.arange(L, device=x.device)  # (L,)
    else:
        if isinstance(positions, torch.Tensor):
            pos = positions
            if pos.dtype == torch.bool or pos.is_floating_point() or pos.is_complex():
                raise TypeError(f"positions must hold integers, got dtype {pos.dtype}")
        else:
            pos = torch.as_tensor(_numpy_positions(positions, L))
        _check_positions_shape(tuple(pos.shape), tuple(x.shape))
        pos = pos.to(device=x.device)

    # float32 angles as in HF transformers; float64 inputs deserve float64 angles.
    angle_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    inv_freq = torch.as_tensor(_inv_freq(D, base), dtype=angle_dtype, device=x.device)  # (D/2,)
    angles = pos.to(angle_dtype)[..., None] * inv_freq  # (..., L, D/2)
    cos = angles.cos().to(x.dtype)  # (..., L, D/2)
    sin = angles.sin().to(x.dtype)  # (..., L, D/2)

    if interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]  # (..., L, D/2) each
    else:
        x1, x2 = x[..., : D // 2], x[..., D // 2 :]  # (..., L, D/2) each
    o1 = x1 * cos - x2 * sin  # (..., L, D/2)
    o2 = x2 * cos + x1 * sin  # (..., L, D/2)
    if interleaved:
        return torch.stack([o1, o2], dim=-1).flatten(-2)  # (..., L, D)
    return torch.cat([o1, o2], dim=-1)  # (..., L, D)


# ---- ALiBi --------------------------------------------------------------------------------


def _pow2_slopes(n: int) -> np.ndarray:
    """start^(1..n) with start = 2^(-8/n): the slopes for a power-of-two n, shape (n,)."""
    start = 2.0 ** (-8.0 / n)
    return start ** np.arange(1, n + 1, dtype=np.float64)


def alibi_slopes(num_heads) -> np.ndarray:
    """Per-head ALiBi slopes (Press et al.), as in the reference code and HF BLOOM.

    For ``n`` a power of two: ``start = 2^(-8/n)`` and slopes are
    ``start^1, ..., start^n``. Otherwise, with ``c`` the largest power of two
    below ``n``, the slopes for ``c`` are followed by every other slope of the
    ``2c`` sequence: ``slopes(2c)[0::2][: n - c]``.

    Args:
        num_heads: number of heads ``H`` (int >= 1).

    Returns:
        NumPy float64 array of shape ``(H,)``.
    """
    n = _int_arg("num_heads", num_heads, 1)
    c = 1 << (n.bit_length() - 1)  # largest power of two <= n, exact (no float log2)
    slopes = _pow2_slopes(c)  # (c,)
    if c == n:
        return slopes
    extra = _pow2_slopes(2 * c)[0::2][: n - c]  # (n - c,)
    return np.concatenate([slopes, extra])  # (H,)
