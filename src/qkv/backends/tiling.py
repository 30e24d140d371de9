"""The pieces of the tiled (FlashAttention) algorithm shared by the NumPy and torch backends.

Both backends work on *rows*: a row r is one (batch, kv head) pair and holds the `group`
query heads that share that kv head, stacked: a query tile of a row is (group * bq, D),
so grouped-query attention multiplies one K/V tile against all its query heads at once
without copying K or V.
"""
from __future__ import annotations

import numpy as np

from .. import _arrays
from ..masks import PARTIAL, apply_score_mods
from .base import count_tiles, dropout_scale_tile


def row_indices(like, rows, kv_heads: int, group: int, q0: int, q1: int, k0: int, k1: int):
    """Index arrays for `rows` (1-D) and the tile [q0, q1) x [k0, k1).

    Shapes: b (nr, 1, 1, 1), h (nr, group, 1, 1), qi (1, 1, bq, 1), ki (1, 1, 1, bk).
    """
    rows = np.asarray(rows, dtype=np.int64)
    heads = (rows % kv_heads)[:, None] * group + np.arange(group)  # (nr, group)
    to = lambda x: _arrays.like(x, like)  # noqa: E731
    return (
        to(rows // kv_heads).reshape(-1, 1, 1, 1),
        to(heads).reshape(len(rows), group, 1, 1),
        (_arrays.arange_like(q1 - q0, like) + q0).reshape(1, 1, -1, 1),
        (_arrays.arange_like(k1 - k0, like) + k0).reshape(1, 1, 1, -1),
    )


class TileRule:
    """Modifiers, mask and dropout of one tile, applied to stacked scores (nr, group*bq, bk)."""

    def __init__(self, inp, rows, q0, q1, k0, k1, partial, like):
        self.inp, self.partial = inp, partial
        self.shape = (len(rows), inp.group * (q1 - q0), k1 - k0)
        needs_index = inp.score_mods or partial is not None and partial.any() or inp.dropout_p > 0
        self.idx = row_indices(like, rows, inp.Hkv, inp.group, q0, q1, k0, k1) if needs_index else None
        count_tiles(computed=len(rows), masked=0 if partial is None else int(partial.sum()))

    def _stack(self, x):
        """(nr|1, group|1, bq|1, bk|1) -> (nr, group*bq, bk)."""
        nr, g = self.shape[0], self.inp.group
        return _arrays.broadcast_to(x, (nr, g, self.shape[1] // g, self.shape[2])).reshape(self.shape)

    def modify(self, s):
        """Apply the score modifiers to raw scaled scores s (nr, group*bq, bk)."""
        if not self.inp.score_mods:
            return s
        nr, g = self.shape[0], self.inp.group
        s4 = s.reshape(nr, g, -1, self.shape[2])
        return apply_score_mods(self.inp.score_mods, s4, *self.idx, self.inp.geom).reshape(self.shape)

    def allowed(self):
        """Boolean (nr, group*bq, bk) for the tile's partial rows, or None when none are partial.

        Only the rows flagged PARTIAL evaluate the mask; FULL rows get all True.
        """
        if self.partial is None or not self.partial.any():
            return None
        b, h, qi, ki = self.idx
        if self.partial.all():
            return self._stack(self.inp.mask.allowed(b, h, qi, ki, self.inp.geom))
        pick = np.flatnonzero(self.partial)
        sub = _arrays.like(pick, b)
        rule = self.inp.mask.allowed(b[sub], h[sub], qi, ki, self.inp.geom)
        rule = _arrays.broadcast_to(rule, (len(pick),) + (self.inp.group, self.shape[1] // self.inp.group,
                                                          self.shape[2])).reshape((len(pick),) + self.shape[1:])
        full = _arrays.namespace(b).ones(self.shape, dtype=rule.dtype, **_device_kw(b))
        full[sub] = rule
        return full

    def dropout(self, like):
        """Keep mask / (1 - p) stacked like the scores, or None."""
        if self.inp.dropout_p == 0:
            return None
        return self._stack(dropout_scale_tile(self.inp, *self.idx, like))


def _device_kw(like):
    return {"device": like.device} if _arrays.is_torch(like) else {}


def partial_flags(classes, rows, t, j):
    """Boolean PARTIAL flag per row for tile (t, j), or None when there is no mask."""
    if classes is None:
        return None
    return classes[rows, t, j] == PARTIAL
