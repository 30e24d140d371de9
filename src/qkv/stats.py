"""Statistics of the attention weights in O(N) memory, and chosen rows of the weights.

Fused kernels never hold the Lq x Lk matrix of weights, so they cannot hand it out. They
do keep the log-sum-exp of every row, and that is enough: for any tile of scores s,

    weights = exp(s - lse)                                   # exactly softmax(s) on that tile

so the statistics below stream over (query tile x key tile) pairs, each tile computed,
used and dropped, with only per-row and per-key accumulators kept.

Shape legend:
    q   (..., Hq, Lq, D)     k (..., Hkv, Lk, D)     ... = batch dims, as in qkv.attention
    entropy, max_weight, lse            (..., Hq, Lq)       one number per query row
    received                            (..., Hq, Lk)       one number per key
    topk_indices, topk_weights          (..., Hq, Lq, topk)

Every statistic equals the same statistic computed from ``qkv.attention_weights`` (same
masks, score modifiers and grouped-query heads), up to rounding. The weights are rebuilt
from each row's lse, as the backward of FlashAttention does; one more pass first
renormalises them against the scores computed here (whose rounding differs from the kernel's,
and an lse is itself rounded by |lse| times the dtype's epsilon), so they sum to 1 and the
statistics keep the plain formula's precision at large scores too (that pass took float32
NumPy inputs of 8 heads x 2048 from 0.48-0.54 s to 0.66-0.87 s on 2 CPUs, paired runs; float64
runs it only where |lse| passes 64: it broke the rule without it at scores of std 2000; the
float64 sums of this precision cost float32 6%: 0.149-0.154 s against 0.140-0.143 for 8 heads x
2048, causal). Inputs in float64 are worked in float64, the other dtypes in float32; NumPy in,
NumPy out; torch in, torch out (same device, no gradient).
"""
from __future__ import annotations

import contextlib
import operator
from dataclasses import dataclass

import numpy as np

from . import _arrays, inputs
from ._threads import available_cpus, parallel_map
from .backends.base import compute_dtype_name
from .backends.reference import softmax_with_lse
from .masks import EMPTY, FULL, PARTIAL, apply_score_mods, tile_indices

#: Scores held at once per tile, over all batch rows and heads, for NumPy (256 KiB in float32:
#: small tiles stay in the CPU's cache through the several passes each one takes). torch
#: takes 4x on the CPU (fewer, larger operations for its threads) and 64x on accelerators.
TILE_ELEMENTS = 2**16
#: The widest key tile for NumPy (torch: 2x on the CPU, 8x on accelerators).
MAX_BLOCK_K = 256
#: The fewest query rows of a tile.
MIN_BLOCK_Q = 16


@dataclass
class AttentionStats:
    """What ``qkv.attention_stats`` returns (arrays of the inputs' kind).

    Attributes:
        entropy: (..., Hq, Lq) -sum_j w_ij log w_ij of each query row, natural log;
            0 for a row with no allowed key, log(n) for a row spread evenly over n keys.
        max_weight: (..., Hq, Lq) the largest weight of each row (0 for a row with no key).
        received: (..., Hq, Lk) the attention each key receives, summed over the queries
            (what KV-cache eviction policies rank keys by).
        lse: (..., Hq, Lq) the log-sum-exp of each row's scores (-inf for a row with no key).
        topk_indices: (..., Hq, Lq, topk) int64, the keys with the largest weights, largest
            first, the lower key first among equal weights; -1 where a row has fewer than
            topk allowed keys. None when topk=0.
        topk_weights: (..., Hq, Lq, topk) their weights (0 where the index is -1; NaN, with
            real indices, in a row a NaN input reaches).
    """

    entropy: object
    max_weight: object
    received: object
    lse: object
    topk_indices: object = None
    topk_weights: object = None


def attention_stats(q, k, mask=None, topk=0, *, score_mod=None, scale=None) -> AttentionStats:
    """Entropy, largest weight, attention received and top-k keys, without the Lq x Lk matrix.

    Args:
        q: (..., Hq, Lq, D) queries; k: (..., Hkv, Lk, D) keys (NumPy or torch, one dtype).
        mask, score_mod, scale: exactly as in ``qkv.attention``.
        topk: also find the topk keys of largest weight for every query row (0 = no).

    Returns:
        AttentionStats with entropy and max_weight (..., Hq, Lq), received (..., Hq, Lk),
        lse (..., Hq, Lq) and, with topk > 0, topk_indices / topk_weights (..., Hq, Lq, topk).

    Memory: the per-row and per-key results plus one tile of about TILE_ELEMENTS scores;
    one head with 65536 queries and keys needs a few MiB where the matrix needs 16 GiB.

    >>> s = qkv.attention_stats(q, k, qkv.causal(), topk=3)
    >>> s.entropy.shape, s.topk_indices.shape          # (..., Hq, Lq), (..., Hq, Lq, 3)
    """
    inputs.check_qkv(q, k, k, names=("q", "k"))  # errors name q and k only: the values below are made from k
    with _no_grad(_arrays.kind_of(q)):  # no gradient: a bias that requires grad is read as a constant
        inp = inputs.prepare(q, k, _dummy_values(k), mask, score_mod=score_mod, scale=scale)
        topk = inputs.check_nonnegative_int("topk", topk)
        if topk > inp.Lk:
            raise ValueError(f"topk ({topk}) must be at most the number of keys Lk ({inp.Lk})")
        with _arrays.autocast_off(inp.q):
            lse = _row_lse(q, k, mask, score_mod, inp)  # (B, Hq, Lq)
            stats = _Streamer(inp, lse, topk).run()  # on (B, Hq, ...)
    return _caller_shapes(stats, inp)


def _dummy_values(k):
    """Values of width 1 (the first column of k, checked already) for an lse-only attention call."""
    return k[..., :1]


def _no_grad(kind):
    if kind == "torch":
        import torch

        return torch.no_grad()
    return contextlib.nullcontext()


def _row_lse(q, k, mask, score_mod, inp):
    """The lse of every row, (B, Hq, Lq) in the compute dtype, from any O(N) backend.

    The values are a dummy of width 1 (the first column of k): only the lse is used.
    """
    from .api import attention

    if inp.kind == "torch":
        q, k = q.detach(), k.detach()
    _, lse = attention(q, k, _dummy_values(k), mask, score_mod=score_mod, scale=inp.scale, return_lse=True)
    return _arrays.astype(lse, compute_dtype_name(inp.dtype)).reshape(inp.B, inp.Hq, inp.Lq)


def grouped_scores(q, k, group: int):
    """q (B, Hq, n, D) against k (B, Hkv, m, D) -> raw dot products (B, Hq, n, m).

    The `group` query heads that share a kv head are stacked into one matrix, so grouped-
    query attention multiplies each K tile once, without copying K per query head.
    """
    B, Hq, n, D = q.shape
    stacked = q.reshape(B, Hq // group, group * n, D)  # (B, Hkv, group*n, D)
    return (stacked @ k.swapaxes(-1, -2)).reshape(B, Hq, n, k.shape[2])  # (B, Hq, n, m)


def _indices(like, inp, qi, k0: int, k1: int):
    """Index arrays b (B,1,1,1), h (1,Hq,1,1), qi (1,1,n,1), ki (1,1,1,m) for query rows qi."""
    b, h, _, ki = tile_indices(like, np.arange(inp.B), np.arange(inp.Hq), 0, 1, k0, k1)
    return b, h, _arrays.like(qi, like).reshape(1, 1, -1, 1), ki


def _modified_scores(inp, q, k, qi, k0: int, k1: int, masked: bool):
    """Scaled, modified scores of query rows qi against keys [k0, k1), -inf where masked.

    q (B, Hq, n, D) and k (B, Hkv, k1-k0, D) in the compute dtype; returns (B, Hq, n, k1-k0).
    The scale multiplies the finished products, as in the attention backends.
    """
    s = grouped_scores(q, k, inp.group)  # (B, Hq, n, m)
    s *= inp.scale
    if not inp.score_mods and not masked:
        return s
    b, h, qi, ki = _indices(s, inp, qi, k0, k1)
    s = apply_score_mods(inp.score_mods, s, b, h, qi, ki, inp.geom)
    if masked:
        s = _arrays.namespace(s).where(inp.mask.allowed(b, h, qi, ki, inp.geom), s, -np.inf)
    return s


# --------------------------------------------------------------------------------------
# The streaming pass
# --------------------------------------------------------------------------------------
def _caller_shapes(stats: AttentionStats, inp) -> AttentionStats:
    """Results computed on (B, Hq, ...) reshaped to the caller's leading dims."""
    rows = inp.lse_shape()  # (..., Hq, Lq)
    keys = inp.batch_shape + inp.head_shape + (inp.Lk,)  # (..., Hq, Lk)
    top = None if stats.topk_indices is None else rows + (stats.topk_indices.shape[-1],)
    return AttentionStats(
        stats.entropy.reshape(rows), stats.max_weight.reshape(rows), stats.received.reshape(keys),
        stats.lse.reshape(rows),
        None if top is None else stats.topk_indices.reshape(top),
        None if top is None else stats.topk_weights.reshape(top))


class _Streamer:
    """One pass over (query tile, key tile) pairs; EMPTY tiles are skipped, FULL ones not masked.

    NumPy inputs spread the query tiles over a few threads (NumPy releases the GIL inside
    its loops), each with its own `received` accumulator; torch runs its own threads.
    """

    def __init__(self, inp, lse, topk: int):
        self.inp, self.topk = inp, topk
        self.cdt = compute_dtype_name(inp.dtype)
        self.xp = _arrays.namespace(inp.q)
        self.lse = lse  # (B, Hq, Lq)
        # exp(s - lse) must be 0 on rows with no allowed key: +inf makes it so
        self.safe_lse = self.xp.where(lse == -np.inf, np.inf, lse)[..., None]  # (B, Hq, Lq, 1)
        self.tiny = float(np.finfo(self.cdt).min)
        self.block_q, self.block_k = tile_sizes(inp.B * inp.Hq, inp.Lq, inp.Lk, _tile_scale(inp))
        self.tiles = _tile_kinds(inp, self.block_q, self.block_k)  # (nq, nk) or None

    def _full(self, shape, fill=0.0, dtype=None):
        dtype = dtype or self.cdt
        if self.inp.kind == "torch":
            import torch

            return torch.full(shape, fill, dtype=getattr(torch, dtype), device=self.inp.q.device)
        return np.full(shape, fill, dtype=dtype)

    def run(self) -> AttentionStats:
        inp = self.inp
        B, Hq, Lq, Lk = inp.B, inp.Hq, inp.Lq, inp.Lk
        # entropy and received sum a part per tile: in float64, as float32 sums over many key
        # tiles drift (entropy of a uniform row of 131072 keys off by 3.4e-5, the plain
        # formula's by 1.5e-6)
        res = AttentionStats(self._full((B, Hq, Lq), dtype="float64"), self._full((B, Hq, Lq)), None, self.lse)
        if self.topk:
            res.topk_indices = self._full((B, Hq, Lq, self.topk), -1, "int64")
            res.topk_weights = self._full((B, Hq, Lq, self.topk), -1.0)  # -1: below any weight
        starts = list(range(0, Lq, self.block_q))
        chunks = _split(list(enumerate(starts)), _workers(inp, len(starts)))
        received = [self._full((B, Hq, Lk), dtype="float64") for _ in chunks]  # (B, Hq, Lk) per worker
        work = lambda i: [self._query_tile(res, received[i], t, q0) for t, q0 in chunks[i]]  # noqa: E731
        parallel_map(work, range(len(chunks)))  # one chunk (no threads) for torch, see _workers
        res.received = _arrays.astype(sum(received[1:], received[0]), self.cdt)
        res.entropy = _arrays.astype(res.entropy, self.cdt)
        if self.topk:
            res.topk_weights = self.xp.where(res.topk_indices < 0, 0.0, res.topk_weights)
        return res

    def _key_tiles(self, t: int, q, qi):
        """(k0, k1, kind, scores (B, Hq, bq, bk)) of each key tile the mask leaves non-EMPTY,
        for query tile t with rows qi and q (B, Hq, bq, D)."""
        inp = self.inp
        for j, k0 in enumerate(range(0, inp.Lk, self.block_k)):
            kind = self._kind(t, j)
            if kind == EMPTY:
                continue
            k1 = min(k0 + self.block_k, inp.Lk)
            k = _arrays.astype(inp.k[:, :, k0:k1], self.cdt)  # (B, Hkv, bk, D)
            yield k0, k1, kind, _modified_scores(inp, q, k, qi, k0, k1, kind == PARTIAL)

    def _log_sums(self, t: int, q, qi, lse):
        """log sum_j exp(s_ij - lse_i) (B, Hq, bq, 1) over every key, with the scores computed
        here. The weights exp(s - lse) sum to 1 only against scores rounded as the kernel's
        were, and a float32 lse is itself rounded by |lse|·6e-8, so at large scores they would
        not (entropy off by 2.6e-5 at scores of std 36, 7.3e-4 at std 900); less this, they do."""
        xp = self.xp
        top, total = None, 0.0  # running maximum of s - lse (B, Hq, bq, 1), and the sum under it
        for _, _, _, s in self._key_tiles(t, q, qi):
            s -= lse  # near 0 at the row's largest score, unless the scores differ by more than exp takes
            tile_top = _amax(s, -1)[..., None]
            new_top = tile_top if top is None else xp.maximum(top, tile_top)
            shift = xp.where(xp.isfinite(new_top), new_top, 0.0)  # rows with nothing allowed yet
            rescale = 0.0 if top is None else xp.exp(top - shift)
            # summed over the key tiles in float64: in float32 a row of many keys drifts, and
            # every weight with it (entropy of a near-uniform row of 32768 keys off by 4e-6)
            total = total * rescale + _arrays.astype(xp.exp(s - shift).sum(-1)[..., None], "float64")
            top = new_top
        if top is None:
            return 0.0
        with np.errstate(divide="ignore", invalid="ignore"):
            return xp.where(total > 0, xp.where(xp.isfinite(top), top, 0.0) + xp.log(total), 0.0)  # no key: 0

    def _renormalisation(self, log_sums):
        """(shift of the log-weights, the rest of log_sums, factor of the weights) that
        renormalise by log_sums, in the compute dtype (float64 ones would widen every tile).

        A small log_sums goes into the factor: a shift of the logs by it would be lost in
        float32, whose logs near -log(Lk) are rounded to |log w|·6e-8, the same way for every
        key of a near-uniform row (entropy of 5000 such keys off by 3.5e-6). A large one is a
        shift: as a factor, it would overflow or underflow.
        """
        if isinstance(log_sums, float):  # no key tile, or nothing to renormalise
            return 0.0, 0.0, 1.0
        xp, cdt = self.xp, self.cdt
        shift = xp.where(xp.abs(log_sums) > 1, log_sums, 0.0)
        rest = log_sums - shift
        return _arrays.astype(shift, cdt), _arrays.astype(rest, cdt), _arrays.astype(xp.exp(-rest), cdt)

    def _needs_renormalising(self, lse) -> bool:
        """float32 always; float64 only at large |lse|, whose rounding (|lse|·1.1e-16, as is the
        scores' own here) reaches the statistics' atol of 1e-12 past a few hundred (off by 7e-12
        at scores of std 2000). Below 64 the pass would double the work for nothing."""
        if self.cdt != "float64":
            return True
        finite = lse[self.xp.isfinite(lse)]  # 1-D
        return finite.shape[0] > 0 and float(abs(finite).max()) > 64

    def _query_tile(self, res, received, t: int, q0: int):
        """Every key tile against the query rows [q0, q0 + block_q)."""
        inp, xp = self.inp, self.xp
        q1 = min(q0 + self.block_q, inp.Lq)
        q = _arrays.astype(inp.q[:, :, q0:q1], self.cdt)  # (B, Hq, bq, D)
        qi = np.arange(q0, q1)
        lse = self.safe_lse[:, :, q0:q1]  # (B, Hq, bq, 1)
        log_sums = self._log_sums(t, q, qi, lse) if self._needs_renormalising(lse) else 0.0
        entropy, best, top = res.entropy[:, :, q0:q1], None, None  # entropy: a view, summed into
        if self.topk:
            top = (res.topk_weights[:, :, q0:q1], res.topk_indices[:, :, q0:q1])
        shift, rest, norm = self._renormalisation(log_sums)
        for k0, k1, kind, z in self._key_tiles(t, q, qi):
            z -= lse  # log of the weights before renormalising, in place
            z -= shift
            w = xp.exp(z)  # (B, Hq, bq, bk) the weights of this tile
            w *= norm
            z -= rest  # log of the weights
            tile_best = _amax(z, -1)  # (B, Hq, bq)
            best = tile_best if best is None else xp.maximum(best, tile_best)
            received[:, :, k0:k1] += w.sum(-2)
            if top is not None:
                top = _merge_topk(top, w, z, k0)
            if kind == PARTIAL or inp.score_mods:  # log w may be -inf where w == 0
                _clamp_min(z, self.tiny)  # so that 0 * log 0 counts 0 (NaN stays NaN)
            z *= w
            entropy -= z.sum(-1)  # -sum w log w
        if best is not None:
            res.max_weight[:, :, q0:q1] = xp.exp(best)
        if top is not None:
            res.topk_weights[:, :, q0:q1], res.topk_indices[:, :, q0:q1] = top

    def _kind(self, t: int, j: int) -> int:
        if self.tiles is not None:
            return int(self.tiles[t, j])
        return FULL if self.inp.mask is None else PARTIAL


def _clamp_min(x, low: float) -> None:
    if _arrays.is_torch(x):
        x.clamp_(min=low)
    else:
        np.maximum(x, low, out=x)


def _workers(inp, n_tiles: int) -> int:
    """Threads for the query tiles: NumPy only (torch parallelises each operation itself)."""
    if inp.kind == "torch":
        return 1
    return max(1, min(n_tiles, available_cpus()))


def _split(items: list, n: int) -> list:
    """n interleaved chunks of items (causal tiles are cheap at the top, dear at the bottom)."""
    return [items[i::n] for i in range(n)]


def tile_sizes(heads: int, Lq: int, Lk: int, scale=(1, 1)) -> tuple[int, int]:
    """(block_q, block_k): heads * block_q * block_k about TILE_ELEMENTS, block_q >= MIN_BLOCK_Q.

    heads: batch rows times query heads, all held by each tile. scale: multipliers of
    (TILE_ELEMENTS, MAX_BLOCK_K) for the device (see _tile_scale).
    """
    elements, widest = TILE_ELEMENTS * scale[0], MAX_BLOCK_K * scale[1]
    block_k = max(1, min(Lk, widest))
    block_q = max(1, min(Lq, max(MIN_BLOCK_Q, elements // max(heads * block_k, 1))))
    return block_q, block_k


def _tile_scale(inp) -> tuple[int, int]:
    if inp.kind == "numpy":
        return 1, 1
    return (4, 2) if inp.device == "cpu" else (64, 8)


def _tile_kinds(inp, block_q: int, block_k: int):
    """EMPTY / PARTIAL / FULL for each (query tile, key tile) over all rows and heads, or None."""
    if inp.mask is None:
        return None
    classes = inp.mask.tile_classes(inp.geom, block_q, block_k)
    empty = (classes == EMPTY).all(axis=(0, 1))  # (nq, nk)
    full = (classes == FULL).all(axis=(0, 1))
    return np.where(empty, EMPTY, np.where(full, FULL, PARTIAL))


def _amax(x, axis):
    return x.amax(dim=axis) if _arrays.is_torch(x) else x.max(axis=axis)


def _merge_topk(top, w, z, k0: int):
    """Fold a tile's weights w (B, Hq, bq, bk) into the running top-k (values, indices).

    Masked entries (log-weight z == -inf) rank below every weight, as weight -1 and index -1,
    so a row with fewer than topk allowed keys ends in -1 indices.
    """
    values, indices = top
    xp = _arrays.namespace(w)
    masked = z == -np.inf
    w = xp.where(masked, -1.0, w)
    keys = _arrays.broadcast_to(_arrays.arange_like(w.shape[-1], w) + k0, w.shape)  # (B, Hq, bq, bk)
    keys = xp.where(masked, -1, keys)
    return _largest(_concat(values, w), _concat(indices, keys), values.shape[-1])


def _concat(a, b):
    """a and b side by side along the last axis (NumPy or torch)."""
    return _arrays.namespace(a).cat([a, b], -1) if _arrays.is_torch(a) else np.concatenate([a, b], -1)


def _largest(values, indices, n: int):
    """The n largest values along the last axis, largest first, and their indices. Equal
    values keep their order along the axis: the running top-k comes before a new tile and
    holds lower keys, so among equal weights the lowest keys win, on NumPy and torch alike.
    A NaN ranks first (it propagates)."""
    xp = _arrays.namespace(values)
    descending = xp.where(xp.isnan(values), -np.inf, -values)  # ascending in the order wanted
    where = _smallest_positions(descending, n)
    return _take(values, where), _take(indices, where)


def _smallest_positions(keys, n: int):
    """Positions of the n smallest keys along the last axis, in a stable order: selected
    without a full sort (it would cost more than the rest of the statistics), then the rows
    where equal keys at the n-th place were left out for later ones sorted whole."""
    if _arrays.is_torch(keys):
        where = keys.topk(n, dim=-1, largest=False).indices.sort(dim=-1).values  # positions ascending
        where = _take(where, _take(keys, where).sort(dim=-1, stable=True).indices)
    else:
        where = np.sort(np.argpartition(keys, n - 1, axis=-1)[..., :n], axis=-1)
        where = _take(where, np.argsort(_take(keys, where), axis=-1, kind="stable"))
    picked = _take(keys, where)  # (..., n) in order
    nth = picked[..., -1:]
    ties_left_out = (keys == nth).sum(-1) > (picked == nth).sum(-1)
    if ties_left_out.any():
        rows = keys[ties_left_out]
        ordered = rows.sort(dim=-1, stable=True).indices if _arrays.is_torch(rows) else \
            np.argsort(rows, axis=-1, kind="stable")
        where[ties_left_out] = ordered[..., :n]
    return where


def _take(x, where):
    """x's entries at positions `where` along the last axis (NumPy or torch)."""
    return x.gather(-1, where) if _arrays.is_torch(x) else np.take_along_axis(x, where, -1)


# --------------------------------------------------------------------------------------
# Chosen rows of the weights (qkv.attention_weights(..., rows=...))
# --------------------------------------------------------------------------------------
def weights_of_rows(inp, rows):
    """The weights of the query rows `rows`, (..., Hq, n, Lk), as the full matrix would give them.

    `rows` is an int (the row axis is then dropped, as in ``w[..., i, :]``), a slice, or a
    1-D sequence / array of query positions (negative ones count from the end). Only those
    rows are computed: memory is O(n * Lk), not O(Lq * Lk). Torch inputs keep autograd.
    """
    index, drop = _row_index(rows, inp.Lq)
    cdt = compute_dtype_name(inp.dtype)
    picked = _arrays.like(index, inp.q)
    q = _arrays.astype(inp.q[:, :, picked], cdt)  # (B, Hq, n, D)
    k = _arrays.astype(inp.k, cdt)  # (B, Hkv, Lk, D)
    s = _modified_scores(inp, q, k, index, 0, inp.Lk, masked=inp.mask is not None)  # (B, Hq, n, Lk)
    weights = _arrays.astype(softmax_with_lse(s, None)[0], inp.dtype)
    shape = inp.batch_shape + inp.head_shape + (() if drop else (len(index),)) + (inp.Lk,)
    return weights.reshape(shape)


def _row_index(rows, Lq: int):
    """(int64 positions (n,), whether the caller gave one int) for the `rows` argument."""
    if isinstance(rows, slice):
        return np.arange(Lq)[rows].copy(), False  # a copy: torch takes no negative strides
    if _is_int(rows):
        index, drop = np.array([operator.index(rows)]), True
    else:
        index, drop = _rows_array(rows), False
    if index.size and (index.min() < -Lq or index.max() >= Lq):
        raise ValueError(f"rows must be query positions in [-Lq, Lq) = [{-Lq}, {Lq}), got {_show(index)}")
    return np.where(index < 0, index + Lq, index).astype(np.int64), drop


def _is_int(x) -> bool:
    try:
        operator.index(x)
    except TypeError:
        return False
    return not isinstance(x, (bool, np.bool_)) and np.ndim(x) == 0


def _rows_array(rows):
    arr = _arrays.to_numpy(rows) if _arrays.is_torch(rows) else np.asarray(rows)
    if arr.ndim != 1 or not (np.issubdtype(arr.dtype, np.integer) or arr.size == 0) or arr.dtype == bool:
        raise TypeError(f"rows must be an int, a slice or a 1-D sequence of ints (query positions); "
                        f"got {type(rows).__name__} of dtype {arr.dtype} and shape {arr.shape}")
    return arr.astype(np.int64)


def _show(index) -> str:
    if index.size <= 8:
        return str(index.tolist())
    return f"{index[:7].tolist()}... (min {index.min()}, max {index.max()})"
