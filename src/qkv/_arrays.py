"""Tiny helpers that let one piece of code run on NumPy arrays and torch tensors.

Only what qkv needs: recognise the kind of an array, and move parameter arrays
(mask lengths, segment ids, slopes, ...) next to the arrays they combine with.
torch is never imported here unless the caller already holds a torch tensor.
"""
from __future__ import annotations

import contextlib
import sys

import numpy as np


def is_torch(x) -> bool:
    """True for a torch.Tensor, without importing torch."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def grad_enabled() -> bool:
    """Whether torch records autograd graphs here (False under torch.no_grad(); and where
    torch was never imported, no tensor can want a gradient)."""
    torch = sys.modules.get("torch")
    return torch is not None and torch.is_grad_enabled()


def autocast_off(x):
    """A context in which torch's autocast leaves x's device alone: qkv computes in its inputs'
    dtype (float32 accumulation for low precision) on every backend, autocast or not."""
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(x, torch.Tensor) or not torch.is_autocast_enabled(x.device.type):
        return contextlib.nullcontext()
    return torch.autocast(x.device.type, enabled=False)


def autocast_dtype(x):
    """The dtype torch's autocast gives operations on x's device where it is on; else None."""
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(x, torch.Tensor) or not torch.is_autocast_enabled(x.device.type):
        return None
    if hasattr(torch, "get_autocast_dtype"):
        return torch.get_autocast_dtype(x.device.type)
    return torch.get_autocast_cpu_dtype() if x.device.type == "cpu" else torch.get_autocast_gpu_dtype()  # torch < 2.4


def autocast_cast(x, like):
    """x (a float torch tensor, or anything) in like's dtype where torch's autocast chose like's
    dtype on its device, as torch's own modules cast their float masks; else x as it is."""
    torch = sys.modules.get("torch")
    if (torch is None or not isinstance(x, torch.Tensor) or not isinstance(like, torch.Tensor)
            or not x.is_floating_point() or x.dtype == like.dtype or not torch.is_autocast_enabled(like.device.type)):
        return x
    return x.to(like.dtype)


def kind_of(x) -> str | None:
    """'numpy', 'torch' or None for anything else."""
    if isinstance(x, np.ndarray):
        return "numpy"
    if is_torch(x):
        return "torch"
    return None


def namespace(x):
    """The module whose functions (exp, where, tanh, ...) apply to x."""
    if is_torch(x):
        import torch

        return torch
    return np


def like(values, x):
    """`values` (a NumPy array or torch tensor) as an array of x's kind, on x's device.

    No copy when it already is one.
    """
    if is_torch(x):
        import torch

        if isinstance(values, np.ndarray) and not values.flags.writeable:
            values = values.copy()  # torch wants writable memory (broadcast views are not)
        return torch.as_tensor(values, device=x.device)
    return to_numpy(values)


def cast_like(values, x):
    """`values` (already of x's kind) in x's dtype."""
    return values.to(x.dtype) if is_torch(x) else values.astype(x.dtype, copy=False)


def forward_ad_active() -> bool:
    """Whether a forward-mode AD level (torch.autograd.forward_ad.dual_level) is open."""
    return sys.modules["torch"].autograd.forward_ad._current_level >= 0


def dispatch_mode_active(*mode_types) -> bool:
    """Whether a torch dispatch mode of one of these types intercepts operators now."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    return any(isinstance(mode, mode_types) for mode in _get_current_dispatch_mode_stack())


def has_tangents(*tensors) -> bool:
    """Whether forward-mode AD (torch.autograd.forward_ad) gave any of the tensors a tangent."""
    forward_ad = sys.modules["torch"].autograd.forward_ad
    return forward_ad_active() and any(forward_ad.unpack_dual(x).tangent is not None for x in tensors)


def to_numpy(x) -> np.ndarray:
    """A NumPy view or copy of x (torch tensors are detached and moved to the CPU;
    bfloat16, which NumPy lacks, becomes float32)."""
    if is_torch(x):
        import torch

        x = x.detach().cpu().resolve_neg()  # a lazily negated view: numpy() refuses it
        return (x.float() if x.dtype == torch.bfloat16 else x).numpy()
    return np.asarray(x)


def shares_memory(view, base) -> bool:
    """Whether `view` may read `base`'s memory (so it sees changes made to base in place)."""
    if is_torch(base):
        return view.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()
    return bool(np.may_share_memory(view, base))


def arange_like(n: int, x):
    """int64 indices 0..n-1 of x's kind and device."""
    if is_torch(x):
        import torch

        return torch.arange(n, device=x.device)
    return np.arange(n)


def broadcast_to(x, shape):
    """A broadcast view of x (NumPy or torch) with the given shape."""
    return x.expand(shape) if is_torch(x) else np.broadcast_to(x, shape)


def amax_last(x):
    """Max over the last dim, kept (NaN propagates; -inf for an empty last dim)."""
    if x.shape[-1] == 0:
        shape = tuple(x.shape[:-1]) + (1,)
        return x.new_full(shape, float("-inf")) if is_torch(x) else np.full(shape, -np.inf, dtype=x.dtype)
    return x.amax(dim=-1, keepdim=True) if is_torch(x) else x.max(axis=-1, keepdims=True)


def sum_last(x):
    """Sum over the last dim, kept."""
    return x.sum(dim=-1, keepdim=True) if is_torch(x) else x.sum(axis=-1, keepdims=True)


def repeat_heads(x, group: int):
    """(B, Hkv, L, D) -> (B, Hkv*group, L, D): each kv head serves `group` query heads."""
    if group == 1:
        return x
    return x.repeat_interleave(group, dim=1) if is_torch(x) else np.repeat(x, group, axis=1)


def sum_groups(x, group: int):
    """(B, Hkv*group, L, D) -> (B, Hkv, L, D): add up the gradients of heads sharing a kv head."""
    if group == 1:
        return x
    b, h, l, d = x.shape
    return x.reshape(b, h // group, group, l, d).sum(2 if is_torch(x) else 2)


def astype(x, dtype_name: str):
    """x in the named dtype ('float32', 'bfloat16', ...)."""
    if is_torch(x):
        import torch

        return x.to(getattr(torch, dtype_name))
    return x.astype(dtype_name, copy=False)
