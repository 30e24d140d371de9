"""The backend registry and automatic selection.

`backend=None` walks the priority list for the inputs' kind and device and takes the first
backend with no reasons against it; the automatic choice never lands on one that holds the
Lq x Lk matrix. `backend="name"` runs that one or raises BackendError with its reasons.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .backends.base import Backend
from .backends.native import NativeBackend
from .backends.numpy import NumpyBackend
from .backends.reference import ReferenceBackend
from .backends.torch import TorchBackend
from .backends.triton import TritonBackend


class BackendError(RuntimeError):
    """The requested backend cannot run these inputs (the message lists why)."""


#: Every backend, in order of preference for automatic choice.
REGISTRY: dict[str, Backend] = {
    b.name: b for b in (NativeBackend(), TritonBackend(), TorchBackend(), NumpyBackend(), ReferenceBackend())}


def register(backend: Backend, *, first: bool = True) -> None:
    """Add a backend (e.g. a compiled kernel); `first` puts it ahead of the others."""
    others = {n: b for n, b in REGISTRY.items() if n != backend.name}
    REGISTRY.clear()
    REGISTRY.update({backend.name: backend, **others} if first else {**others, backend.name: backend})


def get(name: str) -> Backend:
    if not isinstance(name, str) or name not in REGISTRY:
        raise ValueError(f"backend must be None or one of {', '.join(map(repr, REGISTRY))}; got {name!r}")
    return REGISTRY[name]


@dataclass
class Choice:
    """The outcome of dispatch: the chosen backend and why the others were refused."""

    backend: Backend | None
    refused: dict[str, list[str]] = field(default_factory=dict)


def choose(inp, backend: str | None = None, *, every_refusal: bool = False) -> Choice:
    """The backend for this call. Automatic choice stops at the first that can run it, unless
    `every_refusal` asks for every other backend's reasons too (qkv.explain)."""
    if backend is not None:
        chosen = get(backend)
        reasons = chosen.unsupported(inp)
        if reasons:
            raise BackendError(f"backend {backend!r} cannot run these inputs: " + "; ".join(reasons))
        return Choice(chosen)
    chosen, refused = None, {}
    for name, candidate in REGISTRY.items():
        reasons = candidate.unsupported(inp)
        refusal = None if reasons else candidate.automatic_refusal(inp)  # may cost work: only if it could run
        if refusal:
            reasons = reasons + [refusal]
        if reasons:
            refused[name] = reasons
        elif chosen is None:
            chosen = candidate
            if not every_refusal:
                break
    if chosen is None:
        listing = "; ".join(f"{n}: {', '.join(r)}" for n, r in refused.items())
        raise BackendError(f"no backend can run these inputs ({listing})")
    return Choice(chosen, refused)
