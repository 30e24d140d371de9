"""Ring attention: exact attention over a sequence sharded across torch.distributed ranks.

When a sequence does not fit one process (or one device), each of the P ranks of a
process group keeps one shard of Q, K and V. The K/V shards travel around the ring
(rank r sends to r+1 and receives from r-1) with asynchronous send/recv that overlaps
the attention of the block already here; the partial results are merged exactly by
their log-sum-exp. The backward recomputes each block's gradients from the global lse
and output (with the block backend's fused backward where it has one, else torch ops a
few rows at a time), and the dK/dV accumulators travel around the ring with their K/V
block until they arrive back at its owner. Per-rank memory is O(L/P).

Every rank of the group must make the same calls in the same order, the backward
included: each ring step waits for the neighbours.

Shape legend (per rank; P = size of the process group, ... = batch dims):
    q    (..., Hq, Lq/P, D)     this rank's shard of the queries
    k    (..., Hkv, Lk/P, D)    this rank's shard of the keys (Hq a multiple of Hkv: GQA)
    v    (..., Hkv, Lk/P, Dv)   this rank's shard of the values
    out  (..., Hq, Lq/P, Dv)    this rank's shard of the attention over the whole sequence
    lse  (..., Hq, Lq/P)        float32 (float64 for float64 inputs), natural log

Layouts: how a sequence of length L is cut into chunks and dealt to the ranks
(L = 8, P = 2)::

    positions       0 1 2 3 4 5 6 7
    contiguous      0 0 0 0 1 1 1 1     P chunks: rank r holds chunk r
    zigzag          0 0 1 1 1 1 0 0     2P chunks: rank r holds chunk r and chunk 2P-1-r

With a causal mask the contiguous layout gives the last rank P times the work of the
first; zigzag gives every rank the same work (one chunk from the front, its mirror from
the back). Blocks that the mask hides completely are skipped: no compute, no NaN.

Masks: None, ``qkv.causal()`` (either alignment), ``qkv.padding(kv_lengths, q_lengths)``
with GLOBAL lengths, and ``causal() & padding(...)``. Other masks raise a ValueError.

Run it under torchrun (see docs/distributed.md)::

    torch.distributed.init_process_group("nccl")          # or "gloo" on CPUs
    rank, world = dist.get_rank(), dist.get_world_size()
    q_local = qkv.distributed.shard(q, rank, world, layout="zigzag")   # or shard as you load
    out_local = qkv.distributed.ring_attention(q_local, k_local, v_local, qkv.causal(),
                                               layout="zigzag")
"""
from __future__ import annotations

import hashlib
import math
import struct
from dataclasses import dataclass

import numpy as np

from . import _arrays, inputs
from .backends.base import autograd_attention
from .masks import Causal, Geometry, Padding

LAYOUTS = ("contiguous", "zigzag")

#: Score elements (rows x keys x heads x batch) held at once by the backward of one block.
BACKWARD_PIECE_ELEMENTS = 1 << 20

_KV_TAG, _DKV_TAG = 0, 2  # K, V use tags 0, 1; dK, dV use 2, 3


# ======================================================================================
# Layouts: shard, unshard, positions
# ======================================================================================
def chunks_per_rank(layout: str) -> int:
    """How many chunks of the sequence each rank holds: 1 (contiguous) or 2 (zigzag)."""
    return 2 if inputs.check_choice("layout", layout, LAYOUTS) == "zigzag" else 1


def rank_chunks(rank: int, world: int, layout: str) -> list[int]:
    """The global chunk indices held by `rank`, in the order they sit in its shard."""
    rank, world = _check_rank_world(rank, world)
    return [rank, 2 * world - 1 - rank] if chunks_per_rank(layout) == 2 else [rank]


def _check_rank_world(rank, world):
    world = inputs.check_positive_int("world", world)
    if not inputs._is_int(rank) or not 0 <= rank < world:
        raise ValueError(f"rank must be an integer in [0, world) = [0, {world}), got {rank!r}")
    return int(rank), world


def _check_divisible(name: str, length: int, world: int, layout: str) -> int:
    """The chunk length; a clear error when `length` does not split into the layout's chunks."""
    n_chunks = world * chunks_per_rank(layout)
    if length % n_chunks:
        raise ValueError(f"{name} = {length} must be divisible by the number of chunks of layout "
                         f"{layout!r}: {chunks_per_rank(layout)} per rank x world {world} = {n_chunks}")
    return length // n_chunks


def positions(rank: int, world: int, length: int, layout: str = "contiguous") -> np.ndarray:
    """The global positions (int64, shape (length/world,)) of the tokens `rank` holds.

    Use them for anything that depends on a token's place in the whole sequence, such
    as rotary embeddings: ``qkv.positional`` tables indexed by these positions.
    """
    rank, world = _check_rank_world(rank, world)
    size = _check_divisible("length", inputs.check_nonnegative_int("length", length), world, layout)
    return np.concatenate([np.arange(c * size, (c + 1) * size, dtype=np.int64)
                           for c in rank_chunks(rank, world, layout)])


def _axis(x, dim: int) -> int:
    if not inputs._is_int(dim) or not -x.ndim <= dim < x.ndim:
        raise ValueError(f"dim must be an integer in [-{x.ndim}, {x.ndim}) for an array of shape "
                         f"{tuple(x.shape)}, got {dim!r}")
    return dim % x.ndim


def _take(x, axis: int, start: int, stop: int):
    return x[(slice(None),) * axis + (slice(start, stop),)]


def _concat(parts, axis: int):
    if _arrays.is_torch(parts[0]):
        import torch

        return torch.cat(parts, dim=axis).contiguous()
    return np.ascontiguousarray(np.concatenate(parts, axis=axis))


def shard(x, rank: int, world: int, layout: str = "contiguous", dim: int = -2):
    """This rank's shard of a full-sequence array (a contiguous copy, ready to send).

    Args:
        x: NumPy array or torch tensor holding the whole sequence along `dim`,
            e.g. q (..., H, L, D) with dim=-2, or an lse (..., H, L) with dim=-1.
        rank, world: this rank and the number of ranks.
        layout: "contiguous" (rank r holds chunk r of P) or "zigzag" (chunks r and
            2P-1-r of 2P, which balances causal work).
        dim: the sequence dim.

    Returns:
        (..., L/world, ...) of x's kind: the rank's chunks, in order.
    Raises ValueError when L is not divisible by the layout's chunk count.
    """
    rank, world = _check_rank_world(rank, world)
    if _arrays.kind_of(x) is None:
        raise TypeError(f"x must be a numpy.ndarray or torch.Tensor, got {type(x).__name__}")
    axis = _axis(x, dim)
    size = _check_divisible(f"the sequence length x.shape[{dim}]", x.shape[axis], world, layout)
    return _concat([_take(x, axis, c * size, (c + 1) * size) for c in rank_chunks(rank, world, layout)], axis)


def unshard(shards, layout: str = "contiguous", dim: int = -2):
    """The full sequence from every rank's shard (a list in rank order): the inverse of `shard`.

    Args:
        shards: [shard of rank 0, shard of rank 1, ...], all of one shape (..., L/P, ...).
        layout, dim: as given to `shard`.
    Returns:
        (..., L, ...) of the shards' kind.
    """
    if not isinstance(shards, (list, tuple)) or not shards:
        raise ValueError(f"shards must be a non-empty list (one shard per rank, in rank order), got {shards!r:.80}")
    world, per_rank = len(shards), chunks_per_rank(layout)
    kinds = [(_arrays.kind_of(s), inputs.dtype_name(s) if _arrays.kind_of(s) else type(s).__name__) for s in shards]
    if len(set(kinds)) > 1 or kinds[0][0] is None:  # no silent casts, as everywhere in qkv
        raise TypeError(f"every shard must be an array of one kind and dtype; got {kinds}")
    shapes = {tuple(s.shape) for s in shards}
    if len(shapes) > 1:
        raise ValueError(f"every shard must have the same shape; got {[tuple(s.shape) for s in shards]}")
    axis = _axis(shards[0], dim)
    local = shards[0].shape[axis]
    if local % per_rank:
        raise ValueError(f"with layout {layout!r} each shard holds {per_rank} chunks, so its length "
                         f"(shape[{dim}] = {local}) must be divisible by {per_rank}")
    size = local // per_rank
    chunks = [None] * (world * per_rank)
    for rank, part in enumerate(shards):
        for i, c in enumerate(rank_chunks(rank, world, layout)):
            chunks[c] = _take(part, axis, i * size, (i + 1) * size)
    return _concat(chunks, axis)


# ======================================================================================
# Masks over the global sequence, planned block by block
# ======================================================================================
_ALIGNS = (None, "bottom_right", "top_left")  # _MaskSpec.code's numbers for the causal alignment


@dataclass(frozen=True)
class _MaskSpec:
    """The supported masks, as data: causal alignment and/or global padding lengths."""

    causal_align: str | None = None
    kv_lengths: np.ndarray | None = None  # (B,) global
    q_lengths: np.ndarray | None = None  # (B,) global, or None

    @property
    def empty(self) -> bool:
        return self.causal_align is None and self.kv_lengths is None

    def code(self) -> list[int]:
        """A few integers that identify the mask (compared across ranks)."""
        align = _ALIGNS.index(self.causal_align)
        return [align, _digest(self.kv_lengths), _digest(self.q_lengths)]


def _digest(lengths) -> int:
    """A signed 64-bit hash of a lengths array (-1 for None): ranks with other lengths differ."""
    if lengths is None:
        return -1
    data = np.ascontiguousarray(lengths, dtype=np.int64).tobytes()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little", signed=True)


def _float_bits(x: float) -> int:
    """The float64's bits as a signed int64: equal exactly when the floats are."""
    return struct.unpack("<q", struct.pack("<d", x))[0]


_SUPPORTED = "mask=None, qkv.causal(), qkv.padding(kv_lengths, q_lengths) or qkv.causal() & qkv.padding(...)"


def _parse_mask(mask) -> _MaskSpec:
    if mask is None:
        return _MaskSpec()
    parts = _flatten_and(mask)
    causal = [p for p in parts if isinstance(p, Causal)]
    pads = [p for p in parts if isinstance(p, Padding)]
    others = [p for p in parts if not isinstance(p, (Causal, Padding))]
    if others or len(causal) > 1 or len(pads) > 1:
        what = repr(mask) if not _arrays.kind_of(mask) else f"an array of shape {tuple(mask.shape)}"
        raise ValueError(f"ring_attention supports {_SUPPORTED}; got mask {what}")
    pad = pads[0] if pads else None
    return _MaskSpec(causal[0].align if causal else None,
                     None if pad is None else pad.kv_lengths, None if pad is None else pad.q_lengths)


def _flatten_and(mask) -> list:
    """The conjuncts of `a & b & ...` (a single mask is one conjunct)."""
    from .masks import And, IntervalIntersection

    if type(mask) in (And, IntervalIntersection):  # not Or, a subclass of And
        return [p for part in mask.parts for p in _flatten_and(part)]
    return [mask]


@dataclass(frozen=True)
class _Segment:
    """Rows [start, stop) of a shard, holding the global positions global_start, ... ."""

    start: int
    stop: int
    global_start: int


def _segments(owner: int, world: int, layout: str, local_len: int, spec: _MaskSpec) -> list[_Segment]:
    """The chunks of `owner`'s shard (one segment for everything when there is no mask)."""
    if spec.empty:
        return [_Segment(0, local_len, -1)]
    size = local_len // chunks_per_rank(layout)
    return [_Segment(i * size, (i + 1) * size, c * size) for i, c in enumerate(rank_chunks(owner, world, layout))]


@dataclass(frozen=True)
class _Block:
    """Query rows [q0, q1) of this rank against key rows [k0, k1) of a visiting block."""

    q0: int
    q1: int
    k0: int
    k1: int
    q_global: int  # global position of query row q0
    k_global: int  # global position of key row k0
    mask: object  # the qkv mask inside the block; None when every pair is allowed


def _plan(spec: _MaskSpec, q_segs, k_segs, causal_offset: int) -> tuple[list[_Block], int]:
    """The blocks with at least one allowed pair, and how many were skipped as fully masked."""
    blocks, skipped = [], 0
    for qs in q_segs:
        for ks in k_segs:
            block = _plan_block(spec, qs, ks, causal_offset)
            if block is None:
                skipped += 1
            else:
                blocks.append(block)
    return blocks, skipped


def _plan_block(spec: _MaskSpec, qs: _Segment, ks: _Segment, causal_offset: int) -> _Block | None:
    """One segment pair as a block (query rows that see nothing in it are dropped), or None.

    Causal, globally: query i sees key j <= i + causal_offset. Inside the block (local
    rows qi, kj) that is kj <= qi + d with d = q_global - k_global + causal_offset.
    """
    from . import masks

    nq, nk = qs.stop - qs.start, ks.stop - ks.start
    first, parts = 0, []
    if spec.causal_align is not None:
        d = qs.global_start - ks.global_start + causal_offset
        if nq - 1 + d < 0:  # even the last query row is before the first key
            return None
        first = max(0, -d)  # rows before `first` see no key of this block
        d += first
        if d < nk - 1:
            parts.append(masks.causal("top_left") if d == 0 else masks.window(None, d, "top_left"))
    if spec.kv_lengths is not None:
        kv = np.clip(spec.kv_lengths - ks.global_start, 0, nk)  # (B,) keys of the block inside the sequence
        ql = None if spec.q_lengths is None else np.clip(spec.q_lengths - qs.global_start - first, 0, nq - first)
        alive = (kv > 0) if ql is None else (kv > 0) & (ql > 0)
        if not alive.any():
            return None
        if not ((kv == nk).all() and (ql is None or (ql == nq - first).all())):
            parts.append(masks.padding(kv, ql))
    mask = None if not parts else parts[0] if len(parts) == 1 else parts[0] & parts[1]
    return _Block(qs.start + first, qs.stop, ks.start, ks.stop, qs.global_start + first, ks.global_start, mask)


def _allowed(spec: _MaskSpec, block: _Block, rows: slice, causal_offset: int, device):
    """Boolean (B|1, 1, 1, n, nk) for query rows `rows` of the block (relative to q0); None if all allowed."""
    import torch

    if block.mask is None:
        return None
    qpos = torch.arange(rows.start, rows.stop, device=device) + block.q_global  # (n,)
    kpos = torch.arange(block.k1 - block.k0, device=device) + block.k_global  # (nk,)
    allowed = torch.ones(1, 1, 1, qpos.numel(), kpos.numel(), dtype=torch.bool, device=device)
    if spec.causal_align is not None:
        allowed = allowed & (kpos[None, :] <= qpos[:, None] + causal_offset)  # (n, nk)
    if spec.kv_lengths is not None:
        kv_len = torch.as_tensor(spec.kv_lengths, device=device).view(-1, 1, 1, 1, 1)  # (B, 1, 1, 1, 1)
        allowed = allowed & (kpos < kv_len)  # (B, 1, 1, n, nk)
        if spec.q_lengths is not None:
            q_len = torch.as_tensor(spec.q_lengths, device=device).view(-1, 1, 1, 1, 1)
            allowed = allowed & (qpos[:, None] < q_len)
    return allowed


# ======================================================================================
# The ring
# ======================================================================================
@dataclass
class RingStats:
    """What ring_attention did on this rank (pass one as ``stats=`` to collect, forward and backward)."""

    bytes_sent: int = 0
    messages_sent: int = 0
    blocks_computed: int = 0  # (query chunk, key chunk) pairs computed
    blocks_skipped: int = 0  # pairs the mask hides completely
    steps: int = 0  # ring steps (forward and backward)


class _Ring:
    """Neighbours in a process group: send to rank+1, receive from rank-1 (group ranks)."""

    def __init__(self, group):
        import torch.distributed as dist

        self.dist = dist
        self.group = dist.group.WORLD if group is None else group
        self.rank = dist.get_rank(self.group)
        if self.rank < 0:
            raise ValueError("group: this process is not a member of the process group it was given")
        self.world = dist.get_world_size(self.group)
        self.next = dist.get_global_rank(self.group, (self.rank + 1) % self.world)
        self.prev = dist.get_global_rank(self.group, (self.rank - 1) % self.world)

    def exchange(self, sends: list, tag: int, stats: RingStats | None):
        """Start sending `sends` to the next rank and receiving as many from the previous one.

        Returns (buffers being received, works to wait on). Message i has tag `tag + i`.
        """
        import torch

        dist = self.dist
        recvs = [torch.empty_like(t) for t in sends]
        ops = [dist.P2POp(dist.isend, t, self.next, self.group, tag + i) for i, t in enumerate(sends)]
        ops += [dist.P2POp(dist.irecv, t, self.prev, self.group, tag + i) for i, t in enumerate(recvs)]
        if stats is not None:
            stats.bytes_sent += sum(t.numel() * t.element_size() for t in sends)
            stats.messages_sent += len(sends)
        return recvs, dist.batch_isend_irecv(ops)

    @staticmethod
    def wait(works) -> None:
        for w in works:
            w.wait()


@dataclass
class _Call:
    """One validated ring_attention call: what every rank must agree on, and its ring."""

    ring: _Ring | None
    spec: _MaskSpec
    mask: object  # the caller's mask (checked against the global lengths)
    layout: str
    scale: float
    sizes: tuple  # (B, Hq, Hkv, D, Dv): B = the flattened batch dims
    batch_shape: tuple  # the caller's batch dims
    dtype: str
    Lq: int  # local lengths (Lq/P, Lk/P)
    Lk: int
    stats: RingStats | None
    needs_grad: bool = False  # autograd records the call (then every rank runs the backward)
    causal_offset: int = 0  # Lk - Lq (bottom-right) or 0 (top-left), global lengths

    def plan(self, owner: int) -> list[_Block]:
        """The blocks to compute between this rank's queries and `owner`'s keys."""
        world = self.ring.world
        q_segs = _segments(self.ring.rank, world, self.layout, self.Lq, self.spec)
        k_segs = _segments(owner, world, self.layout, self.Lk, self.spec)
        blocks, skipped = _plan(self.spec, q_segs, k_segs, self.causal_offset)
        if self.stats is not None:  # chunk pairs, also where one call computes a whole shard (no mask)
            self.stats.blocks_computed += chunks_per_rank(self.layout) ** 2 if self.spec.empty else len(blocks)
            self.stats.blocks_skipped += skipped
            self.stats.steps += 1
        return blocks


def _accum_dtype(dtype):
    import torch

    return torch.float64 if dtype == torch.float64 else torch.float32


def _merge(acc_out, acc_lse, rows: slice, out_b, lse_b, lse_lo_b) -> None:
    """Fold a partial result into the running one, exactly, in place.

    lse = logaddexp(lse_a, lse_b); out = out_a·exp(lse_a - lse) + out_b·exp(lse_b - lse).
    The lse are float64 (lse_b + lse_lo_b: float32 ones would put |lse|·6e-8 of relative error
    on each weight, 1e-4 at scores of 2000). Rows with no allowed key yet (lse -inf on both
    sides) stay 0 and -inf, never NaN.
    """
    import torch

    lse_a = acc_lse[..., rows]  # (B, Hq, n) float64
    lse_b = lse_b.to(torch.float64)
    if lse_lo_b is not None:
        lse_b = lse_b + lse_lo_b.to(torch.float64)
    lse = torch.logaddexp(lse_a, lse_b)
    ref = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)  # -inf rows: weights exp(-inf) = 0
    w_a = torch.exp(lse_a - ref).unsqueeze(-1).to(acc_out.dtype)  # (B, Hq, n, 1)
    w_b = torch.exp(lse_b - ref).unsqueeze(-1).to(acc_out.dtype)
    target = acc_out[..., rows, :]  # (B, Hq, n, Dv), a view: updated in place
    target.mul_(w_a).addcmul_(out_b.to(acc_out.dtype), w_b)
    acc_lse[..., rows] = lse


def _ring_forward(call: _Call, q, k, v):
    """(out (B, Hq, Lq/P, Dv) as summed, float32 or float64, lse and lse_lo (B, Hq, Lq/P)): the
    ring, no autograd."""
    import torch

    ring, world = call.ring, call.ring.world
    acc = _accum_dtype(q.dtype)
    acc_out = torch.zeros(q.shape[:-1] + v.shape[-1:], dtype=acc, device=q.device)  # (B, Hq, Lq/P, Dv)
    acc_lse = torch.full(q.shape[:-1], -math.inf, dtype=torch.float64, device=q.device)  # (B, Hq, Lq/P)
    k_blk, v_blk = k.contiguous(), v.contiguous()  # (B, Hkv, Lk/P, D), (B, Hkv, Lk/P, Dv): this rank's
    for step in range(world):
        owner = (ring.rank - step) % world
        works, incoming = [], None
        if step < world - 1:  # start moving the next block before computing on this one
            incoming, works = ring.exchange([k_blk, v_blk], _KV_TAG, call.stats)
        for b in call.plan(owner):
            _merge(acc_out, acc_lse, slice(b.q0, b.q1), *_block_forward(call, b, q, k_blk, v_blk))
        ring.wait(works)
        if incoming is not None:
            k_blk, v_blk = incoming  # the block of the previous owner
    lse = acc_lse.to(acc)
    lse_lo = torch.where(torch.isfinite(lse), acc_lse - lse.to(torch.float64), 0.0).to(acc)
    return acc_out, lse, lse_lo


def _block_forward(call: _Call, b: _Block, q, k_blk, v_blk):
    """One block's (out (B, Hq, n, Dv), lse (B, Hq, n), lse_lo or None). A backend that can
    return its output unrounded (``run_forward`` with float32_out) does, so low-precision
    blocks are merged as summed (bfloat16, L = 384 on 3 ranks: max error 1.88e-3 as in one
    process, 3.82e-3 rounded first); others give it in q's dtype."""
    from . import dispatch

    q_b, k_c, v_c = q[..., b.q0:b.q1, :], k_blk[..., b.k0:b.k1, :], v_blk[..., b.k0:b.k1, :]
    inp = inputs.prepare(q_b, k_c, v_c, b.mask, scale=call.scale)  # (B, Hq, n, D): the caller's shape
    chosen = dispatch.choose(inp).backend
    with _arrays.autocast_off(inp.q):
        if hasattr(chosen, "run_forward"):
            return chosen.run_forward(inp, inp.q, inp.k, inp.v, float32_out=True)
        return (*chosen.forward(inp), None)


@dataclass
class _Saved:
    """What the backward needs of this rank's rows: the forward's inputs, results and dO."""

    q: object  # (B, Hq, Lq/P, D)
    out: object  # (B, Hq, Lq/P, Dv)
    lse: object  # (B, Hq, Lq/P), the GLOBAL lse of each row
    lse_lo: object  # (B, Hq, Lq/P), what lse's rounding lost
    dout: object  # (B, Hq, Lq/P, Dv)
    dlse: object  # (B, Hq, Lq/P) or None
    delta: object = None  # (B, Hq, Lq/P) rowsum(dO ∘ O) - dlse, for the torch-ops path
    lse_safe: object = None  # lse with -inf rows at +inf (their p = 0), for the torch-ops path


def _ring_backward(call: _Call, q, k, v, out, lse, dout, dlse, lse_lo=None):
    """(dq, dk, dv) for this rank's shards; dK/dV travel with their block back to its owner."""
    import torch

    ring, world = call.ring, call.ring.world
    acc = lse.dtype
    saved = _Saved(q, out, lse, torch.zeros_like(lse) if lse_lo is None else lse_lo, dout, dlse)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)  # (B, Hq, Lq/P, D)
    k_blk, v_blk = k.contiguous(), v.contiguous()
    arriving, dkv_works, in_flight = None, [], None
    for step in range(world):
        owner = (ring.rank - step) % world
        kv_works, incoming = [], None
        if step < world - 1:
            incoming, kv_works = ring.exchange([k_blk, v_blk], _KV_TAG, call.stats)
        dk_blk = torch.zeros(k.shape, dtype=acc, device=q.device)  # (B, Hkv, Lk/P, D)
        dv_blk = torch.zeros(v.shape, dtype=acc, device=q.device)  # (B, Hkv, Lk/P, Dv)
        for b in call.plan(owner):
            dq_b, dk_b, dv_b = _block_grads(call, b, saved, k_blk, v_blk)
            dq[..., b.q0:b.q1, :] += dq_b
            dk_blk[..., b.k0:b.k1, :] += dk_b
            dv_blk[..., b.k0:b.k1, :] += dv_b
        if step > 0:  # add the dK/dV this block gathered on the ranks it visited before
            ring.wait(dkv_works)
            dk_blk += arriving[0]
            dv_blk += arriving[1]
        if world > 1:  # pass them on; after the last step they reach the block's owner
            in_flight = (dk_blk, dv_blk)  # held until their send completes
            arriving, dkv_works = ring.exchange(list(in_flight), _DKV_TAG, call.stats)
        ring.wait(kv_works)
        if incoming is not None:
            k_blk, v_blk = incoming
    if world > 1:
        ring.wait(dkv_works)
        dk_blk, dv_blk = arriving  # this rank's own dK/dV, summed over every rank's queries
    return dq.to(q.dtype), dk_blk.to(k.dtype), dv_blk.to(v.dtype)


def _block_grads(call: _Call, b: _Block, saved: _Saved, k_blk, v_blk):
    """One block's (dq (B, Hq, n, D), dk (B, Hkv, nk, D), dv (B, Hkv, nk, Dv)).

    The identity of FlashAttention's backward holds block by block when it is given the
    GLOBAL lse and output: P = exp(S - lse - lse_lo); dV = Pᵀ·dO; dP = dO·Vᵀ;
    dS = P ∘ (dP - rowsum(dO ∘ O) + dlse); dQ = scale·dS·K; dK = scale·dSᵀ·Q.
    A backend with a fused backward that takes them (``run_backward``) computes it;
    otherwise torch ops do, a few query rows at a time.
    """
    q_b = saved.q[..., b.q0:b.q1, :]  # (B, Hq, n, D)
    k_c, v_c = k_blk[..., b.k0:b.k1, :], v_blk[..., b.k0:b.k1, :]  # (B, Hkv, nk, D), (B, Hkv, nk, Dv)
    grads = _kernel_block_grads(call, b, saved, q_b, k_c, v_c)
    return grads if grads is not None else _torch_block_grads(call, b, saved, q_b, k_c, v_c)


def _kernel_block_grads(call: _Call, b: _Block, saved: _Saved, q_b, k_c, v_c):
    """The block's gradients from the backend qkv.attention picks for it, if it has ``run_backward``."""
    from . import dispatch

    inp = inputs.prepare(q_b.contiguous(), k_c.contiguous(), v_c.contiguous(), b.mask, scale=call.scale)
    run_backward = getattr(dispatch.choose(inp).backend, "run_backward", None)
    if run_backward is None:
        return None
    rows = slice(b.q0, b.q1)
    dlse = None if saved.dlse is None else saved.dlse[..., rows].contiguous()
    return run_backward(inp, inp.q, inp.k, inp.v, saved.out[..., rows, :].contiguous(), saved.lse[..., rows],
                        saved.dout[..., rows, :].contiguous(), dlse, float32_grads=True,  # summed in float32
                        lse_lo=saved.lse_lo[..., rows])


def _torch_block_grads(call: _Call, b: _Block, saved: _Saved, q_b, k_c, v_c):
    """The block's gradients in torch ops, holding at most BACKWARD_PIECE_ELEMENTS scores at once."""
    import torch

    if saved.delta is None:  # once per backward
        acc = saved.lse.dtype
        saved.delta = (saved.dout.to(acc) * saved.out.to(acc)).sum(-1)  # (B, Hq, Lq/P) = rowsum(dO ∘ O)
        if saved.dlse is not None:
            saved.delta = saved.delta - saved.dlse.to(acc)  # d lse / d s = p: it enters dS like -delta
        saved.lse_safe = torch.where(torch.isneginf(saved.lse), torch.full_like(saved.lse, math.inf), saved.lse)
    B, Hq, n_rows, D = q_b.shape
    Hkv, nk, Dv, acc = k_c.shape[1], k_c.shape[2], v_c.shape[-1], saved.lse.dtype
    G = Hq // Hkv
    kc, vc = k_c.to(acc).unsqueeze(2), v_c.to(acc).unsqueeze(2)  # (B, Hkv, 1, nk, D), (B, Hkv, 1, nk, Dv)
    dq = torch.zeros(q_b.shape, dtype=acc, device=q_b.device)  # (B, Hq, n, D)
    dk = torch.zeros(k_c.shape, dtype=acc, device=q_b.device)  # (B, Hkv, nk, D)
    dv = torch.zeros(v_c.shape, dtype=acc, device=q_b.device)  # (B, Hkv, nk, Dv)
    step = max(1, BACKWARD_PIECE_ELEMENTS // max(1, B * Hq * nk))
    for r0 in range(0, n_rows, step):
        r1 = min(r0 + step, n_rows)
        n, g0, g1 = r1 - r0, b.q0 + r0, b.q0 + r1  # rows of the piece, in the block and in the shard
        qg = q_b[..., r0:r1, :].to(acc).reshape(B, Hkv, G, n, D)  # (B, Hkv, G, n, D)
        dog = saved.dout[..., g0:g1, :].to(acc).reshape(B, Hkv, G, n, Dv)  # (B, Hkv, G, n, Dv)
        s = call.scale * (qg @ kc.transpose(-1, -2))  # (B, Hkv, G, n, nk)
        allowed = _allowed(call.spec, b, slice(r0, r1), call.causal_offset, q_b.device)
        if allowed is not None:
            s = s.masked_fill(~allowed, -math.inf)
        lse_g = saved.lse_safe[..., g0:g1].reshape(B, Hkv, G, n, 1)
        p = (s - lse_g).sub_(saved.lse_lo[..., g0:g1].reshape(B, Hkv, G, n, 1)).exp_()  # (B, Hkv, G, n, nk)
        dv += (p.transpose(-1, -2) @ dog).sum(2)  # (B, Hkv, nk, Dv)
        dp = dog @ vc.transpose(-1, -2)  # (B, Hkv, G, n, nk)
        ds = p * (dp - saved.delta[..., g0:g1].reshape(B, Hkv, G, n, 1))  # (B, Hkv, G, n, nk)
        dq[..., r0:r1, :] = call.scale * (ds @ kc).reshape(B, Hq, n, D)  # (B, Hq, n, D)
        dk += call.scale * (ds.transpose(-1, -2) @ qg).sum(2)  # (B, Hkv, nk, D)
    return dq, dk, dv


# ======================================================================================
# The public function
# ======================================================================================
_META_FIELDS = ("arguments accepted", "batch", "Hq", "Hkv", "Lq/P", "Lk/P", "D", "Dv", "dtype", "layout",
                "scale", "needs grad", "batch dims (hash)", "causal alignment", "kv_lengths (hash)",
                "q_lengths (hash)")
#: How a field's integers read in a message (the others are shown as they are).
_META_VALUES = {"dtype": inputs.FLOAT_DTYPES.__getitem__, "layout": LAYOUTS.__getitem__,
                "scale": lambda bits: struct.unpack("<d", struct.pack("<q", bits))[0],
                "needs grad": bool, "causal alignment": _ALIGNS.__getitem__}


def ring_attention(q, k, v, mask=None, *, scale=None, layout: str = "contiguous", group=None,
                   return_lse: bool = False, stats: RingStats | None = None):
    """Exact attention over a sequence sharded across the ranks of a torch.distributed group.

    Every rank calls it with its shards (the same layout, mask and shapes on all ranks);
    each gets back its shard of the attention over the whole sequence, with autograd.
    When the inputs require grad, every rank must also run the backward (a ring too).

    Args:
        q: (..., Hq, Lq/P, D) this rank's query shard (a torch tensor).
        k: (..., Hkv, Lk/P, D) this rank's key shard; v: (..., Hkv, Lk/P, Dv).
        mask: None, ``qkv.causal()``, ``qkv.padding(kv_lengths, q_lengths)`` with lengths of
            the WHOLE sequence (one per batch row), or ``qkv.causal() & qkv.padding(...)``.
        scale: multiplies q·kᵀ; default 1/sqrt(D).
        layout: "contiguous" or "zigzag" (how `shard` cut the sequence; zigzag balances
            causal work). Local lengths must split into the layout's chunks (zigzag: even).
        group: the process group (default: the whole world). Ranks form the ring in
            group-rank order. It is what the ranks agree over, so it must be the same valid
            group on every rank: a rank whose group is not one (or lacks it) raises alone,
            and the others wait until the group's timeout.
        return_lse: also return this rank's lse (..., Hq, Lq/P).
        stats: a RingStats to fill with bytes sent, blocks computed and skipped.

    Returns:
        out (..., Hq, Lq/P, Dv) in q's dtype, or (out, lse) with return_lse=True.
        A row with no allowed key anywhere gives 0 and lse -inf.

    Raises:
        TypeError / ValueError for bad arguments. Ranks first agree (one small all_gather)
        that every rank's arguments are valid and alike, so a bad argument on one rank
        raises on every rank instead of leaving the others waiting. RuntimeError when
        torch.distributed is not initialised.
    """
    error, call = None, None
    try:
        return_lse = inputs.check_bool("return_lse", return_lse)
        call = _validate(q, k, v, mask, scale, layout, stats)
    except Exception as caught:  # any failure: raised on every rank once they have agreed
        error = caught
    ring = _connect(group, error)
    _agree(ring, call, error, q)
    call.ring = ring
    q4, k4, v4 = (inputs._to4d(x) for x in (q, k, v))  # (B, H, L/P, D)
    out, lse = _apply(call, q4, k4, v4)
    out = out.reshape(q.shape[:-1] + v.shape[-1:])
    return (out, lse.reshape(q.shape[:-1])) if return_lse else out


def _validate(q, k, v, mask, scale, layout, stats) -> _Call:
    """Everything that can be checked on this rank alone (the global lengths need the world size)."""
    inputs.check_qkv(q, k, v)
    if not _arrays.is_torch(q):
        raise TypeError(f"ring_attention takes torch tensors (it runs on torch.distributed), got {type(q).__name__}")
    scale = inputs.check_scale(scale, q.shape[-1], inputs.dtype_name(q))
    per_rank = chunks_per_rank(layout)
    spec = _parse_mask(mask)
    for name, x in (("q", q), ("k", k)):
        if x.shape[-2] % per_rank:
            raise ValueError(f"with layout {layout!r} each rank holds {per_rank} chunks, so {name}'s local "
                             f"length ({name}.shape[-2] = {x.shape[-2]}) must be divisible by {per_rank}; "
                             f"shard() cuts a sequence whose length is divisible by {per_rank} x world")
    if stats is not None and not isinstance(stats, RingStats):
        raise TypeError(f"stats must be a qkv.distributed.RingStats or None, got {type(stats).__name__}")
    q4 = inputs._to4d(q)  # (B, Hq, Lq/P, D)
    sizes = (q4.shape[0], q4.shape[1], inputs._to4d(k).shape[1], q.shape[-1], v.shape[-1])
    needs_grad = _arrays.grad_enabled() and any(x.requires_grad for x in (q, k, v))
    return _Call(None, spec, mask, layout, scale, sizes, tuple(q.shape[:-3]), inputs.dtype_name(q),
                 q.shape[-2], k.shape[-2], stats, needs_grad)


def _connect(group, error) -> _Ring:
    try:
        import torch.distributed as dist
    except ImportError as missing:  # no torch at all (inputs then cannot be valid), or one without distributed
        if error is not None:  # no process group to agree over: this call's own error
            raise error from None
        raise RuntimeError(f"ring_attention needs torch.distributed, which this torch lacks ({missing})") from None
    if not dist.is_available() or not dist.is_initialized():
        if error is not None:
            raise error
        raise RuntimeError("ring_attention needs torch.distributed to be initialised: call "
                           "torch.distributed.init_process_group('nccl' or 'gloo') first, e.g. under torchrun "
                           "(see docs/distributed.md)")
    return _Ring(group)


def _agree(ring: _Ring, call: _Call | None, error, q) -> None:
    """Finish validation with the world size, then one small all_gather so that all ranks agree.

    Every rank sends whether it accepted its arguments and what they are; any rank that
    rejected them, or any difference, raises on every rank (never a hang, never garbage).
    """
    import torch

    if error is None:
        try:
            _bind_global(call, ring.world)
        except Exception as caught:  # any failure: the other ranks must not wait on this one
            error = caught
    mine = [0] * len(_META_FIELDS) if error is not None else [1] + _describe(call)
    if ring.world > 1:
        usable = _arrays.is_torch(q) and q.device.type != "meta"  # a meta q has no memory to gather from
        device = q.device if usable else _default_device(ring)
        meta = torch.tensor(mine, dtype=torch.int64, device=device)  # (fields,)
        everyone = [torch.empty_like(meta) for _ in range(ring.world)]
        ring.dist.all_gather(everyone, meta, group=ring.group)
        table = torch.stack(everyone).cpu()  # (P, fields)
    else:
        table = torch.tensor([mine])
    if error is not None:
        raise error
    rejected = [r for r in range(ring.world) if table[r, 0] == 0]
    if rejected:
        raise ValueError(f"ring_attention: rank(s) {rejected} of the group rejected their arguments (their own "
                         "error says why); every rank must pass valid shards of the same shapes, layout and mask")
    differ = [(name, table[:, i].tolist()) for i, name in enumerate(_META_FIELDS) if (table[:, i] != table[0, i]).any()]
    if differ:
        shown = lambda name, values: [_META_VALUES.get(name, int)(x) for x in values]  # noqa: E731
        detail = "; ".join(f"{name} per rank {shown(name, values)}" for name, values in differ)
        raise ValueError(f"ring_attention: the ranks of the group disagree ({detail}). Every rank must pass "
                         "shards of the same shapes and dtype, with the same layout, scale and mask")


def _bind_global(call: _Call, world: int) -> None:
    """The global lengths, the mask checked against them, and the causal offset."""
    Lq, Lk = call.Lq * world, call.Lk * world  # global lengths
    if call.mask is not None:
        call.mask.check(Geometry(call.sizes[0], call.sizes[1], Lq, Lk, call.batch_shape))
    call.causal_offset = Lk - Lq if call.spec.causal_align == "bottom_right" else 0


def _describe(call: _Call) -> list[int]:
    B, Hq, Hkv, D, Dv = call.sizes
    batch_dims = _digest(np.array((len(call.batch_shape),) + call.batch_shape))  # (B, H, ...) vs (H, ...) too
    return [B, Hq, Hkv, call.Lq, call.Lk, D, Dv, inputs.FLOAT_DTYPES.index(call.dtype),
            LAYOUTS.index(call.layout), _float_bits(call.scale), int(call.needs_grad), batch_dims] + call.spec.code()


def _default_device(ring: _Ring):
    import torch

    if ring.dist.get_backend(ring.group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _apply(call: _Call, q, k, v):
    if call.needs_grad:
        return autograd_attention(_ring_forward, _ring_backward, q, k, v, call)
    out, lse, _ = _ring_forward(call, q.detach(), k.detach(), v.detach())
    return out.to(q.dtype), lse
