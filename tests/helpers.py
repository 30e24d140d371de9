"""Shared test helpers: inputs in any kind/dtype, the float64 oracle and the tolerance rule.

The rule (DESIGN.md): for a backend run in dtype t,
    err(backend) <= 2 * err(reference backend in t) + atol[t]
where err is the max absolute difference from the reference backend in float64 on the
same (t-rounded) inputs.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import qkv
from qkv import dispatch, inputs

try:
    import torch
except ImportError:  # pragma: no cover - the dev extra installs torch
    torch = None

from qkv.backends.base import ATOL, within_rule  # noqa: E402 (the tolerance rule: one place)

#: Backends under test: every registered CPU one that can run here, except the oracle itself
#: (GPU backends have their own tests).
BACKENDS = [name for name, b in dispatch.REGISTRY.items()
            if name != "reference" and b.missing() is None and b.runs_on_cpu]


#: Skips a test that needs the native kernel where it is not built or cannot load here.
needs_native = pytest.mark.skipif(dispatch.REGISTRY["native"].missing() is not None,
                                  reason=str(dispatch.REGISTRY["native"].missing()))


def native_here() -> bool:
    return dispatch.REGISTRY["native"].missing() is None


def backend_params(*names):
    """Backend names for parametrize, native skipped where it cannot run here."""
    return [pytest.param(name, marks=needs_native) if name == "native" else name for name in names]


def kind_of_backend(name: str) -> str:
    """The array kind to test a backend with: torch where it takes torch (bfloat16 needs it)."""
    kinds = dispatch.REGISTRY[name].caps.kinds
    return "torch" if "torch" in kinds and torch is not None else kinds[0]


def dtypes_of_backend(name: str, wanted=None) -> list[str]:
    """The backend's dtypes (those of `wanted` it supports, when given)."""
    dtypes = [d for d in dispatch.REGISTRY[name].caps.dtypes if d != "bfloat16" or torch is not None]
    return dtypes if wanted is None else [d for d in wanted if d in dtypes]


def precise_dtype(name: str) -> str:
    """The most precise dtype a backend supports."""
    return dtypes_of_backend(name, ("float64", "float32"))[0]


#: Round-off allowed where two exact computations only differ in summation order.
REORDER_ATOL = {"float64": 1e-12, "float32": 2e-5}


def convert(x64: np.ndarray, kind: str, dtype: str):
    """A float64 NumPy array as `kind` in `dtype`."""
    if kind == "torch":
        return torch.tensor(x64).to(getattr(torch, dtype))
    return x64.astype(dtype)


def to64(x) -> np.ndarray:
    if torch is not None and isinstance(x, torch.Tensor):
        return x.detach().to(torch.float64).cpu().numpy()
    return np.asarray(x, dtype=np.float64)


def on_cpu(x):
    """The oracle runs on CPU: a GPU tensor's values there, anything else as it is."""
    return x.detach().cpu() if torch is not None and isinstance(x, torch.Tensor) else x


def random_qkv(rng, q_shape, k_shape, v_shape, kind, dtype):
    """(q, k, v) in kind/dtype, and the float64 NumPy arrays holding exactly the same values."""
    arrays = [convert(rng.standard_normal(s), kind, dtype) for s in (q_shape, k_shape, v_shape)]
    return arrays, [to64(a) for a in arrays]


def max_err(got, want) -> float:
    got, want = to64(got), to64(want)
    assert got.shape == want.shape, (got.shape, want.shape)
    both_inf = np.isinf(got) & np.isinf(want) & (np.sign(got) == np.sign(want))
    with np.errstate(invalid="ignore"):
        diff = np.where(both_inf, 0.0, np.abs(got - want))
    return float(diff.max()) if diff.size else 0.0


def assert_within_rule(got, oracle, reference_in_dtype, dtype: str, what: str = "output"):
    err, ref_err = max_err(got, oracle), max_err(reference_in_dtype, oracle)
    assert within_rule(err, ref_err, dtype), \
        f"{what}: error {err:.3e} > 2 * {ref_err:.3e} + {ATOL[dtype]:.0e} ({dtype})"


def check_backend(backend: str, arrays, arrays64, dtype: str, **kwargs):
    """Run `backend` and compare output and lse with the oracle under the tolerance rule."""
    q, k, v = arrays
    got, lse = qkv.attention(q, k, v, backend=backend, return_lse=True, **kwargs)
    want, want_lse = qkv.attention(*arrays64, backend="reference", return_lse=True, **_as64(kwargs))
    ref, ref_lse = qkv.attention(*map(on_cpu, arrays), backend="reference", return_lse=True, **kwargs)
    assert got.shape == want.shape
    assert str(got.dtype).replace("torch.", "") == dtype
    assert_within_rule(got, want, ref, dtype)
    assert_within_rule(lse, want_lse, ref_lse, "float32" if dtype != "float64" else dtype, "lse")
    return got, lse


def _as64(kwargs):
    """The same call arguments for the NumPy float64 oracle: array masks become NumPy, biases float64."""
    mask = kwargs.get("mask")
    if mask is None or isinstance(mask, qkv.Mask):
        return kwargs
    is_bool = "bool" in str(mask.dtype)
    return {**kwargs, "mask": to64(mask).astype(bool) if is_bool else to64(mask)}


def reference_grads(qkv64, dout, dlse, kwargs, dtype="float64"):
    """(dq, dk, dv) of sum(out * dout) + sum(lse * dlse) from the oracle, computed in dtype."""
    kwargs = _as64(kwargs)
    mask = kwargs.get("mask")
    if isinstance(mask, np.ndarray) and mask.dtype != bool:  # a bias has the inputs' dtype
        kwargs = {**kwargs, "mask": mask.astype(dtype)}
    inp = inputs.prepare(*[x.astype(dtype) for x in qkv64], **kwargs)
    return dispatch.REGISTRY["reference"].backward(inp, dout.astype(dtype), dlse.astype(dtype))


def check_gradients(backend: str, leaves, kwargs, rng):
    """Backpropagate random dout and dlse through `backend` and compare dq, dk, dv with the
    oracle: err <= 2 * err(oracle run in float32, rounded to the dtype) + atol * max|grad|."""
    q, k, v = leaves
    dtype = str(q.dtype).replace("torch.", "")
    out, lse = qkv.attention(q, k, v, backend=backend, return_lse=True, **kwargs)
    dout = torch.tensor(rng.standard_normal(out.shape), dtype=out.dtype, device=out.device)
    dlse = torch.tensor(rng.standard_normal(lse.shape), dtype=lse.dtype, device=lse.device)
    finite = torch.isfinite(lse)
    (out * dout).sum().backward(retain_graph=True)
    torch.autograd.backward(lse[finite], dlse[finite])
    got = [x.grad for x in (q, k, v)]

    dlse64 = np.where(to64(finite), to64(dlse), 0)
    oracle = reference_grads([to64(x) for x in (q, k, v)], to64(dout), dlse64, kwargs)
    in_dtype = oracle if dtype == "float64" else reference_grads(
        [to64(x) for x in (q, k, v)], to64(dout), dlse64, kwargs, dtype="float32")
    for name, g, want, ref in zip("qkv", got, oracle, in_dtype):
        rounded = to64(torch.tensor(ref).to(getattr(torch, dtype)))
        err, ref_err = max_err(g, want), max_err(rounded, want)
        bound = 2 * ref_err + ATOL[dtype] * max(1.0, float(np.abs(want).max(initial=0.0)))  # empty grads too
        assert err <= bound, f"d{name}: {err:.3e} > {bound:.3e}"
    assert all(np.isfinite(to64(g)).all() for g in got)


def check_bfloat16_short_row(backend: str, mask, device="cpu"):
    """A bfloat16 row of one query over three keys, the middle one masked by `mask`, with the
    dout and dlse that made rowsum(dO ∘ O) from the rounded output break the rule for dq."""
    bf = lambda x: torch.tensor(x, dtype=torch.float64).to(torch.bfloat16).to(device).requires_grad_(True)  # noqa: E731
    q = bf([[[[0.302734375, -1.765625, 0.69921875]]]])
    k = bf([[[[-2.484375, -1.1640625, -0.1669921875], [-1.265625, -1.8125, -0.4453125],
               [-1.03125, 0.16015625, -1.078125]]]])
    v = bf([[[[0.3046875, 0.326171875, 2.984375, 0.33984375, 0.8515625, -1.2578125, 0.0308837890625, -0.96484375],
              [0.353515625, 0.369140625, 0.392578125, 1.140625, 0.201171875, -1.78125, 0.7578125, 0.443359375],
              [1.4296875, -1.5625, -0.047119140625, -0.443359375, -0.10498046875, -2.1875, 0.81640625,
               -1.4140625]]]])
    dout = torch.tensor([[[[0.578125, -0.05322265625, -2.59375, -0.73046875, -0.357421875, -1.015625, 2.6875,
                            1.2734375]]]], dtype=torch.bfloat16, device=device)
    dlse = torch.tensor([[[1.7956253290176392]]], device=device)
    out, lse = qkv.attention(q, k, v, mask, backend=backend, return_lse=True)
    torch.autograd.backward([out, lse], [dout, dlse])
    args, kwargs = [to64(x.detach()) for x in (q, k, v)], _as64(dict(mask=mask))
    oracle = reference_grads(args, to64(dout), to64(dlse), kwargs)[0]
    in_float32 = reference_grads(args, to64(dout), to64(dlse), kwargs, dtype="float32")[0]
    ref_err = np.abs(to64(torch.tensor(in_float32).bfloat16()) - oracle).max()
    err, bound = max_err(q.grad, oracle), 2 * ref_err + ATOL["bfloat16"] * max(1.0, np.abs(oracle).max())
    assert err <= bound, f"dq: {err:.4f} > {bound:.4f}"


def use_small_tiles(patch, block_q: int, block_k: int):
    """The numpy and torch backends on tiles of at most block_q x block_k, so that small
    problems take many tiles each way (patch: a pytest MonkeyPatch)."""
    from qkv.backends import torch as torch_backend

    patch.setattr(dispatch.REGISTRY["numpy"], "block_q", block_q)
    patch.setattr(dispatch.REGISTRY["numpy"], "block_k", block_k)
    patch.setattr(torch_backend, "choose_blocks", lambda rows, group, Lq, Lk: (min(block_q, Lq), min(block_k, Lk)))


# glibc's mmap threshold, fixed: by default it rises to the size of each large block freed, after
# which such blocks come from the heap and stay resident when freed, so the peak a call leaves
# varies from run to run with what the allocator kept (46 to 118 MiB seen for one call).
ALLOCATOR_RETURNS_LARGE_BLOCKS = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(64 * 1024)}


def run_measured(script: str, *args: str, timeout: int) -> dict:
    """Run a measuring script in a fresh process; its last line of output, parsed as JSON."""
    done = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True,
                          timeout=timeout, env=ALLOCATOR_RETURNS_LARGE_BLOCKS)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])
