"""A KV cache for decoding: the keys and values of every token seen so far.

Shape legend:
    B       batch rows
    Hkv     key/value heads (num_kv_heads of the module)
    T       max_len, the positions reserved up front
    depth   per-head feature size
    n       new tokens in one call
    length  positions filled so far

The cache preallocates ``keys`` and ``values`` of shape (B, Hkv, T, depth) once;
each call of a module with ``cache=`` writes its n new keys/values at
``[length, length + n)`` in place and attends over ``[0, length + n)`` with the
bottom-right causal mask (``qkv.causal()``): the new queries see every cached key
and are causal among themselves. The same class serves NumPy and torch modules.
"""
from __future__ import annotations

import contextlib
import sys

import numpy as np

from . import _arrays, inputs


class KVCache:
    """Preallocated keys and values (B, Hkv, max_len, depth) and the number of filled positions.

    Create one with ``module.init_cache(batch_size, max_len)``. Writing happens in two
    steps, ``stage`` then ``commit``, so a call that fails in between leaves the cache as
    it was. The arrays are written in place, except while torch records gradients through
    the new keys, values or queries: then each call makes new arrays (a copy of max_len positions),
    so a backward reaches every step; so does the first call after such calls, which a graph
    holds (a call under ``no_grad`` between recorded ones makes its copy without history, so
    later graphs do not reach the positions before it). Decode under ``torch.no_grad()``
    unless you need gradients. The arrays keep the dtype they were made with (the module's):
    new keys and values must have it, as they are never cast here (the modules refuse a query
    that would need a cast, except under torch's autocast, where they cast the heads to the
    cache's dtype).
    """

    def __init__(self, keys, values):
        if _arrays.kind_of(keys) is None or _arrays.kind_of(values) is None:
            raise TypeError("keys and values must be NumPy arrays or torch tensors of shape (B, Hkv, max_len, depth)")
        if keys.ndim != 4 or tuple(keys.shape) != tuple(values.shape):
            raise ValueError(f"keys and values must both have shape (B, Hkv, max_len, depth); "
                             f"got {tuple(keys.shape)} and {tuple(values.shape)}")
        if _arrays.kind_of(keys) != _arrays.kind_of(values) or keys.dtype != values.dtype:
            raise TypeError(f"keys and values must be of one kind and dtype; got {type(keys).__name__} "
                            f"{keys.dtype} and {type(values).__name__} {values.dtype}")
        if _arrays.is_torch(keys) and keys.device != values.device:
            raise ValueError(f"keys and values must be on one device; got {keys.device} and {values.device}")
        self.keys = keys  # (B, Hkv, T, depth)
        self.values = values  # (B, Hkv, T, depth)
        self.length = 0
        self._recorded = False  # whether autograd recorded through the arrays now held (saving views of them)

    @classmethod
    def empty(cls, batch_size, num_kv_heads, max_len, depth, like) -> "KVCache":
        """A cache of zeros with the kind, dtype (and device) of the array ``like``."""
        shape = (inputs.check_positive_int("batch_size", batch_size),
                 inputs.check_positive_int("num_kv_heads", num_kv_heads),
                 inputs.check_positive_int("max_len", max_len),
                 inputs.check_positive_int("depth", depth))
        with _normal_tensors(like):  # made under inference_mode too, a later step may write them
            return cls(_zeros(shape, like), _zeros(shape, like))

    @property
    def batch_size(self) -> int:
        return self.keys.shape[0]

    @property
    def max_len(self) -> int:
        return self.keys.shape[2]

    def stage(self, k, v, queries=None):
        """Write new keys/values (B, Hkv, n, depth) after the filled positions, without committing.

        Returns views (B, Hkv, length + n, depth) of the keys and values to attend over.
        queries: what will attend over them, if autograd may record through it (a trainable
        query projection alone makes autograd save the cache's views).
        """
        self._check_new(k, v)
        n = k.shape[2]
        if self.length + n > self.max_len:
            raise ValueError(f"the KV cache is full: it holds max_len={self.max_len} positions, "
                             f"{self.length} are filled and this call adds {n}; "
                             "create it with a larger max_len (module.init_cache(batch_size, max_len))")
        end = self.length + n
        recording = _recording((k, v, queries), self.keys)
        if recording or self._held_by_a_graph():  # graphs of earlier steps keep theirs
            with _normal_tensors(self.keys):
                self.keys = self.keys.slice_scatter(k, dim=2, start=self.length, end=end)
                self.values = self.values.slice_scatter(v, dim=2, start=self.length, end=end)
            self._recorded = recording
        else:
            self.keys[:, :, self.length:end] = k
            self.values[:, :, self.length:end] = v
        return self.keys[:, :, :end], self.values[:, :, :end]  # (B, Hkv, length + n, depth)

    def commit(self, n: int) -> None:
        """Make the n staged positions part of the cache."""
        n = inputs.check_nonnegative_int("n", n)
        if self.length + n > self.max_len:
            raise ValueError(f"cannot commit {n} positions: {self.length} of max_len={self.max_len} are filled")
        self.length += n

    def reset(self) -> None:
        """Forget every position. The arrays are kept and overwritten by the next calls, unless
        a graph autograd recorded holds them: new ones then, so the next sequence's graph does
        not hang from the last one's (nor keep it alive)."""
        self.length = 0
        if self._held_by_a_graph():
            with _normal_tensors(self.keys):
                self.keys, self.values = (_zeros(x.shape, x) for x in (self.keys, self.values))
            self._recorded = False

    def _held_by_a_graph(self) -> bool:
        """Whether a graph autograd recorded may hold views of the arrays: written in place,
        they would change what it saved, and torch's backward refuses that. Through the keys
        themselves, or through the queries alone (a trainable query projection, frozen K/V)."""
        return self._recorded or (_arrays.is_torch(self.keys) and self.keys.requires_grad)

    def _check_new(self, k, v):
        keys = self.keys
        if (type(k) is type(v) is type(keys) and k.dtype == v.dtype == keys.dtype and k.shape == v.shape
                and k.ndim == 4 and k.shape[:2] == keys.shape[:2] and k.shape[3] == keys.shape[3]):
            return  # a module's own call, in one test (each decoding step makes it)
        want = (self.batch_size, self.keys.shape[1], self.keys.shape[3])
        for name, x in (("keys", k), ("values", v)):
            if _arrays.kind_of(x) != _arrays.kind_of(self.keys):
                raise TypeError(f"new {name} are {_arrays.kind_of(x)} but the cache holds "
                                f"{_arrays.kind_of(self.keys)} arrays")
            if x.ndim != 4:
                raise ValueError(f"new {name} must have shape (batch, heads, n, depth), got {tuple(x.shape)}")
            got = (x.shape[0], x.shape[1], x.shape[3])
            if got != want:
                raise ValueError(f"new {name} have (batch, heads, depth) = {got} but the cache was made for {want}; "
                                 "create the cache with module.init_cache(batch_size, max_len)")
            if x.dtype != self.keys.dtype:
                raise TypeError(f"new {name} have dtype {x.dtype} but the cache holds {self.keys.dtype}")
        if k.shape[2] != v.shape[2]:
            raise ValueError(f"new keys and values must add the same number of positions; got keys "
                             f"{tuple(k.shape)}, values {tuple(v.shape)}")

    def __repr__(self):
        B, H, T, depth = self.keys.shape
        return f"KVCache(batch_size={B}, num_kv_heads={H}, depth={depth}, length={self.length}, max_len={T})"


def _recording(arrays, keys) -> bool:
    """Whether autograd records through any of `arrays` (the new keys and values, the
    queries): its graph then saves views of the cache, so this write makes a new version."""
    return _arrays.is_torch(keys) and _arrays.grad_enabled() and any(x is not None and x.requires_grad for x in arrays)


def _normal_tensors(keys):
    """A context in which new cache arrays are normal tensors: made under inference_mode they
    would be inference tensors, which no later call outside it may write in place. Without
    grad, as inference_mode has none (leaving it would turn grad back on)."""
    torch = sys.modules.get("torch")
    if torch is None or not _arrays.is_torch(keys) or not torch.is_inference_mode_enabled():
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    stack.enter_context(torch.inference_mode(False))
    stack.enter_context(torch.no_grad())
    return stack


def _zeros(shape, like):
    if _arrays.is_torch(like):
        import torch

        return torch.zeros(shape, dtype=like.dtype, device=like.device)
    return np.zeros(shape, dtype=like.dtype)
