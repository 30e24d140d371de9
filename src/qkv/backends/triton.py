"""The triton backend: qkv's own fused FlashAttention-2 kernels for NVIDIA GPUs (Triton).

float16 and bfloat16 run their matmuls on tensor cores with float32 accumulation;
float32 inputs are computed in full float32 (no tf32), so every dtype meets the same
tolerance rule as the other backends. Head dims up to 256, Lq != Lk, GQA without
copying K/V, lse returned. Masks: every interval mask (causal in both alignments,
window, padding, prefix-LM and their intersections) and document masks, as per-query
key intervals (sorted ids) or ids compared inline (unsorted); ALiBi and softcap inline.
Key tiles outside a query block's interval are never visited.

With TRITON_INTERPRET=1 the same kernels run on CPU tensors through Triton's
interpreter (slow; for tests). It is then chosen only when named.
"""
from __future__ import annotations

import contextlib
import functools
import importlib.util
import math
import os
from dataclasses import dataclass

import numpy as np

from ..masks import And, Alibi, Causal, Document, IntervalMask, Softcap, _LaterRows, farthest_key
from .base import (Backend, Capabilities, autograd_attention, cdiv, clip_intervals, key_intervals, saved_output_bytes,
                   softmax_delta)


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "").lower() in ("1", "true", "yes", "on")


@functools.cache
def _triton_installed() -> bool:
    """Looked up once: the search of sys.path took some 50 µs, on every call's dispatch."""
    return importlib.util.find_spec("triton") is not None


class TritonBackend(Backend):
    name = "triton"

    caps = Capabilities(kinds=("torch",), devices=("cuda",), dtypes=("float32", "bfloat16", "float16"),
                        max_head_dim=256, gradients=True, inline_mods=(Alibi, Softcap))

    def accepts_device(self, device_type):
        return device_type == "cuda" or (device_type == "cpu" and interpreting())

    def missing(self):
        if not _triton_installed():
            return "Triton is not installed (pip install 'qkv[triton]')"
        try:
            import torch
        except ImportError:
            return "PyTorch is not installed (pip install 'qkv[triton]')"
        if interpreting():
            return None
        if not torch.cuda.is_available():
            return "no CUDA GPU here (TRITON_INTERPRET=1 runs the kernels on CPU, slowly, for tests)"
        return None

    def automatic_refusal(self, inp):
        if inp.device.startswith("cpu") and interpreting():  # without it, CPU inputs are refused anyway
            return "the Triton interpreter is chosen only when named (it is slow)"
        return super().automatic_refusal(inp)

    def extra_reasons(self, inp):
        return (_mask_reasons(inp) + _grid_reasons(inp) + _bfloat16_reasons(inp) + _scale_reasons(inp)
                + _interpreter_reasons(inp))

    def forward(self, inp):
        call = _Call(inp, _plan_masks(inp))
        if inp.needs_grad:
            return autograd_attention(functools.partial(_forward, float32_out=True), _backward,
                                      inp.q, inp.k, inp.v, call)  # the backward reads the output as summed
        return _forward(call, inp.q, inp.k, inp.v)[:2]

    def workspace_bytes(self, inp):
        # lse and lse_lo, and the output as summed for the backward; tiles live in registers and shared memory
        return 8 * inp.B * inp.Hq * inp.Lq + saved_output_bytes(inp)


# Heads and batch rows are the launch grids' 2nd and 3rd dims, which CUDA caps at 65535.
MAX_GRID_YZ = 65535


def _grid_reasons(inp) -> list[str]:
    if max(inp.B, inp.Hq) > MAX_GRID_YZ:
        return [f"the triton kernel launches one program row per head and batch row, at most {MAX_GRID_YZ} "
                f"of each (CUDA's grid); got {inp.B} batch rows and {inp.Hq} heads"]
    return []


@functools.lru_cache(maxsize=None)
def _capability(device) -> tuple[int, int]:
    """A GPU's compute capability, asked once (every decoding step would ask again)."""
    import torch

    return torch.cuda.get_device_capability(device)


def _bfloat16_reasons(inp) -> list[str]:
    """bfloat16 products need tensor cores of compute capability 8.0 (Ampere) or later."""
    if inp.dtype != "bfloat16" or not inp.device.startswith("cuda"):
        return []
    major, minor = _capability(inp.q.device)
    if major < 8:
        return [f"bfloat16 needs a GPU of compute capability 8.0 or later; this one has {major}.{minor}"]
    return []


# ---- masks ------------------------------------------------------------------------------------
@dataclass
class _MaskPlan:
    """What the kernels take: key intervals lo <= j <= hi (B, Lq) and/or segment ids, or for
    a lone causal mask only its shift (hi = i + causal_shift, computed in the kernels)."""

    lo: np.ndarray | None = None
    hi: np.ndarray | None = None
    ids: np.ndarray | None = None  # (B|1, Lq) compared with kv_ids (B|1, Lk) inline
    kv_ids: np.ndarray | None = None
    causal_shift: int | None = None


#: The largest |scale| the kernels take: they fold scale·log2(e) into one float32.
MAX_SCALE = float(np.finfo(np.float32).max) / math.log2(math.e)
#: alibi's largest term the kernels take: half of MAX_SCALE, room for the score it is taken from
MAX_ALIBI_TERM = MAX_SCALE / 2


def _scale_reasons(inp) -> list[str]:
    """The kernels work in log2 units: a scale, or alibi's slope times the farthest key, whose
    product with log2(e) overflows float32 turns scores that are finite to -inf."""
    reasons = []
    if abs(inp.scale) > MAX_SCALE:
        reasons.append(f"a scale above {MAX_SCALE:.3g} (the kernels work in log2 units: scale·log2(e) would "
                       "overflow float32)")
    farthest = farthest_key(inp.Lq, inp.Lk)
    if any(isinstance(m, Alibi) and m.largest * farthest > MAX_ALIBI_TERM for m in inp.score_mods):
        reasons.append(f"alibi slopes whose term at the farthest key ({farthest}) passes {MAX_ALIBI_TERM:.3g} (the "
                       "kernels work in log2 units: the score less it, times log2(e), would overflow float32)")
    return reasons


def _interpreter_reasons(inp) -> list[str]:
    if inp.device.startswith("cpu") and interpreting() and not _loaded_interpreting():
        return ["TRITON_INTERPRET=1 was set after triton was imported: set it before, for the interpreter"]
    return []


def _loaded_interpreting() -> bool:
    """Whether triton, as imported, runs kernels in the interpreter: it decides when each
    function is decorated, its own library's too (triton.language.standard)."""
    from triton.language import standard
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(standard.sigmoid, InterpretedFunction)


def _conjuncts(mask):
    """The parts of an &-chain of masks; a document mask's later rows (from_query, as a KV
    cache's steps make) as a document mask of those rows' ids."""
    if type(mask) is And:  # Or subclasses And: only a true conjunction splits
        return [p for part in mask.parts for p in _conjuncts(part)]
    if isinstance(mask, _LaterRows) and type(mask.inner) is Document:
        return [Document(mask.inner.ids[:, mask.offset:], mask.inner.kv_ids)]
    return [mask]


def _mask_reasons(inp) -> list[str]:
    """Why the kernels cannot take this mask (empty when they can)."""
    parts = [] if inp.mask is None else _conjuncts(inp.mask)
    others = [p for p in parts if not isinstance(p, (IntervalMask, Document))]
    if others:
        return [f"the triton kernel takes interval and document masks (and their &), not {others[0]!r}"]
    if sum(isinstance(p, Document) and not _sorted_ids(p) for p in parts) > 1:
        return ["the triton kernel compares one set of unsorted document ids inline, got several"]
    return []


def _plan_masks(inp) -> _MaskPlan:
    """The kernels' view of a mask that _mask_reasons accepts."""
    if isinstance(inp.mask, Causal):  # the common case needs no bounds from the host
        return _MaskPlan(causal_shift=inp.mask.shift(inp.geom))
    plan = _MaskPlan()
    for part in [] if inp.mask is None else _conjuncts(inp.mask):
        if isinstance(part, Document) and not _sorted_ids(part):
            plan.ids, plan.kv_ids = (np.ascontiguousarray(x, dtype=np.int64) for x in (part.ids, part.kv_ids))
            continue
        lo, hi = key_intervals(part, inp) if isinstance(part, IntervalMask) else _document_intervals(part, inp)
        plan.lo = lo if plan.lo is None else np.maximum(plan.lo, lo)
        plan.hi = hi if plan.hi is None else np.minimum(plan.hi, hi)
    return plan


def _sorted_ids(doc: Document) -> bool:
    return all((np.diff(x, axis=-1) >= 0).all() for x in (doc.ids, doc.kv_ids))


def _document_intervals(doc: Document, inp):
    """Sorted segment ids as intervals: query i sees the keys carrying its id, a contiguous run."""
    ids = np.broadcast_to(doc.ids, (inp.B, inp.Lq))
    kv_ids = np.broadcast_to(doc.kv_ids, (inp.B, inp.Lk))
    lo = np.stack([np.searchsorted(kv_ids[b], ids[b], side="left") for b in range(inp.B)])
    hi = np.stack([np.searchsorted(kv_ids[b], ids[b], side="right") - 1 for b in range(inp.B)])
    return clip_intervals(lo, hi, inp.Lk)


def query_block_ranges(lo, hi, Lq: int, Lk: int, block_m: int, block_n: int):
    """(first, end) int32 (B, nk): the query blocks [first, end) whose rows see keys of each key block."""
    batch, nq, nk = lo.shape[0], cdiv(Lq, block_m), cdiv(Lk, block_n)
    if nq == 0:  # no query block sees anything
        return np.zeros((batch, nk), np.int32), np.zeros((batch, nk), np.int32)
    pad = ((0, 0), (0, nq * block_m - Lq))
    lo, hi = np.pad(lo, pad, constant_values=Lk), np.pad(hi, pad, constant_values=-1)
    live = lo <= hi
    seen_lo = np.where(live, lo, Lk).reshape(batch, nq, block_m).min(-1)  # (B, nq)
    seen_hi = np.where(live, hi, -1).reshape(batch, nq, block_m).max(-1)
    k0 = np.arange(nk) * block_n
    k1 = np.minimum(k0 + block_n, Lk) - 1
    overlap = (seen_lo[:, :, None] <= k1) & (seen_hi[:, :, None] >= k0)  # (B, nq, nk)
    seen = overlap.any(1)
    first = np.where(seen, overlap.argmax(1), 0)
    end = np.where(seen, nq - overlap[:, ::-1].argmax(1), 0)
    return first.astype(np.int32), end.astype(np.int32)


# ---- launch configurations ------------------------------------------------------------------
@dataclass(frozen=True)
class Blocks:
    m: int  # query rows per program (per inner tile in dK/dV)
    n: int  # keys per inner tile (per program in dK/dV)
    warps: int = 4
    stages: int = 2


#: Largest first; a launch that runs out of shared memory or registers, or spills registers,
#: moves down the ladder.
#: The dQ kernel stays at 2 stages: with 3 at head dim 64, Triton 3.6 built code that stopped
#: with "misaligned address" on an H100 once more than one wave of programs ran.
LADDERS = {
    "forward": {64: [Blocks(128, 64, 4, 3), Blocks(64, 64, 4, 2), Blocks(32, 32, 4, 1)],
                128: [Blocks(128, 128, 8, 3), Blocks(128, 64, 8, 3), Blocks(64, 64, 4, 2), Blocks(32, 32, 4, 1)],
                256: [Blocks(128, 64, 8, 2), Blocks(64, 64, 8, 2), Blocks(64, 32, 4, 1), Blocks(32, 32, 4, 1)]},
    "dkdv": {64: [Blocks(32, 128, 4, 3), Blocks(32, 64, 4, 2), Blocks(16, 32, 4, 1)],
             128: [Blocks(32, 128, 8, 3), Blocks(32, 64, 4, 2), Blocks(16, 32, 4, 1)],
             256: [Blocks(32, 64, 8, 2), Blocks(16, 64, 4, 1), Blocks(16, 32, 4, 1)]},
    "dq": {64: [Blocks(128, 32, 4, 2), Blocks(64, 32, 4, 2), Blocks(32, 16, 4, 1)],
           128: [Blocks(128, 32, 8, 3), Blocks(64, 32, 4, 2), Blocks(32, 16, 4, 1)],
           256: [Blocks(64, 32, 8, 2), Blocks(32, 16, 4, 1), Blocks(16, 16, 4, 1)]},
}
#: Small tiles in the interpreter: more tile boundaries per test, numpy per program.
INTERPRETER_BLOCKS = {"forward": Blocks(32, 32), "dkdv": Blocks(16, 32), "dq": Blocks(32, 16)}

_chosen: dict = {}  # (kernel, head dims, dtype, flags) -> index in its ladder that compiled


def _ladder(kernel: str, head_dim: int, dtype: str) -> list[Blocks]:
    if interpreting():
        return [INTERPRETER_BLOCKS[kernel]]
    ladder = LADDERS[kernel][min(d for d in (64, 128, 256) if d >= head_dim)]
    return ladder[1:] if dtype == "float32" else ladder  # float32 tiles take twice the memory


def _launch(kernel: str, key: tuple, head_dim: int, dtype: str, run):
    """run(blocks) on the first rung of the ladder that fits this GPU; the rung is remembered.

    run returns the compiled kernel it launched. A rung whose kernel spills registers does not
    fit either, unless it is the last: the call runs again on the next rung, which overwrites
    every output, so every call gives the result of the rung that stays (float32 at head dim
    128 spilled 1798 registers on an H100 and ran 50 times as slow as torch's SDPA)."""
    from triton.runtime.errors import OutOfResources

    ladder = _ladder(kernel, head_dim, dtype)
    start = _chosen.get((kernel, key), 0)
    for index in range(start, len(ladder)):
        last = index == len(ladder) - 1
        try:
            compiled = run(ladder[index])
        except OutOfResources:
            if last:
                raise
            continue
        if getattr(compiled, "n_spills", 0) and not last:
            continue
        _chosen[(kernel, key)] = index
        return


# ---- calls --------------------------------------------------------------------------------
@dataclass
class _Call:
    """One attention call: its inputs, its mask plan and (once made) their device arguments."""

    inp: object
    plan: _MaskPlan
    _args: object = None

    def device_args(self, q) -> "_DeviceArgs":
        """Made on the first kernel launch and kept for the backward (one host-to-device copy)."""
        if self._args is None:
            self._args = _DeviceArgs(self, q)
        return self._args


def _pow2(n: int) -> int:
    return max(16, 1 << (n - 1).bit_length())


class _DeviceArgs:
    """The mask and modifier arguments on the inputs' device (a 1-element dummy for absent ones)."""

    def __init__(self, call: _Call, q):
        import torch

        inp, plan = call.inp, call.plan
        self.device = q.device
        self.dummy = _dummy(q.device)
        put = self.to_device
        self.lo, self.hi, self.ids, self.kv_ids = (put(x) for x in (plan.lo, plan.hi, plan.ids, plan.kv_ids))
        alibi = next((m for m in inp.score_mods if isinstance(m, Alibi)), None)
        softcap = next((m for m in inp.score_mods if isinstance(m, Softcap)), None)
        self.slopes = put(None if alibi is None else alibi.slopes.astype(np.float32))
        self.softcap = 1.0 if softcap is None else float(softcap.cap)
        self.strides = (self.lo.stride(0) if plan.lo is not None else 0,
                        self.ids.stride(0) if plan.ids is not None and plan.ids.shape[0] > 1 else 0,
                        self.kv_ids.stride(0) if plan.kv_ids is not None and plan.kv_ids.shape[0] > 1 else 0)
        self.causal_shift = plan.causal_shift or 0
        self.flags = dict(HAS_INTERVAL=plan.lo is not None or plan.causal_shift is not None,
                          HAS_CAUSAL=plan.causal_shift is not None, HAS_IDS=plan.ids is not None,
                          HAS_ALIBI=alibi is not None, HAS_SOFTCAP=softcap is not None)

    def to_device(self, array):
        """A NumPy array on the inputs' device; the dummy for None. The copy leaves from pinned
        memory without waiting: a pageable one would wait for the kernels queued before it, and
        the GPU would idle while the host prepares the next launch."""
        import torch

        if array is None:
            return self.dummy
        host = torch.from_numpy(np.ascontiguousarray(array))
        if self.device.type != "cuda":
            return host
        return host.pin_memory().to(self.device, non_blocking=True)

    def shapes(self, inp):
        # One padded width for both head dims: when the key width is padded wider than the value
        # width, Triton 3.6 built forwards for an H100 that gave wrong results or read outside
        # shared memory (D=17 or 24 with Dv=5 or 8, float16).
        width = _pow2(max(inp.D, inp.Dv))
        return dict(D=inp.D, DV=inp.Dv, GROUP=inp.group, BLOCK_D=width, BLOCK_DV=width,
                    DOT=_dot_mode(inp.dtype), **self.flags)


@functools.cache
def _dummy(device):
    """A 1-element stand-in for absent pointer arguments (never read), one per device."""
    import torch

    return torch.zeros(1, dtype=torch.int32, device=device)


def _on_device(q):
    """Triton launches on the current CUDA device: make it the inputs' one."""
    import torch

    return torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext()


def _dot_mode(dtype: str) -> str:
    """How the kernels multiply (see _triton_kernels._dot)."""
    if dtype == "float32":
        return "ieee"
    return "widen" if dtype == "bfloat16" and interpreting() else "native"


def _cache_key(inp, args):
    return (inp.D, inp.Dv, inp.dtype, tuple(args.flags.values()))


def _forward(call: _Call, q, k, v, float32_out=False):
    """(out (B, Hq, Lq, Dv) in q's dtype, or float32 with float32_out, lse and lse_lo (B, Hq, Lq)
    float32)."""
    import torch

    from . import _triton_kernels as kernels

    inp = call.inp
    args = call.device_args(q)
    out = torch.empty(inp.B, inp.Hq, inp.Lq, inp.Dv, dtype=torch.float32 if float32_out else q.dtype, device=q.device)
    lse, lse_lo = (torch.empty(inp.B, inp.Hq, inp.Lq, dtype=torch.float32, device=q.device) for _ in range(2))

    def run(blocks):
        return kernels.attention_forward[(cdiv(inp.Lq, blocks.m), inp.Hq, inp.B)](
            q, k, v, out, lse, lse_lo, args.lo, args.hi, args.ids, args.kv_ids, args.slopes,
            *q.stride(), *k.stride(), *v.stride(), *out.stride(), *args.strides,
            inp.Hq, inp.Lq, inp.Lk, inp.scale, args.softcap, args.causal_shift, **args.shapes(inp),
            BLOCK_M=blocks.m, BLOCK_N=blocks.n, num_warps=blocks.warps, num_stages=blocks.stages)

    with _on_device(q):
        _launch("forward", _cache_key(inp, args) + (out.dtype,), max(inp.D, inp.Dv), inp.dtype, run)
    return out, lse, lse_lo


def _backward(call: _Call, q, k, v, out, lse, dout, dlse, lse_lo=None):
    import torch

    from . import _triton_kernels as kernels

    inp, plan = call.inp, call.plan
    args = call.device_args(q)
    delta = softmax_delta(out, dout, dlse).contiguous()  # (B, Hq, Lq)
    lse = lse.contiguous()
    lse_lo = torch.zeros_like(lse) if lse_lo is None else lse_lo.contiguous()
    dq, dk, dv = (torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in (q, k, v))

    def run_dkdv(blocks):
        if plan.lo is None:
            first = end = args.dummy
        else:
            first, end = map(args.to_device, query_block_ranges(plan.lo, plan.hi, inp.Lq, inp.Lk, blocks.m, blocks.n))
        return kernels.attention_backward_dkdv[(cdiv(inp.Lk, blocks.n), inp.Hkv, inp.B)](
            q, k, v, dout, lse, lse_lo, delta, dk, dv, args.lo, args.hi, args.ids, args.kv_ids, args.slopes, first, end,
            *q.stride(), *k.stride(), *v.stride(), *dout.stride(), *dk.stride(), *dv.stride(),
            *args.strides, first.stride(0) if first.dim() == 2 else 0,
            inp.Hq, inp.Lq, inp.Lk, inp.scale, args.softcap, args.causal_shift, **args.shapes(inp),
            BLOCK_M=blocks.m, BLOCK_N=blocks.n, num_warps=blocks.warps, num_stages=blocks.stages)

    def run_dq(blocks):
        return kernels.attention_backward_dq[(cdiv(inp.Lq, blocks.m), inp.Hq, inp.B)](
            q, k, v, dout, lse, lse_lo, delta, dq, args.lo, args.hi, args.ids, args.kv_ids, args.slopes,
            *q.stride(), *k.stride(), *v.stride(), *dout.stride(), *dq.stride(), *args.strides,
            inp.Hq, inp.Lq, inp.Lk, inp.scale, args.softcap, args.causal_shift, **args.shapes(inp),
            BLOCK_M=blocks.m, BLOCK_N=blocks.n, num_warps=blocks.warps, num_stages=blocks.stages)

    key = _cache_key(inp, args)
    with _on_device(q):
        _launch("dkdv", key, max(inp.D, inp.Dv), inp.dtype, run_dkdv)
        _launch("dq", key, max(inp.D, inp.Dv), inp.dtype, run_dq)
    return dq, dk, dv
