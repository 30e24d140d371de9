"""The NumPy backend: tiled online softmax (the FlashAttention algorithm), O(N) extra memory.

For each row (batch, kv head) and query tile, it walks the key tiles keeping a running
row max m, a running sum l and an unnormalised output acc; each new tile rescales them
by exp(m_old - m_new). Nothing of size Lq x Lk is ever held. Work items (row, query tile)
run on a thread pool: NumPy's matmul releases the GIL.
"""
from __future__ import annotations

import numpy as np

from .._threads import available_cpus, parallel_map
from ..masks import EMPTY, rules_read_heads, runs_user_rule
from .base import (Backend, Capabilities, cdiv, compute_dtype_name, dropout_bytes_per_score, nbytes, row_tile_classes,
                   tile_workspace)
from .tiling import TileRule, partial_flags

class NumpyBackend(Backend):
    name = "numpy"
    caps = Capabilities(kinds=("numpy",), devices=("cpu",), dtypes=("float64", "float32", "float16"), dropout=True)
    block_q = 256
    block_k = 1024

    def block_sizes(self, inp):
        return self.block_q, self.block_k

    def forward(self, inp):
        cdt = compute_dtype_name(inp.dtype)
        out = np.zeros((inp.B, inp.Hq, inp.Lq, inp.Dv), dtype=inp.dtype)
        lse = np.full((inp.B, inp.Hq, inp.Lq), -np.inf, dtype=cdt)
        classes = row_tile_classes(inp, self.block_q, self.block_k)  # (R, nq, nk) or None
        work = [(r, t) for r in range(inp.B * inp.Hkv) for t in range(cdiv(inp.Lq, self.block_q))]
        parallel_map(lambda rt: self._query_tile(inp, classes, cdt, out, lse, *rt), work)
        return out, lse

    def _query_tile(self, inp, classes, cdt, out, lse, r, t):
        b, kv = divmod(r, inp.Hkv)
        heads = slice(kv * inp.group, (kv + 1) * inp.group)
        q0, q1 = t * self.block_q, min((t + 1) * self.block_q, inp.Lq)
        n = inp.group * (q1 - q0)
        q = inp.q[b, heads, q0:q1].astype(cdt).reshape(n, inp.D)  # (G*bq, D)
        m = np.full((n, 1), -np.inf, dtype=cdt)  # running row max
        safe_m = np.zeros((n, 1), dtype=cdt)
        l = np.zeros((n, 1), dtype=cdt)  # running sum of exp
        acc = np.zeros((n, inp.Dv), dtype=cdt)  # running unnormalised output
        for j in range(cdiv(inp.Lk, self.block_k)):
            if classes is not None and classes[r, t, j] == EMPTY:
                continue
            k0, k1 = j * self.block_k, min((j + 1) * self.block_k, inp.Lk)
            rule = TileRule(inp, [r], q0, q1, k0, k1, partial_flags(classes, [r], t, j), q)
            s = q @ inp.k[b, kv, k0:k1].astype(cdt).T  # (G*bq, bk)
            s = rule.modify(np.multiply(s, inp.scale, out=s)[None])[0]  # scaled after the product
            allowed = rule.allowed()
            if allowed is not None:
                s = np.where(allowed[0], s, -np.inf)
            m_new = np.maximum(m, s.max(axis=1, keepdims=True))
            safe_m = np.where(m_new == -np.inf, 0, m_new)  # rows with nothing allowed yet
            p = np.exp(np.subtract(s, safe_m, out=s), out=s)  # (G*bq, bk), in place: s is a temporary
            alpha = np.exp(m - safe_m)  # rescales what was summed under the old max
            l = l * alpha + p.sum(axis=1, keepdims=True)
            keep = rule.dropout(p[None])
            if keep is not None:
                p = p * keep[0]
            acc = acc * alpha + p @ inp.v[b, kv, k0:k1].astype(cdt)
            m = m_new
        has_key = l != 0  # exactly 0 where no key is allowed; NaN (from NaN inputs) propagates
        out[b, heads, q0:q1] = np.where(has_key, acc / np.where(has_key, l, 1), 0).reshape(
            inp.group, q1 - q0, inp.Dv)
        lse[b, heads, q0:q1] = np.where(has_key, safe_m + np.log(np.where(has_key, l, 1)), -np.inf).reshape(
            inp.group, q1 - q0)

    def workspace_bytes(self, inp):
        cdt = compute_dtype_name(inp.dtype)
        workers = min(available_cpus(), max(1, inp.B * inp.Hkv * cdiv(inp.Lq, self.block_q)))
        bq, bk = min(self.block_q, inp.Lq), min(self.block_k, inp.Lk)  # tiles are cut to the lengths
        tiles = tile_workspace(workers, bq, bk, inp.group, inp.D, inp.Dv, inp.dtype)
        # beyond those: a worker's copies of its K and V tiles and the output's two
        # temporaries of each step (acc * alpha, p @ v)
        tiles += workers * (bk * (inp.D + inp.Dv) + inp.group * bq * 2 * inp.Dv) * nbytes(cdt)
        lse = inp.B * inp.Hq * inp.Lq * (8 if inp.dtype == "float64" else 4)
        # dropout: 13 bytes a score traced in float32, 16 in float64 (test_memory); counted 21 and 25
        per_score = self._mask_bytes_per_score(inp) + dropout_bytes_per_score(inp, int64_words=2, float_copies=1)
        return tiles + lse + workers * bq * bk * per_score

    @staticmethod
    def _mask_bytes_per_score(inp) -> int:
        """A masked tile's temporaries, per (query, key) pair: for each head of the group the
        rule's answer (bool), and then the masked scores; a rule of the user's is assumed to
        hold two int64 index temporaries while it runs, as `(qi - ki) % 3 != 0` does, freed
        before the masked scores are made: one pair's, or each head's where the rule reads h."""
        if inp.mask is None:
            return 0
        user_rule = 2 * 8 * (inp.group if rules_read_heads(inp.mask) else 1) if runs_user_rule(inp.mask) else 0
        return inp.group + max(user_rule, inp.group * nbytes(compute_dtype_name(inp.dtype)))  # bools + the larger
