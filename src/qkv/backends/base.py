"""What every backend shares: capabilities as data, refusals that explain themselves,
tile classes per row, counter-based dropout and the tile counter used by tests."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import _arrays
from ..masks import EMPTY, FULL, PARTIAL, Alibi, Bias, ScoreFn, Softcap, tile_indices


@dataclass(frozen=True)
class Capabilities:
    kinds: tuple  # array kinds it takes: "numpy", "torch"
    devices: tuple  # device types ("cpu", "cuda"); empty means any
    dtypes: tuple
    max_head_dim: int | None = None
    # score modifiers a kernel applies inline, each at most once and softcap last; None: any,
    # in any order and number
    inline_mods: tuple | None = None
    gradients: bool = False  # torch autograd through it
    forward_ad: bool = False  # carries torch.autograd.forward_ad tangents through
    dropout: bool = False
    materializes: bool = False  # holds the Lq x Lk matrix (never chosen automatically)


class Backend:
    """A way to compute attention. Subclasses set `name`, `caps` and implement `forward`."""

    name = "?"
    caps: Capabilities
    automatic = True  # may `backend=None` pick it
    rereads_rules = False  # its backward reads the mask's and biases' arrays again (inp.held_tensors)

    def missing(self) -> str | None:
        """Why this backend cannot run at all here (a library is missing), or None."""
        return None

    def detail(self) -> str | None:
        """How it runs here, for `qkv info` (an instruction set, threads), or None."""
        return None

    def unsupported(self, inp) -> list[str]:
        """Reasons this backend cannot run this call; empty means it can."""
        caps, reasons = self.caps, []
        if inp.kind not in caps.kinds:  # checked first: a NumPy call never imports torch
            reasons.append(f"takes {' or '.join(caps.kinds)} arrays, got {inp.kind}")
        elif missing := self.missing():
            return [missing]
        device_type = inp.device.split(":")[0]
        if not self.accepts_device(device_type):
            reasons.append(f"runs on {'/'.join(caps.devices)}, inputs are on {inp.device}")
        if inp.dtype not in caps.dtypes:
            reasons.append(f"supports {', '.join(caps.dtypes)}, got {inp.dtype}")
        if caps.max_head_dim and max(inp.D, inp.Dv) > caps.max_head_dim:
            reasons.append(f"head dims up to {caps.max_head_dim}, got D={inp.D}, Dv={inp.Dv}")
        if inp.needs_grad and not caps.gradients:
            reasons.append("no autograd support (inputs require grad)")
        if inp.kind == "torch" and not caps.forward_ad and inp.carries_tangents():
            reasons.append("no forward-mode derivative (these inputs, or tensors the mask reads, carry tangents)")
        if inp.dropout_p > 0 and not caps.dropout:
            reasons.append("no dropout")
        if caps.inline_mods is not None:
            reasons += inline_score_mod_reasons(inp, caps.inline_mods, f"the {self.name} kernel")
        return reasons + self.extra_reasons(inp)

    def extra_reasons(self, inp) -> list[str]:
        return []

    def accepts_device(self, device_type: str) -> bool:
        return not self.caps.devices or device_type in self.caps.devices

    @property
    def runs_on_cpu(self) -> bool:
        """Whether it is a CPU implementation (what CPU-only tests, checks and benchmarks run)."""
        return not self.caps.devices or "cpu" in self.caps.devices

    @property
    def ever_automatic(self) -> bool:
        """Whether `backend=None` may ever pick it (never for one holding the Lq x Lk matrix)."""
        return self.automatic and not self.caps.materializes

    def automatic_refusal(self, inp) -> str | None:
        """Why `backend=None` must not pick this backend for these inputs (it may still be named)."""
        return None if self.ever_automatic else "never chosen automatically (holds the Lq x Lk matrix)"

    def block_sizes(self, inp) -> tuple[int, int] | None:
        """(block_q, block_k) of a tiled kernel for these inputs; None if it does not tile."""
        return None

    def forward(self, inp):
        """(out (B, Hq, Lq, Dv), lse (B, Hq, Lq)) of the inputs' kind."""
        raise NotImplementedError

    def workspace_bytes(self, inp) -> int:
        """Extra memory this backend needs beyond inputs and outputs (an estimate)."""
        raise NotImplementedError

    def __repr__(self):
        return f"<qkv backend {self.name}>"


def autograd_attention(forward, backward, q, k, v, state, held=()):
    """(out, lse) under torch autograd, from forward(state, q, k, v) -> (out, lse, lse_lo), with
    the gradients from backward(state, q, k, v, out, lse, dout, dlse, lse_lo=lse_lo) -> (dq, dk, dv).
    dlse may be None. lse_lo (or None) is what lse's float32 rounding lost: the backward's
    P = exp(s - lse - lse_lo) is then as exact at large scores as at small ones. forward may
    give out wider than q (as summed): the caller gets it in q's dtype, the backward as it
    came, so rowsum(dO ∘ O) does not take bfloat16's rounding of O (dq off by 0.0225 where
    the rule allowed 0.0176).

    held: the mask and bias tensors the backward reads again. They are saved with q, k and v,
    so a backward after any of them changed in place is refused, as torch refuses it.
    One torch.autograd.Function serves every tiled implementation (torch, native, the ring).
    """
    return _attention_function().apply(q, k, v, (forward, backward, state), *held)


_function = None

#: What the backward says when asked for second derivatives (it is not itself differentiable).
ONCE_DIFFERENTIABLE = ("qkv.attention's backward is not differentiable: second derivatives (create_graph=True, "
                       "hessians, hvp) are not supported; differentiate qkv.attention_weights(q, k, ...) @ v, "
                       "which records the plain formula")


#: What the backward says when a tensor it reads again changed in place after the forward.
CHANGED_SINCE_FORWARD = ("a dense mask, a bias or a tensor a mask_fn or score_fn rule reads changed in place after "
                         "qkv.attention's forward: its backward reads them again, so the gradients would be wrong; "
                         "change them after the backward, or pass a copy")


BATCHED_GRADIENTS = ("qkv.attention's backward takes one gradient at a time: batched gradients "
                     "(is_grads_batched=True, jacobian(vectorize=True), gradcheck's check_batched_grad) are not "
                     "supported; loop over the gradients instead")


def _attention_function():
    global _function
    if _function is not None:
        return _function
    import torch

    class Attention(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, job, *held):
            run_forward, _, state = job
            out, lse, lse_lo = run_forward(state, q, k, v)
            ctx.save_for_backward(q, k, v, out, lse, lse_lo, *held)  # held: checked for in-place changes only
            ctx.job, ctx.held = job, len(held)
            # and by their versions too: under allow_mutation_on_saved_tensors torch saves a copy
            # and lets the change pass, but the backward reads the rules' own tensors again
            ctx.held_versions = [(t, t._version) for t in held]
            ctx.set_materialize_grads(False)
            return out.to(q.dtype), lse

        @staticmethod
        def backward(ctx, dout, dlse):
            if torch.is_grad_enabled():  # the engine enables grad in a backward only for create_graph=True
                raise RuntimeError(ONCE_DIFFERENTIABLE)
            if any(g is not None and torch._C._functorch.is_legacy_batchedtensor(g) for g in (dout, dlse)):
                raise TypeError(BATCHED_GRADIENTS)  # autograd's own vmap (is_grads_batched)
            q, k, v, out, lse, lse_lo = ctx.saved_tensors[:6]
            if any(t._version != version for t, version in ctx.held_versions):
                raise RuntimeError(CHANGED_SINCE_FORWARD)
            _, run_backward, state = ctx.job
            dout = torch.zeros(out.shape, dtype=q.dtype, device=out.device) if dout is None else dout
            with _arrays.autocast_off(q):
                grads = run_backward(state, q, k, v, out, lse, dout, dlse, lse_lo=lse_lo)
            return (*grads, None) + (None,) * ctx.held

        @staticmethod
        def jvp(ctx, *tangents):
            raise NotImplementedError("qkv.attention has no forward-mode derivative on this backend "
                                      "(torch.autograd.forward_ad, torch.func.jvp) while it records gradients; "
                                      "under torch.no_grad(), or with inputs that do not require grad, the "
                                      "automatic choice (backend='torch') computes it with torch's own operations "
                                      "(the modules' calls too)")

    _function = Attention
    return _function


def saved_output_bytes(inp) -> int:
    """What the backward keeps beyond the output: the output as summed, in float32, where the
    inputs are bfloat16 or float16 and gradients are wanted (see autograd_attention)."""
    return 4 * inp.B * inp.Hq * inp.Lq * inp.Dv if inp.needs_grad and inp.dtype in ("bfloat16", "float16") else 0


def split_lse(m, log_l):
    """(lse, lse_lo) of the torch tensors m (row maxima) and log_l (log of the sums under them):
    lse = m + log_l rounded, and lse_lo what that rounding lost. m - lse is exact wherever
    log_l is small against m (Sterbenz), so lse + lse_lo keeps m's precision; the backward's
    exp(s - lse - lse_lo) then errs by log_l's rounding only, not by |lse|·6e-8 (float32)."""
    import torch

    lse = m + log_l
    return lse, torch.where(torch.isfinite(lse), (m - lse) + log_l, 0.0)


def softmax_delta(out, dout, dlse):
    """rowsum(dO ∘ O) - dlse (B, Hq, Lq) in float32: the backward's per-row softmax term."""
    delta = (dout.float() * out.float()).sum(-1)
    return delta if dlse is None else delta - dlse.float()


def inline_score_mod_reasons(inp, inline_kinds: tuple, who: str) -> list[str]:
    """Reasons a kernel that applies `inline_kinds` modifiers inline (each at most once,
    softcap last) cannot run these score modifiers."""
    if not inp.score_mods:
        return []
    kinds = [type(m) for m in inp.score_mods]
    others = [k for k in kinds if k not in inline_kinds]
    if others:
        return [f"{who} applies {mod_names(inline_kinds)} inline, not {mod_names(others)}"]
    if len(set(kinds)) != len(kinds) or (Softcap in kinds and kinds.index(Softcap) != len(kinds) - 1):
        return [f"{who} applies each of {mod_names(inline_kinds)} at most once, softcap last"]
    return []


_MOD_NAMES = {Alibi: "alibi", Bias: "bias", Softcap: "softcap", ScoreFn: "score_fn"}


def mod_names(kinds) -> str:
    """Score modifier classes as their constructors' names: 'alibi, softcap'."""
    return ", ".join(_MOD_NAMES.get(k, k.__name__) for k in kinds)


def key_intervals(mask, inp):
    """Per (batch row, query) key bounds lo <= j <= hi of an IntervalMask: int32 (B, Lq),
    clipped to [-1, Lk]."""
    probe = np.zeros(0)
    b, _, qi, _ = tile_indices(probe, np.arange(inp.B), [0], 0, inp.Lq, 0, 1)
    lo, hi = (np.broadcast_to(x, (inp.B, 1, inp.Lq, 1))[:, 0, :, 0] for x in mask.interval(b, qi, inp.geom))
    return clip_intervals(lo, hi, inp.Lk)


def clip_intervals(lo, hi, Lk: int):
    clip = lambda x: np.ascontiguousarray(np.clip(x, -1, Lk), dtype=np.int32)  # noqa: E731
    return clip(lo), clip(hi)


def compute_dtype_name(dtype: str) -> str:
    """Low precision accumulates in float32; float64 stays float64."""
    return "float64" if dtype == "float64" else "float32"


# --------------------------------------------------------------------------------------
# Tile classes per row: a row is one (batch, kv head) pair holding its `group` query heads
# --------------------------------------------------------------------------------------
def row_tile_classes(inp, block_q: int, block_k: int):
    """Tile classes (B*Hkv, nq, nk) for the rows of a tiled kernel, or None when no mask.

    A row's tile is EMPTY only if it is empty for all its query heads and FULL only if
    full for all of them.
    """
    if inp.mask is None:
        return None
    known = inp.tile_classes.get((block_q, block_k))  # dispatch may have needed them already
    if known is None:
        known = inp.tile_classes[block_q, block_k] = _row_tile_classes(inp, block_q, block_k)
    return known


def _row_tile_classes(inp, block_q: int, block_k: int):
    blocks = inp.mask.tile_classes(inp.geom, block_q, block_k)
    nq, nk = blocks.shape[-2:]
    per_head = np.broadcast_to(blocks, (inp.B, inp.Hq, nq, nk)).reshape(inp.B, inp.Hkv, inp.group, nq, nk)
    empty = (per_head == EMPTY).all(axis=2)
    full = (per_head == FULL).all(axis=2)
    classes = np.where(empty, EMPTY, np.where(full, FULL, PARTIAL)).astype(np.int8)
    return classes.reshape(inp.B * inp.Hkv, nq, nk)


class TileCounter:
    """Counts (row, query tile, key tile) units a kernel computed and masked (for tests)."""

    def __init__(self):
        self.computed = 0
        self.masked = 0


#: Set to a TileCounter to count tiles (tests do this); None costs nothing.
tile_counter: TileCounter | None = None


def count_tiles(computed: int, masked: int) -> None:
    if tile_counter is not None:
        tile_counter.computed += computed
        tile_counter.masked += masked


#: The tolerance rule's absolute term per dtype: a backend in dtype t may be off the float64
#: oracle by at most 2 * (what the plain formula run in t is off) + ATOL[t].
ATOL = {"float64": 1e-12, "float32": 2e-6, "float16": 2e-3, "bfloat16": 1e-2}


def within_rule(err: float, reference_err: float, dtype: str) -> bool:
    return err <= 2 * reference_err + ATOL[dtype]


def max_error(got, want) -> float:
    """Largest |got - want| where want is finite; a NaN anywhere, or a finite value where want is
    -inf (a row with no key), is an infinite error. got: an array, or a CPU tensor of any dtype."""
    got = np.asarray(got if isinstance(got, np.ndarray) else got.tolist(), dtype=np.float64)  # bfloat16 tensors too
    want = np.asarray(want, dtype=np.float64)
    finite = np.isfinite(want)
    if np.isnan(got).any() or not np.array_equal(got[~finite], want[~finite]):
        return float("inf")
    return float(np.abs(got[finite] - want[finite]).max(initial=0.0))


# --------------------------------------------------------------------------------------
# Dropout from a counter-based hash: the keep decision for (b, h, i, j) depends only on
# the seed and the indices, so forward and backward, tiled or not, NumPy or torch,
# all drop exactly the same entries.
# --------------------------------------------------------------------------------------
_M32 = 0xFFFFFFFF


def _mix32(x):
    """The murmur3 32-bit finaliser in int64 arithmetic (NumPy or torch)."""
    x = x & _M32
    x = x ^ (x >> 16)
    x = (x * 0x85EBCA6B) & _M32
    x = x ^ (x >> 13)
    x = (x * 0xC2B2AE35) & _M32
    return x ^ (x >> 16)


def dropout_keep(seed: int, dropout_p: float, heads: int, b, h, qi, ki):
    """Boolean keep mask for broadcast indices (b, h, qi, ki): True with probability 1 - p."""
    low, high = seed & _M32, seed >> 32  # a seed below 2**64: both words count
    # with torch, the words as int64 tensors: torch.compile may trace the seed as a symbol, and
    # its C++ code then shifted the symbol's words as floats
    word = (lambda w: qi.new_full((), w)) if _arrays.is_torch(qi) else (lambda w: w)  # noqa: E731
    x = _mix32(_mix32(b * heads + h) ^ word(low))
    if high:  # seeds below 2**32 skip this round, so their masks are what they always were
        x = _mix32(x ^ word(high))
    x = _mix32(x ^ qi)
    x = _mix32((x + ki * 0x9E3779B1) & _M32)
    threshold = int(round((1.0 - dropout_p) * 2**32))  # in steps of 2**-32: see inputs.DROPOUT_P_MAX
    return x < threshold


def dropout_scale_tile(inp, b, h, qi, ki, like):
    """Keep mask / (1 - p) for a tile, as float in like's dtype (None when no dropout)."""
    if inp.dropout_p == 0:
        return None
    keep = dropout_keep(inp.seed, inp.dropout_p, inp.Hq, b, h, qi, ki)
    return _arrays.cast_like(keep, like) * (1.0 / (1.0 - inp.dropout_p))


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def nbytes(dtype: str) -> int:
    return {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}[dtype]


def dropout_bytes_per_score(inp, int64_words: int, float_copies: int) -> int:
    """Dropout's temporaries per score of a tile: the hash's int64 words alive at once, the
    keep mask, and copies of a tile in the compute dtype (the keep mask as floats, scaled,
    the dropped weights). How many of each a backend holds at once: measured, see its callers."""
    if inp.dropout_p == 0:
        return 0
    return inp.group * (8 * int64_words + 1 + float_copies * nbytes(compute_dtype_name(inp.dtype)))


def tile_workspace(rows_at_once: int, block_q: int, block_k: int, group: int, d: int, dv: int, dtype: str) -> int:
    """Bytes of a tiled kernel's live temporaries: score tiles (x3 for exp/mask), accumulators."""
    c = nbytes(compute_dtype_name(dtype))
    scores = 3 * rows_at_once * group * block_q * block_k * c
    accum = rows_at_once * group * block_q * (dv + d + 3) * c
    return int(scores + accum)
