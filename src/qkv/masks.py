"""The mask and score-modifier language.

A mask says which (query, key) pairs may attend: True = ALLOWED, everywhere in
qkv. Masks combine with ``&``, ``|`` and ``~``; each one can

- ``materialize(Lq, Lk, ...)`` into a boolean array (tests, pictures),
- ``blocks(Lq, Lk, block_q, block_k, ...)`` classify tiles as EMPTY / PARTIAL /
  FULL, so kernels skip empty tiles and never mask full ones,
- ``to_string(Lq, Lk)`` draw itself in the terminal.

Data-driven masks (lengths, segment ids) hold their data as parameters: a rule
is evaluated from index arrays ``b, h, qi, ki`` (batch row, query head, query
position, key position) that broadcast against each other, in NumPy or torch.

Score modifiers change scores before the softmax: ``alibi``, ``softcap``,
``score_fn`` (and a float array mask, which is an additive bias).

Index conventions: ``b`` runs over the flattened leading (batch) dims of q,
``h`` over the query heads, ``qi`` over 0..Lq-1 and ``ki`` over 0..Lk-1.
"""
from __future__ import annotations

import dis
import functools
import math
import sys
from dataclasses import dataclass, replace

import numpy as np

from . import _arrays, inputs

EMPTY, PARTIAL, FULL = 0, 1, 2
_MAYBE = 3  # internal: "could be anything", settled by evaluating the tile

ALIGNS = ("bottom_right", "top_left")


@dataclass(frozen=True)
class Geometry:
    """The sizes a mask is evaluated for: batch rows, query heads, query and key lengths."""

    batch: int
    heads: int
    Lq: int
    Lk: int
    batch_shape: tuple = None  # the caller's leading dims (flattened into batch); (batch,) if not given
    kind: str = "numpy"  # of the caller's arrays: rules qkv evaluates itself get index arrays of it

    def __post_init__(self):
        if self.batch_shape is None:
            object.__setattr__(self, "batch_shape", (self.batch,))

    def host_probe(self):
        """An empty array of the caller's kind on the host, for index arrays like it: a rule
        written with torch functions for torch inputs then works wherever qkv evaluates it
        (tile classes, the native kernel's tile bitmaps), not only in the torch backend."""
        if self.kind == "torch":
            import torch

            return torch.zeros(0)
        return np.zeros(0)


def tile_indices(like, b, h, q0: int, q1: int, k0: int, k1: int):
    """Broadcastable index arrays for rows b, heads h and the tile [q0, q1) x [k0, k1).

    b and h are ints or 1-D index arrays; the results have shapes
    (nb, 1, 1, 1), (1, nh, 1, 1), (1, 1, bq, 1), (1, 1, 1, bk).
    """
    ar = lambda lo, hi: _arrays.arange_like(hi - lo, like) + lo  # noqa: E731
    b = _arrays.like(np.atleast_1d(np.asarray(b, dtype=np.int64)), like) if not _arrays.is_torch(b) else b
    h = _arrays.like(np.atleast_1d(np.asarray(h, dtype=np.int64)), like) if not _arrays.is_torch(h) else h
    return (
        b.reshape(-1, 1, 1, 1),
        h.reshape(1, -1, 1, 1),
        ar(q0, q1).reshape(1, 1, -1, 1),
        ar(k0, k1).reshape(1, 1, 1, -1),
    )


def _check_sizes(Lq, Lk, heads):
    inputs.check_nonnegative_int("Lq", Lq)
    inputs.check_nonnegative_int("Lk", Lk)
    inputs.check_nonnegative_int("heads", heads)


def _batch_shape(batch) -> tuple:
    """blocks' and materialize's batch: a number of batch rows, or the caller's batch shape."""
    if isinstance(batch, (tuple, list)):
        return tuple(inputs.check_nonnegative_int("batch", n) for n in batch)
    return (inputs.check_nonnegative_int("batch", batch),)


_WHAT = {"batch": "batch row", "heads": "head"}  # materialize's size arguments, as its hint names them


class Mask:
    """Base class of every mask. Subclasses implement ``allowed``."""

    #: True when the rule does not depend on the head index (tiles can be shared by heads).
    head_independent = True

    # ---- the rule -------------------------------------------------------------------------
    def allowed(self, b, h, qi, ki, geom: Geometry):
        """Boolean array: may query qi of batch row b, head h attend to key ki?"""
        raise NotImplementedError

    def check(self, geom: Geometry) -> None:
        """Raise ValueError if the mask's parameters do not fit these sizes."""

    def allows_every_pair(self, geom: Geometry) -> bool:
        """True when, at these sizes, the mask forbids nothing (so there is nothing to apply):
        causal with one query per row, a decoding step, is the common case. False when unsure."""
        return False

    # ---- calls that continue a sequence -----------------------------------------------------
    def from_query(self, offset: int) -> "Mask":
        """This mask for a call whose query i is position offset + i of the sequence the mask
        was written for (a step that continues a KV cache, as qkv's modules make): the rows
        [offset, offset + Lq) of the whole pass, evaluated at its sizes (offset + Lq queries)."""
        offset = inputs.check_nonnegative_int("offset", offset)
        if offset == 0 or self._same_in_later_rows():
            return self
        return self._later_rows(offset)

    def _later_rows(self, offset: int) -> "Mask":
        return _LaterRows(self, offset)

    def _same_in_later_rows(self) -> bool:
        """True when the call's own rows already are the whole pass's last ones: the rule
        reads query positions only as i + Lk - Lq (bottom-right), or not at all."""
        return False

    # ---- algebra --------------------------------------------------------------------------
    def __and__(self, other: "Mask") -> "Mask":
        return And(self, _as_mask(other, "&"))

    def __or__(self, other: "Mask") -> "Mask":
        return Or(self, _as_mask(other, "|"))

    def __invert__(self) -> "Mask":
        return Not(self)

    __rand__ = __and__
    __ror__ = __or__
    __array_ufunc__ = None  # `array & mask`: NumPy leaves it to __rand__, which explains itself

    # ---- tiles ----------------------------------------------------------------------------
    def _classify(self, geom: Geometry, block_q: int, block_k: int) -> np.ndarray:
        """Tile classes (B|1, H|1, nq, nk) in {EMPTY, PARTIAL, FULL, _MAYBE}."""
        nq, nk = _cdiv(geom.Lq, block_q), _cdiv(geom.Lk, block_k)
        return np.full((1, 1, nq, nk), _MAYBE, dtype=np.int8)

    def blocks(self, Lq: int, Lk: int, block_q: int, block_k: int, *, batch=1, heads: int = 1) -> np.ndarray:
        """Classify each (block_q x block_k) tile as EMPTY (0), PARTIAL (1) or FULL (2).

        `batch` is the number of batch rows or the caller's batch shape (a tuple, flattened).
        Returns an int8 array of shape (batch|1, heads|1, ceil(Lq/block_q), ceil(Lk/block_k));
        a dim is 1 when the mask does not depend on it. Safe: a tile is EMPTY only if no
        pair in it is allowed and FULL only if every pair is; a tile some rules cannot settle
        from their parameters (document ids, some combinations) may stay PARTIAL.
        """
        inputs.check_positive_int("block_q", block_q)
        inputs.check_positive_int("block_k", block_k)
        _check_sizes(Lq, Lk, heads)
        batch_shape = _batch_shape(batch)
        return self.tile_classes(Geometry(math.prod(batch_shape), heads, Lq, Lk, batch_shape), block_q, block_k)

    def tile_classes(self, geom: Geometry, block_q: int, block_k: int) -> np.ndarray:
        """As blocks(), for a call's geometry (its rules see index arrays of the call's kind)."""
        self.check(geom)
        classes = self._classify(geom, block_q, block_k)
        if (classes == _MAYBE).any():
            classes = _settle_by_evaluation(self, classes, geom, block_q, block_k)
        return classes

    # ---- pictures -------------------------------------------------------------------------
    def materialize(self, Lq: int, Lk: int, *, batch=None, heads=None):
        """The mask as a boolean array of shape (*batch, heads, Lq, Lk).

        The batch and heads dims are present only when given (batch may be an int or a
        tuple); ``materialize(Lq, Lk)`` gives (Lq, Lk) for a mask whose data has one batch
        row (lengths or ids of more rows need ``batch=``, then index the row).
        """
        _check_sizes(Lq, Lk, 1 if heads is None else heads)
        batch_shape = () if batch is None else _batch_shape(batch)
        n_batch, n_heads = math.prod(batch_shape), 1 if heads is None else heads
        geom = Geometry(n_batch, n_heads, Lq, Lk, batch_shape or (1,))
        try:
            self.check(geom)
        except inputs.SizeMismatch as error:
            unset = [name for name, value in (("batch", batch), ("heads", heads))
                     if value is None and name in error.dims]
            if unset:  # materialized for one batch row or head: the mask's data may hold more
                one = " and one ".join(_WHAT[n] for n in unset)
                raise ValueError(f"{error} (materialized for one {one}: if the mask's data holds more, "
                                 f"pass {' and '.join(n + '=' for n in unset)})") from None
            raise
        probe = np.zeros(0)
        b, h, qi, ki = tile_indices(probe, np.arange(n_batch), np.arange(n_heads), 0, Lq, 0, Lk)
        full = np.broadcast_to(self.allowed(b, h, qi, ki, geom), (n_batch, n_heads, Lq, Lk))
        shape = batch_shape + (() if heads is None else (n_heads,)) + (Lq, Lk)
        return np.ascontiguousarray(full).reshape(shape)

    def to_string(self, Lq: int, Lk: int, *, batch: int = 0, head: int = 0, batch_size: int | None = None,
                  heads: int | None = None) -> str:
        """Draw the mask for one batch row and head: '█' = attend, '·' = masked.

        batch_size: how many batch rows the mask's data holds (default batch + 1);
        heads: how many heads it holds (default head + 1), as for a per-head dense mask.
        """
        batch, head = inputs.check_nonnegative_int("batch", batch), inputs.check_nonnegative_int("head", head)
        rows = batch + 1 if batch_size is None else inputs.check_positive_int("batch_size", batch_size)
        n_heads = head + 1 if heads is None else inputs.check_positive_int("heads", heads)
        if batch >= rows:
            raise ValueError(f"batch ({batch}) must be less than batch_size ({rows})")
        if head >= n_heads:
            raise ValueError(f"head ({head}) must be less than heads ({n_heads})")
        try:
            grid = self.materialize(Lq, Lk, batch=rows, heads=n_heads)[batch, head]
        except inputs.SizeMismatch as error:
            unset = [name for name, value, dim in (("batch_size", batch_size, "batch"), ("heads", heads, "heads"))
                     if value is None and dim in error.dims]
            if unset:  # drawn for batch + 1 rows and head + 1 heads: the mask's data may hold more
                drawn = f"{rows} batch row{'s' * (rows > 1)} and {n_heads} head{'s' * (n_heads > 1)}"
                raise ValueError(f"{error} (drawn for {drawn}: if the mask's data holds more, "
                                 f"pass {' and '.join(n + '=' for n in unset)})") from None
            raise
        width = len(str(max(Lq, Lk) - 1))
        lines = [f"{self!r}  (rows: {Lq} queries, columns: {Lk} keys)"]
        for i, row in enumerate(grid):
            lines.append(f"{i:>{width}} " + "".join("█" if a else "·" for a in row))
        return "\n".join(lines)

    def __repr__(self) -> str:
        return type(self).__name__.lower()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _as_mask(other, op: str) -> Mask:
    if not isinstance(other, Mask):
        hint = "; wrap an array as qkv.dense_mask(array)" if _arrays.kind_of(other) else ""
        raise TypeError(f"mask {op} mask: the other operand must be a qkv mask, got {type(other).__name__}{hint}")
    return other


#: Scores a rule is evaluated for at once when tiles are classified (and when the native
#: kernel's bitmaps are filled): a few MiB of temporaries, whatever the length (a whole band
#: of a long sequence's keys took hundreds).
EVALUATED_AT_ONCE = 2**20


def _settle_by_evaluation(mask: Mask, classes, geom: Geometry, block_q: int, block_k: int):
    """Replace _MAYBE tiles by their exact class, evaluating the rule one query band at a time,
    over as many key tiles at once as EVALUATED_AT_ONCE allows."""
    nq, nk = classes.shape[-2:]
    heads = 1 if mask.head_independent else geom.heads
    classes = np.broadcast_to(classes, (geom.batch, heads, nq, nk)).copy()
    probe = geom.host_probe()
    for t in range(nq):
        maybe = (classes[:, :, t, :] == _MAYBE).any(axis=(0, 1))  # (nk,)
        q0, q1 = t * block_q, min((t + 1) * block_q, geom.Lq)
        band = max(1, geom.batch * heads * (q1 - q0) * block_k)  # scores of a key tile; none for batch 0
        step = max(1, EVALUATED_AT_ONCE // band)  # key tiles at once
        for j0 in range(0, nk, step):
            j1 = min(j0 + step, nk)
            if not maybe[j0:j1].any():
                continue
            k0, k_end = j0 * block_k, min(j1 * block_k, geom.Lk)  # real keys only: the last tile may be short
            b, h, qi, ki = tile_indices(probe, np.arange(geom.batch), np.arange(heads), q0, q1, k0, k_end)
            allowed = _arrays.to_numpy(mask.allowed(b, h, qi, ki, geom))
            band = np.broadcast_to(allowed, (geom.batch, heads, q1 - q0, k_end - k0))
            starts = np.arange(j1 - j0) * block_k  # each tile's first key in the band
            any_ = np.logical_or.reduceat(band.any(axis=2), starts, axis=-1)  # (B, heads, j1 - j0)
            all_ = np.logical_and.reduceat(band.all(axis=2), starts, axis=-1)
            exact = np.where(all_, FULL, np.where(any_, PARTIAL, EMPTY)).astype(np.int8)
            tiles = classes[:, :, t, j0:j1]
            classes[:, :, t, j0:j1] = np.where(tiles == _MAYBE, exact, tiles)
    return _squeeze_unused(classes)


def _squeeze_unused(classes: np.ndarray) -> np.ndarray:
    """Collapse the batch / head dims to 1 where every entry along them is the same."""
    for axis in (0, 1):
        if classes.shape[axis] > 1 and (classes == classes.take([0], axis=axis)).all():
            classes = classes.take([0], axis=axis)
    return classes


# ======================================================================================
# Interval masks: query i of row b sees keys lo(b, i) <= j <= hi(b, i).
# Causal, window, padding and prefix-LM are all of this form, so their tiles are
# classified exactly from lo/hi alone, and intersections of them stay intervals.
# ======================================================================================
class IntervalMask(Mask):
    def interval(self, b, qi, geom: Geometry):
        """(lo, hi) arrays broadcast from b (nb,1,1,1) and qi (1,1,bq,1)."""
        raise NotImplementedError

    def allowed(self, b, h, qi, ki, geom):
        lo, hi = self.interval(b, qi, geom)
        return (ki >= lo) & (ki <= hi)

    def __and__(self, other):
        if isinstance(other, IntervalMask):
            return IntervalIntersection(self, other)
        return super().__and__(other)

    def _later_rows(self, offset):
        return _LaterIntervalRows(self, offset)  # still key intervals: the kernels take it inline

    def _classify(self, geom, block_q, block_k):
        """Tile classes from the rows' key intervals in O(B·Lq + B·nq·nk) memory: a tile is FULL
        when its rows' largest lo and smallest hi span it, EMPTY when no row's interval reaches it."""
        nq, nk = _cdiv(geom.Lq, block_q), _cdiv(geom.Lk, block_k)
        probe = np.zeros(0)
        b, _, qi, _ = tile_indices(probe, np.arange(geom.batch), [0], 0, nq * block_q, 0, 1)
        lo, hi = (np.broadcast_to(x, (geom.batch, 1, nq * block_q, 1))[:, 0, :, 0]
                  for x in self.interval(b, qi, geom))
        lo, hi = np.maximum(lo, 0), np.minimum(hi, geom.Lk - 1)  # (B, nq*bq), clipped to the keys
        real_row = np.arange(nq * block_q) < geom.Lq  # the last tile's padding rows count for nothing
        lo_max = np.where(real_row, lo, -1).reshape(geom.batch, nq, block_q).max(axis=2, initial=-1)
        hi_min = np.where(real_row, hi, geom.Lk).reshape(geom.batch, nq, block_q).min(axis=2, initial=geom.Lk)
        k0 = np.arange(nk) * block_k  # (nk,) first and last key of each tile
        k1 = np.minimum(k0 + block_k, geom.Lk) - 1
        full = (lo_max[..., None] <= k0) & (hi_min[..., None] >= k1)  # (B, nq, nk)
        classes = np.full(full.shape, PARTIAL, dtype=np.int8)  # int8 throughout: np.where would make int64
        classes[~_tiles_reached(lo, hi, real_row, geom.batch, nq, nk, block_q, block_k)] = EMPTY
        classes[full] = FULL  # a FULL tile is reached: the two never meet
        return _squeeze_unused(classes[:, None])


def _tiles_reached(lo, hi, real_row, n_batch, nq, nk, block_q, block_k):
    """(B, nq, nk) bool: some real row of the query tile sees a key of the key tile. A row's
    interval reaches the key tiles from lo's to hi's: per (b, t) and first tile, the furthest
    last tile, carried along the tiles by a running maximum."""
    valid = real_row & (lo <= hi)  # (B, nq*bq)
    b, row = np.nonzero(valid)
    reach = np.full((n_batch, nq, nk), -1, dtype=np.int32)  # furthest last tile of rows starting at this one
    np.maximum.at(reach, (b, row // block_q, lo[b, row] // block_k), hi[b, row] // block_k)
    np.maximum.accumulate(reach, axis=2, out=reach)
    return reach >= np.arange(nk, dtype=np.int32)


def _offset(align: str, geom: Geometry) -> int:
    """How far query i is shifted along the keys: Lk - Lq for bottom-right alignment."""
    return geom.Lk - geom.Lq if align == "bottom_right" else 0


class Causal(IntervalMask):
    def __init__(self, align: str = "bottom_right"):
        self.align = inputs.check_choice("align", align, ALIGNS)

    def shift(self, geom) -> int:
        """Query i sees keys j <= i + shift."""
        return _offset(self.align, geom)

    def interval(self, b, qi, geom):
        return qi * 0 + np.iinfo(np.int64).min // 2, qi + self.shift(geom)

    def allows_every_pair(self, geom):
        return self.shift(geom) >= geom.Lk - 1  # the first query already sees the last key

    def _same_in_later_rows(self):
        return self.align == "bottom_right"

    def __repr__(self):
        return f"causal(align={self.align!r})"


#: A window side with no limit: far past any length, yet a position plus or minus it stays in int64.
_UNLIMITED = np.iinfo(np.int64).max // 4


def _reach(side):
    """How far a window side reaches: None and sides longer than _UNLIMITED reach everything."""
    return _UNLIMITED if side is None else min(side, _UNLIMITED)


class Window(IntervalMask):
    def __init__(self, left, right=0, align: str = "bottom_right"):
        self.left = inputs.check_window_side("left", left)
        self.right = inputs.check_window_side("right", right)
        self.align = inputs.check_choice("align", align, ALIGNS)

    def interval(self, b, qi, geom):
        shifted = qi + _offset(self.align, geom)
        return shifted - _reach(self.left), shifted + _reach(self.right)

    def allows_every_pair(self, geom):
        offset = _offset(self.align, geom)  # query i is centred on key i + offset
        sees_first = self.left is None or geom.Lq - 1 + offset - self.left <= 0
        sees_last = self.right is None or offset + self.right >= geom.Lk - 1
        return sees_first and sees_last

    def _same_in_later_rows(self):
        return self.align == "bottom_right"

    def __repr__(self):
        return f"window(left={self.left}, right={self.right}, align={self.align!r})"


class Padding(IntervalMask):
    def __init__(self, kv_lengths, q_lengths=None):
        self.kv_lengths = inputs.check_lengths("kv_lengths", kv_lengths)
        self.q_lengths = None if q_lengths is None else inputs.check_lengths("q_lengths", q_lengths)

    def check(self, geom):
        inputs.check_lengths_fit("kv_lengths", self.kv_lengths, geom.batch, geom.Lk, "Lk")
        if self.q_lengths is not None:
            inputs.check_lengths_fit("q_lengths", self.q_lengths, geom.batch, geom.Lq, "Lq")

    def interval(self, b, qi, geom):
        kv_len = _arrays.like(self.kv_lengths, b)[b]
        hi = kv_len - 1 + qi * 0
        lo = qi * 0
        if self.q_lengths is not None:
            q_len = _arrays.like(self.q_lengths, b)[b]
            lo = lo + (qi >= q_len) * _UNLIMITED  # padded query rows see nothing
        return lo, hi

    def _same_in_later_rows(self):
        return self.q_lengths is None

    def __repr__(self):
        q = "" if self.q_lengths is None else f", q_lengths={self.q_lengths.tolist()}"
        return f"padding(kv_lengths={self.kv_lengths.tolist()}{q})"


class PrefixLM(IntervalMask):
    def __init__(self, lengths):
        self.lengths = inputs.check_lengths("lengths", lengths)

    def check(self, geom):
        inputs.check_lengths_fit("lengths", self.lengths, geom.batch, geom.Lk, "Lk")

    def interval(self, b, qi, geom):
        prefix = _arrays.like(self.lengths, b)[b]
        causal_hi = qi + _offset("bottom_right", geom)
        hi = (prefix - 1) * (prefix - 1 > causal_hi) + causal_hi * (prefix - 1 <= causal_hi)  # max, any kind
        return qi * 0, hi

    def _same_in_later_rows(self):
        return True  # its causal part is bottom-right; the prefix is in key positions

    def __repr__(self):
        return f"prefix_lm(lengths={self.lengths.tolist()})"


class _Intersection:
    """What both intersections of two masks (interval or general) share: the two parts,
    checked together, forbidding nothing only when neither forbids anything."""

    def __init__(self, a: Mask, b: Mask):
        self.parts = (a, b)

    def check(self, geom):
        for p in self.parts:
            p.check(geom)

    def allows_every_pair(self, geom):
        return all(p.allows_every_pair(geom) for p in self.parts)

    def from_query(self, offset):
        return type(self)(*(p.from_query(offset) for p in self.parts))

    def __repr__(self):
        return f"({self.parts[0]!r} & {self.parts[1]!r})"


class IntervalIntersection(_Intersection, IntervalMask):
    def interval(self, b, qi, geom):
        (lo1, hi1), (lo2, hi2) = (p.interval(b, qi, geom) for p in self.parts)
        xp = _arrays.namespace(qi)
        return xp.maximum(lo1, lo2), xp.minimum(hi1, hi2)


class _LaterRows(Mask):
    """Rows [offset, offset + Lq) of `inner` at the sizes of the whole pass (see Mask.from_query)."""

    def __init__(self, inner: Mask, offset: int):
        self.inner, self.offset = inner, offset
        self.head_independent = inner.head_independent

    def whole(self, geom):
        """The whole pass's sizes: the earlier queries come first."""
        return replace(geom, Lq=geom.Lq + self.offset)

    def check(self, geom):
        self.inner.check(self.whole(geom))

    def allowed(self, b, h, qi, ki, geom):
        return self.inner.allowed(b, h, qi + self.offset, ki, self.whole(geom))

    def __repr__(self):
        return f"{self.inner!r} from query {self.offset}"


class _LaterIntervalRows(_LaterRows, IntervalMask):
    """The same for a key-interval mask, which stays one."""

    allowed = IntervalMask.allowed

    def interval(self, b, qi, geom):
        return self.inner.interval(b, qi + self.offset, self.whole(geom))


# ======================================================================================
# Other masks
# ======================================================================================
class Document(Mask):
    """Packed sequences: query i sees key j when both carry the same segment id."""

    def __init__(self, ids, kv_ids=None):
        self.ids = inputs.check_ids("ids", ids)
        self.kv_ids = self.ids if kv_ids is None else inputs.check_ids("kv_ids", kv_ids)
        self._own_kv = kv_ids is not None

    def check(self, geom):
        inputs.check_ids_fit("ids", self.ids, geom.batch, geom.Lq, "Lq")
        inputs.check_ids_fit("kv_ids" if self._own_kv else "ids (used for the keys too)", self.kv_ids,
                             geom.batch, geom.Lk, "Lk")

    def allowed(self, b, h, qi, ki, geom):
        # ids of one row, (1, L), serve every batch row
        q_ids = _arrays.like(self.ids, b)[b * (self.ids.shape[0] > 1), qi]  # (nb, 1, bq, 1)
        k_ids = _arrays.like(self.kv_ids, b)[b * (self.kv_ids.shape[0] > 1), ki]  # (nb, 1, 1, bk)
        return q_ids == k_ids

    def _classify(self, geom, block_q, block_k):
        sorted_ids = all((np.diff(x, axis=-1) >= 0).all() for x in (self.ids, self.kv_ids))
        if not sorted_ids:  # tiles of unsorted ids are settled by evaluation
            return super()._classify(geom, block_q, block_k)
        q_lo, q_hi = _tile_min_max(self.ids, block_q)
        k_lo, k_hi = _tile_min_max(self.kv_ids, block_k)
        # (B, nq, 1) against (B, 1, nk): with sorted ids, disjoint ranges share no id
        empty = (q_hi[:, :, None] < k_lo[:, None, :]) | (k_hi[:, None, :] < q_lo[:, :, None])
        one_id = (q_lo[:, :, None] == q_hi[:, :, None]) & (k_lo[:, None, :] == k_hi[:, None, :])
        full = one_id & (q_lo[:, :, None] == k_lo[:, None, :])
        classes = np.where(full, FULL, np.where(empty, EMPTY, PARTIAL)).astype(np.int8)
        return _squeeze_unused(np.broadcast_to(classes[:, None], (geom.batch,) + classes[:, None].shape[1:]).copy())

    def __repr__(self):
        return "document(ids)"


def _tile_min_max(ids: np.ndarray, block: int):
    """Per-tile min and max of (B, L) ids: two arrays (B, ceil(L/block))."""
    n_batch, length = ids.shape
    n_tiles = _cdiv(length, block)
    padded = np.concatenate([ids, np.repeat(ids[:, -1:], n_tiles * block - length, axis=1)], axis=1)
    tiles = padded.reshape(n_batch, n_tiles, block)  # n_tiles given: -1 cannot be inferred when n_batch is 0
    return tiles.min(axis=2), tiles.max(axis=2)


class MaskFn(Mask):
    """Any vectorised rule ``fn(b, h, qi, ki) -> bool array``."""

    head_independent = False

    def __init__(self, fn):
        self.fn = inputs.check_callable("fn", fn)

    def allowed(self, b, h, qi, ki, geom):
        try:
            result = self.fn(b, h, qi, ki)
        except (TypeError, AttributeError) as error:  # often a rule written for the other kind of array
            given = "torch tensors" if _arrays.is_torch(qi) else "NumPy arrays"
            raise TypeError(f"mask_fn's rule failed on the index arrays it was given, {given} (they are of the "
                            f"inputs' kind): {type(error).__name__}: {error}") from error
        return inputs.check_rule_result("mask_fn", result, b, h, qi, ki)

    def __repr__(self):
        return f"mask_fn({getattr(self.fn, '__name__', 'fn')})"


def runs_user_rule(mask: Mask) -> bool:
    """Whether evaluating the mask calls a rule of the user's (mask_fn) anywhere in its tree:
    its temporaries are the user's, so memory estimates can only assume a typical rule."""
    return isinstance(mask, MaskFn) or any(runs_user_rule(part) for part in _parts(mask))


class _DenseArray:
    """An array broadcastable to (..., Hq, Lq, Lk), viewed as 4-D for a call's sizes.

    The view is kept with the sizes it was made for, and read back only for those: one mask
    object may serve calls of other sizes at the same time (other threads).
    """

    def __init__(self, array):
        self.array = array
        self._fitted = (None, None, False)  # (Geometry, 4-D array, a view of self.array?), replaced as a whole

    def check(self, geom):
        """Fit the array to a call's sizes (each call checks once). A view is kept for later
        calls of these sizes; a copy (a mask broadcast over some batch dims only) is made
        again, so an array changed in place between calls is read as it is now."""
        fitted_geom, _, is_view = self._fitted
        if fitted_geom != geom or not is_view:
            fitted = inputs.fit_dense("mask", self.array, geom)
            self._fitted = (geom, fitted, _arrays.shares_memory(fitted, self.array))

    def fitted(self, geom):
        """The array as (B|1, H|1, Lq|1, Lk|1) for these sizes."""
        fitted_geom, array, _ = self._fitted  # one read: another call may replace it meanwhile
        return array if fitted_geom == geom else inputs.fit_dense("mask", self.array, geom)


class DenseMask(_DenseArray, Mask):
    """An explicit boolean array, broadcastable to (..., Hq, Lq, Lk)."""

    head_independent = False

    def __init__(self, array):
        super().__init__(inputs.check_dense_mask("mask", array))

    def allowed(self, b, h, qi, ki, geom):
        return _dense_lookup(self.fitted(geom), b, h, qi, ki)

    def _same_in_later_rows(self):
        return True  # an array holds the call's own rows

    def __repr__(self):
        return f"dense_mask(shape={tuple(self.array.shape)})"


def _parts(rule) -> list:
    """The masks a combination (&, |, ~, from_query) is made of; none for the others."""
    return list(getattr(rule, "parts", ())) + ([rule.inner] if isinstance(rule, (Not, _LaterRows)) else [])


def held_arrays(rule) -> list:
    """The arrays a mask or score modifier reads when evaluated (dense masks and biases, inside
    any combination); the other rules copy their parameters when made."""
    if isinstance(rule, _DenseArray):
        return [rule.array]
    return [array for part in _parts(rule) for array in held_arrays(part)]


def rules_read_heads(mask: Mask) -> bool:
    """Whether a user's rule (mask_fn) inside the mask may read its head index h, so that its
    temporaries span every head it is evaluated for: False only where the rule's code shows
    that it never loads that parameter."""
    if isinstance(mask, MaskFn):
        return _may_read_second_parameter(mask.fn)
    return any(rules_read_heads(part) for part in _parts(mask))


def _may_read_second_parameter(fn) -> bool:
    code = getattr(fn, "__code__", None)  # None for a bound method, a partial, a callable object
    if code is None or code.co_argcount < 2:
        return True
    name = code.co_varnames[1]
    return name in code.co_cellvars or any(  # captured by an inner function, or loaded
        i.opname.startswith("LOAD_FAST") and name in (i.argval if isinstance(i.argval, tuple) else (i.argval,))
        for i in dis.get_instructions(code))


def tensors_rules_read(rule) -> list:
    """The torch tensors the user's rules (mask_fn, score_fn) inside a mask or score modifier
    read directly: captured in a rule's closure, its defaults, or the globals it names. Tensors
    reached any other way (through a helper, an object's attribute) are not seen."""
    if isinstance(rule, (MaskFn, ScoreFn)):
        return _tensors_read_by(rule.fn)
    return [t for part in _parts(rule) for t in tensors_rules_read(part)]


def _tensors_read_by(fn) -> list:
    fn = getattr(fn, "__func__", fn)  # a bound method: its function
    code, torch = getattr(fn, "__code__", None), sys.modules.get("torch")
    if code is None or torch is None:  # a builtin or a callable object: nothing to see
        return []
    values = list(fn.__defaults__ or ()) + list((fn.__kwdefaults__ or {}).values())
    for cell in fn.__closure__ or ():
        try:
            values.append(cell.cell_contents)
        except ValueError:  # a cell not yet filled
            pass
    values += [fn.__globals__[name] for name in _global_names(code) if name in fn.__globals__]
    # inference tensors keep no version to check (and change only inside inference_mode)
    return [v for v in values if isinstance(v, torch.Tensor) and not v.is_inference()]


@functools.lru_cache(maxsize=256)
def _global_names(code) -> tuple:
    """The global names a code object loads (co_names also lists attribute names: a rule
    reading cfg.window would seem to read a global tensor named window)."""
    return tuple({i.argval for i in dis.get_instructions(code) if i.opname in ("LOAD_GLOBAL", "LOAD_NAME")})


def _dense_lookup(arr4, b, h, qi, ki):
    """arr4 (B|1, H|1, Lq|1, Lk|1) gathered at broadcast indices; size-1 dims broadcast."""
    arr4 = _arrays.like(arr4, b)
    idx = [i * (n > 1) for i, n in zip((b, h, qi, ki), arr4.shape)]
    return arr4[idx[0], idx[1], idx[2], idx[3]]


class And(_Intersection, Mask):
    def __init__(self, a: Mask, b: Mask):
        super().__init__(a, b)
        self.head_independent = a.head_independent and b.head_independent

    def allowed(self, b, h, qi, ki, geom):
        return self.parts[0].allowed(b, h, qi, ki, geom) & self.parts[1].allowed(b, h, qi, ki, geom)

    def _classify(self, geom, block_q, block_k):
        x, y = (p._classify(geom, block_q, block_k) for p in self.parts)
        out = np.where((x == EMPTY) | (y == EMPTY), EMPTY,
                       np.where(x == FULL, y, np.where(y == FULL, x, _MAYBE)))
        return out.astype(np.int8)


class Or(And):
    def allows_every_pair(self, geom):
        return any(p.allows_every_pair(geom) for p in self.parts)

    def allowed(self, b, h, qi, ki, geom):
        return self.parts[0].allowed(b, h, qi, ki, geom) | self.parts[1].allowed(b, h, qi, ki, geom)

    def _classify(self, geom, block_q, block_k):
        x, y = (p._classify(geom, block_q, block_k) for p in self.parts)
        out = np.where((x == FULL) | (y == FULL), FULL,
                       np.where(x == EMPTY, y, np.where(y == EMPTY, x, _MAYBE)))
        return out.astype(np.int8)

    def __repr__(self):
        return f"({self.parts[0]!r} | {self.parts[1]!r})"


class Not(Mask):
    def __init__(self, inner: Mask):
        self.inner = inner
        self.head_independent = inner.head_independent

    def check(self, geom):
        self.inner.check(geom)

    def allowed(self, b, h, qi, ki, geom):
        return ~self.inner.allowed(b, h, qi, ki, geom)

    def from_query(self, offset):
        return Not(self.inner.from_query(offset))

    def _classify(self, geom, block_q, block_k):
        x = self.inner._classify(geom, block_q, block_k)
        return np.where(x == EMPTY, FULL, np.where(x == FULL, EMPTY, x)).astype(np.int8)

    def __repr__(self):
        return f"~{self.inner!r}"


# ======================================================================================
# Public constructors
# ======================================================================================
def causal(align: str = "bottom_right") -> Mask:
    """Causal mask. Bottom-right (default): query i sees keys j <= i + Lk - Lq.

    With Lq = 3 queries over Lk = 5 keys::

        bottom_right            top_left
        keys  0 1 2 3 4         keys  0 1 2 3 4
        q0    █ █ █ · ·         q0    █ · · · ·
        q1    █ █ █ █ ·         q1    █ █ · · ·
        q2    █ █ █ █ █         q2    █ █ █ · ·

    Bottom-right is what decoding with a KV cache needs: the last query is the newest
    token and sees every key. ``align="top_left"`` gives j <= i.
    """
    return Causal(align)


def window(left=None, right=0, align: str = "bottom_right") -> Mask:
    """Sliding window: with i' = i + Lk - Lq (or i when top-left), keys i' - left <= j <= i' + right.

    ``left`` / ``right`` are non-negative ints, or None for no limit on that side.
    ``window(left=255)`` is the causal 256-token sliding window.
    """
    return Window(left, right, align)


def padding(kv_lengths, q_lengths=None) -> Mask:
    """Per batch row b: keys j < kv_lengths[b]; query rows i >= q_lengths[b] see nothing (output 0).

    Lengths have one entry per batch row (the flattened leading dims of q).
    """
    return Padding(kv_lengths, q_lengths)


def document(ids, kv_ids=None) -> Mask:
    """Packed sequences: ids (B, Lq) (and kv_ids (B, Lk), default ids); i sees j when the ids match.
    ids of shape (Lq,) or (1, Lq) serve every batch row."""
    return Document(ids, kv_ids)


def prefix_lm(lengths) -> Mask:
    """Prefix LM: keys j < lengths[b] are seen by every query; beyond the prefix, causal (bottom-right)."""
    return PrefixLM(lengths)


def mask_fn(fn) -> Mask:
    """A vectorised rule ``fn(b, h, qi, ki) -> bool`` over broadcast index arrays.

    The index arrays are of the inputs' kind: NumPy arrays for NumPy inputs, torch tensors for
    torch ones (on the host where qkv classifies tiles, on the inputs' device in the torch
    backend), so a rule may use that kind's functions. ``blocks`` and ``materialize`` pass
    NumPy arrays. A backward evaluates the rule again: torch tensors it reads directly (its
    closure, defaults, globals it names) must not change in place before then (refused).
    """
    return MaskFn(fn)


def dense_mask(array) -> Mask:
    """An explicit boolean array (True = attend), broadcastable to (..., Hq, Lq, Lk)."""
    return DenseMask(array)


# ======================================================================================
# Score modifiers
# ======================================================================================
class ScoreMod:
    """Changes scaled scores s (nb, nh, bq, bk) before the softmax."""

    #: True when d(new score)/d(score) == 1 (the gradient passes through unchanged).
    additive = False

    def apply(self, s, b, h, qi, ki, geom: Geometry):
        raise NotImplementedError

    def check(self, geom: Geometry) -> None:
        """Raise ValueError if the modifier's parameters do not fit these sizes."""

    def from_query(self, offset: int) -> "ScoreMod":
        """As Mask.from_query. alibi reads query positions bottom-right and a bias array
        holds the call's own rows, so only score_fn changes."""
        return self


class Alibi(ScoreMod):
    additive = True

    def __init__(self, slopes):
        self.slopes = inputs.check_slopes("slopes", slopes)
        self.largest = float(np.abs(self.slopes).max(initial=0.0))  # checked against float32 per call
        # slopes that require grad or carry a forward-mode tangent: the formula paths
        # (attention_weights) differentiate through them; attention refuses them
        # (inputs.refuse_trainable_rules)
        differentiable = _arrays.is_torch(slopes) and (slopes.requires_grad or _arrays.has_tangents(slopes))
        self.trainable = slopes if differentiable else None

    def check(self, geom):
        inputs.check_size("slopes", self.slopes, geom.heads, "the number of query heads")

    def apply(self, s, b, h, qi, ki, geom):
        slopes = self.trainable if self.trainable is not None and _arrays.is_torch(s) else self.slopes
        slope = _arrays.cast_like(_arrays.like(slopes, s)[h], s)  # (1, nh, 1, 1)
        distance = _arrays.cast_like(abs(qi + _offset("bottom_right", geom) - ki), s)  # in s's dtype, no promotion
        return s - slope * distance

    def __repr__(self):
        return f"alibi({len(self.slopes)} slopes)"


class Softcap(ScoreMod):
    def __init__(self, cap):
        self.cap = inputs.check_positive_float("cap", cap)
        tiny, largest = float(np.finfo(np.float32).tiny), float(np.finfo(np.float32).max)
        if not tiny <= self.cap <= largest:  # past them, the float32 cap is 0 or inf: every score NaN
            raise ValueError(f"cap must lie within float32's normal range [{tiny:.3g}, {largest:.3g}] (low "
                             f"precision computes in float32), got {cap!r}")

    def apply(self, s, b, h, qi, ki, geom):
        xp = _arrays.namespace(s)
        return xp.where(s == -np.inf, s, xp.tanh(s / self.cap) * self.cap)  # a -inf bias stays masked, not -cap

    def derivative(self, s_in):
        """d softcap / d s at the unmodified score s_in."""
        t = _arrays.namespace(s_in).tanh(s_in / self.cap)
        return 1 - t * t

    def __repr__(self):
        return f"softcap({self.cap})"


class ScoreFn(ScoreMod):
    def __init__(self, fn, first_query: int = 0):
        self.fn = inputs.check_callable("fn", fn)
        self.first_query = first_query  # the position of the call's query 0 (see from_query)

    def apply(self, s, b, h, qi, ki, geom):
        return inputs.check_score_result("score_fn", self.fn(s, b, h, qi + self.first_query, ki), s)

    def from_query(self, offset):
        return self if offset == 0 else ScoreFn(self.fn, self.first_query + offset)

    def __repr__(self):
        return f"score_fn({getattr(self.fn, '__name__', 'fn')})"


class Bias(_DenseArray, ScoreMod):
    """A float array added to the scores (a float mask), broadcastable to (..., Hq, Lq, Lk)."""

    additive = True

    def apply(self, s, b, h, qi, ki, geom):
        return s + _arrays.cast_like(_dense_lookup(self.fitted(geom), b, h, qi, ki), s)

    def __repr__(self):
        return f"bias(shape={tuple(self.array.shape)})"


def farthest_key(Lq: int, Lk: int) -> int:
    """ALiBi's largest distance |i + Lk - Lq - j| over a call, at least 1: what a slope is
    multiplied by at most (and at least the slope itself, which is cast too)."""
    return max(Lq, Lk, 2) - 1


def alibi(slopes) -> ScoreMod:
    """ALiBi: adds -slopes[h] * |i' - j| (i' = i + Lk - Lq) to every score.

    slopes: (Hq,), one finite number per query head (``qkv.positional.alibi_slopes(Hq)``
    gives the usual ones); for inputs that compute in float32, a slope times the farthest key
    (max(Lq, Lk) - 1) must lie within float32's range. The slopes are copied when alibi() is
    called: make a new modifier after changing them (of slopes that require grad, the torch
    operations that differentiate through them read the tensor itself). Slopes that require
    grad or carry a forward-mode tangent are for ``attention_weights`` only: ``attention``
    refuses them (those that require grad only while gradients are recorded).
    """
    return Alibi(slopes)


def softcap(cap) -> ScoreMod:
    """Soft capping: s -> cap * tanh(s / cap), applied to the scaled scores (..., Hq, Lq, Lk).

    cap: a positive float within float32's normal range; masked scores (-inf) stay masked.
    """
    return Softcap(cap)


def score_fn(fn) -> ScoreMod:
    """Any vectorised rule ``fn(score, b, h, qi, ki) -> new score`` (NumPy or torch ops).

    score is a block of the scaled scores, broadcastable to (B, Hq, Lq, Lk); b, h, qi and ki
    are index arrays that broadcast against it (batch, query head, query and key positions).
    The answer is a floating array that broadcasts to the scores' shape (a rule of the
    positions alone may return (Lq, Lk)). No gradient flows to tensors the rule reads: with
    autograd recording, a rule that reads tensors requiring grad is refused, and one whose
    tensors (its closure, defaults, globals it names) changed in place before the backward.
    """
    return ScoreFn(fn)


def apply_score_mods(mods, s, b, h, qi, ki, geom):
    """Apply the modifiers in order."""
    for mod in mods:
        s = mod.apply(s, b, h, qi, ki, geom)
    return s
