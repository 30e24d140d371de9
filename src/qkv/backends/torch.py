"""The torch backend: the tiled online-softmax algorithm in torch ops, on any torch device.

Forward walks query tiles and, inside, key tiles, for all rows (batch, kv head) at once;
a tile that is EMPTY for some rows runs only on the others. It saves the log-sum-exp,
and its own autograd backward (FlashAttention-2 style) recomputes each tile's
probabilities as exp(score - lse) instead of storing Lq x Lk of anything.
"""
from __future__ import annotations

import functools

import numpy as np

from .. import _arrays
from ..masks import EMPTY, runs_user_rule
from .base import (Backend, Capabilities, autograd_attention, cdiv, compute_dtype_name, dropout_bytes_per_score,
                   nbytes, row_tile_classes, saved_output_bytes, split_lse, tile_workspace)
from .tiling import TileRule, partial_flags

#: Score-tile elements (all rows together) the kernel aims for: big tiles mean fewer
#: Python steps, small ones less memory.
TILE_BUDGET = 1 << 21


def choose_blocks(rows: int, group: int, Lq: int, Lk: int) -> tuple[int, int]:
    block_q, block_k = 512, 1024
    while rows * group * block_q * block_k > TILE_BUDGET and (block_q > 32 or block_k > 64):
        if block_k >= 2 * block_q or block_q <= 32:
            block_k //= 2
        else:
            block_q //= 2
    return max(1, min(block_q, Lq)), max(1, min(block_k, Lk))


class _Tiles:
    """One call's tiling: block sizes, tile classes and the rows each tile runs on."""

    def __init__(self, inp):
        self.rows = inp.B * inp.Hkv
        self.block_q, self.block_k = choose_blocks(self.rows, inp.group, inp.Lq, inp.Lk)
        self.nq, self.nk = cdiv(inp.Lq, self.block_q), cdiv(inp.Lk, self.block_k)
        self.classes = row_tile_classes(inp, self.block_q, self.block_k)  # (R, nq, nk) or None

    def q_range(self, t, L):
        return t * self.block_q, min((t + 1) * self.block_q, L)

    def k_range(self, j, L):
        return j * self.block_k, min((j + 1) * self.block_k, L)

    def active(self, t, j):
        """Rows to compute for tile (t, j): (numpy row ids, index tensor or None for all)."""
        if self.classes is None:
            return np.arange(self.rows), None
        rows = np.flatnonzero(self.classes[:, t, j] != EMPTY)
        return rows, (None if len(rows) == self.rows else rows)


def _pick(x, sel):
    """x restricted to the selected rows (dim 0), or x itself."""
    return x if sel is None else x[sel]


def _stacked_q(q5, q0, q1):
    """(R, G, Lq, D) -> query tile (R, G*bq, D)."""
    r, g, _, d = q5.shape
    return q5[:, :, q0:q1].reshape(r, g * (q1 - q0), d)


def forward_tiled(inp, q, k, v, keep_sum_dtype=False):
    """(out (B, Hq, Lq, Dv) in q's dtype, or with keep_sum_dtype in the compute dtype it was
    summed in; lse (B, Hq, Lq) in the compute dtype, and lse_lo, what lse's rounding lost)."""
    import torch

    cdt = getattr(torch, compute_dtype_name(inp.dtype))
    tiles = _Tiles(inp)
    R, G = tiles.rows, inp.group
    q5 = q.reshape(R, G, inp.Lq, inp.D)
    k3, v3 = k.reshape(R, inp.Lk, inp.D), v.reshape(R, inp.Lk, inp.Dv)
    out = torch.empty(R, G, inp.Lq, inp.Dv, dtype=cdt if keep_sum_dtype else q.dtype, device=q.device)
    lse = torch.empty(R, G, inp.Lq, dtype=cdt, device=q.device)
    lse_lo = torch.empty(R, G, inp.Lq, dtype=cdt, device=q.device)
    for t in range(tiles.nq):
        q0, q1 = tiles.q_range(t, inp.Lq)
        qt = _stacked_q(q5, q0, q1).to(cdt)  # (R, G*bq, D)
        n = qt.shape[1]
        m = torch.full((R, n, 1), float("-inf"), dtype=cdt, device=q.device)  # running row max
        l = torch.zeros(R, n, 1, dtype=cdt, device=q.device)  # running sum of exp
        acc = torch.zeros(R, n, inp.Dv, dtype=cdt, device=q.device)  # running unnormalised output
        for j in range(tiles.nk):
            rows, sel = tiles.active(t, j)
            if len(rows) == 0:
                continue
            k0, k1 = tiles.k_range(j, inp.Lk)
            rule = TileRule(inp, rows, q0, q1, k0, k1, partial_flags(tiles.classes, rows, t, j), qt)
            kt = _pick(k3[:, k0:k1], sel).to(cdt)  # (r, bk, D)
            vt = _pick(v3[:, k0:k1], sel).to(cdt)  # (r, bk, Dv)
            s = rule.modify(scaled_scores(_pick(qt, sel), kt, inp.scale))  # (r, G*bq, bk)
            allowed = rule.allowed()
            if allowed is not None:
                s = s.masked_fill(~allowed, float("-inf"))
            new = _online_step(_pick(m, sel), _pick(l, sel), _pick(acc, sel), s, vt, rule.dropout(s))
            if sel is None:
                m, l, acc = new
            else:
                m[sel], l[sel], acc[sel] = new
        has_key = l != 0  # exactly 0 where no key is allowed; NaN (from NaN inputs) propagates
        safe_m = torch.where(m == float("-inf"), torch.zeros_like(m), m)
        out[:, :, q0:q1] = torch.where(has_key, acc / torch.where(has_key, l, torch.ones_like(l)),
                                       torch.zeros_like(acc)).reshape(R, G, q1 - q0, inp.Dv)
        row_lse, row_lo = split_lse(safe_m, torch.log(l))
        lse[:, :, q0:q1] = torch.where(has_key, row_lse, float("-inf")).reshape(R, G, q1 - q0)
        lse_lo[:, :, q0:q1] = torch.where(has_key, row_lo, 0.0).reshape(R, G, q1 - q0)
    shape = (inp.B, inp.Hq, inp.Lq)
    return out.reshape(*shape, inp.Dv), lse.reshape(shape), lse_lo.reshape(shape)


def _online_step(m, l, acc, s, vt, keep):
    """Fold one score tile s (r, n, bk) into the running max m, sum l and output acc."""
    import torch

    m_new = torch.maximum(m, s.amax(dim=-1, keepdim=True))
    safe_m = torch.where(m_new == float("-inf"), torch.zeros_like(m_new), m_new)  # rows with nothing yet
    p = s.sub_(safe_m).exp_()  # (r, n, bk), in place: s is a temporary
    alpha = torch.exp(m - safe_m)  # rescales what was summed under the old max
    l = l * alpha + p.sum(dim=-1, keepdim=True)
    if keep is not None:
        p = p * keep
    acc = acc * alpha + p @ vt
    return m_new, l, acc


def backward_tiled(inp, q, k, v, out, lse, dout, dlse, keep_sum_dtype=False, lse_lo=None):
    """(dq, dk, dv) by recomputing each tile's probabilities from the saved lse (and lse_lo,
    if given); in the inputs' dtypes, or with keep_sum_dtype in the one they were summed in (lse's)."""
    import torch

    cdt = lse.dtype
    tiles = _Tiles(inp)
    R, G = tiles.rows, inp.group
    q5 = q.to(cdt).reshape(R, G, inp.Lq, inp.D)
    k3, v3 = k.reshape(R, inp.Lk, inp.D), v.reshape(R, inp.Lk, inp.Dv)
    do5 = dout.to(cdt).reshape(R, G, inp.Lq, inp.Dv)
    # rowsum(P ∘ dP) = rowsum(dO ∘ O), minus the lse gradient (d lse / d s = P)
    delta = (do5 * out.to(cdt).reshape(R, G, inp.Lq, inp.Dv)).sum(-1)  # (R, G, Lq)
    if dlse is not None:
        delta = delta - dlse.to(cdt).reshape(R, G, inp.Lq)
    lse5 = lse.reshape(R, G, inp.Lq)
    lse5 = torch.where(lse5 == float("-inf"), torch.full_like(lse5, float("inf")), lse5)  # empty rows: P = 0
    lo5 = torch.zeros_like(lse5) if lse_lo is None else lse_lo.reshape(R, G, inp.Lq).to(cdt)
    dq = torch.zeros(R, G, inp.Lq, inp.D, dtype=cdt, device=q.device)
    dk = torch.zeros(R, inp.Lk, inp.D, dtype=cdt, device=q.device)
    dv = torch.zeros(R, inp.Lk, inp.Dv, dtype=cdt, device=q.device)
    for j in range(tiles.nk):
        k0, k1 = tiles.k_range(j, inp.Lk)
        for t in range(tiles.nq):
            rows, sel = tiles.active(t, j)
            if len(rows) == 0:
                continue
            q0, q1 = tiles.q_range(t, inp.Lq)
            qt = _pick(_stacked_q(q5, q0, q1), sel)  # (r, G*bq, D)
            rule = TileRule(inp, rows, q0, q1, k0, k1, partial_flags(tiles.classes, rows, t, j), qt)
            kt = _pick(k3[:, k0:k1], sel).to(cdt)
            vt = _pick(v3[:, k0:k1], sel).to(cdt)
            dot = _pick(_stacked_q(do5, q0, q1), sel)  # (r, G*bq, Dv)
            lse_t = _pick(_stacked_q(lse5[..., None], q0, q1), sel)  # (r, G*bq, 1)
            lo_t = _pick(_stacked_q(lo5[..., None], q0, q1), sel)  # (r, G*bq, 1)
            delta_t = _pick(_stacked_q(delta[..., None], q0, q1), sel)
            raw = scaled_scores(qt, kt, inp.scale)  # (r, G*bq, bk)
            grad_mod, s = _modified_with_grad(rule, raw)
            allowed = rule.allowed()
            if allowed is not None:
                s = s.masked_fill(~allowed, float("-inf"))
            p = torch.exp((s - lse_t).sub_(lo_t))  # (r, G*bq, bk), the forward's probabilities
            keep = rule.dropout(p)
            dp = dot @ vt.transpose(1, 2)  # (r, G*bq, bk)
            if keep is not None:
                dp = dp * keep
            ds = grad_mod(p * (dp - delta_t))  # gradient at the raw scaled scores
            _add_rows(dv[:, k0:k1], sel, (p if keep is None else p * keep).transpose(1, 2) @ dot)
            _add_rows(dk[:, k0:k1], sel, ds.transpose(1, 2) @ qt)  # scaled below
            dq_tile = (ds @ kt).reshape(len(rows), G, q1 - q0, inp.D)  # scaled below
            _add_rows(dq[:, :, q0:q1], sel, dq_tile)
    grads = dq.mul_(inp.scale).reshape(q.shape), dk.mul_(inp.scale).reshape(k.shape), dv.reshape(v.shape)
    return grads if keep_sum_dtype else tuple(g.to(x.dtype) for g, x in zip(grads, (q, k, v)))


def _selective_checkpointing() -> bool:
    """Whether selective activation checkpointing's dispatch mode caches operators' outputs now."""
    try:
        from torch.utils.checkpoint import _CachedTorchDispatchMode, _CachingTorchDispatchMode
    except ImportError:  # a torch without them (they are private): nothing to see
        return False
    return _arrays.dispatch_mode_active(_CachingTorchDispatchMode, _CachedTorchDispatchMode)


def scaled_scores(q, k, scale):
    """scale·(q·kᵀ) for q (r, n, D) and k (r, bk, D): scaled after the product, as the plain
    formula rounds it. A scale folded into q first rounds each of q's elements once more,
    which at large scores put float32 gradients past the tolerance rule."""
    return (q @ k.transpose(1, 2)).mul_(scale)  # (r, n, bk)


def _add_rows(target, sel, value):
    """target[sel] += value, in place (target may be a strided view)."""
    if sel is None:
        target += value
    else:
        import torch

        target.index_add_(0, torch.as_tensor(sel, device=target.device), value)


def _modified_with_grad(rule, raw):
    """Modified scores and a function mapping d(modified) -> d(raw) (autograd for non-additive mods)."""
    import torch

    if all(m.additive for m in rule.inp.score_mods):
        return (lambda ds: ds), rule.modify(raw)
    with torch.enable_grad():
        leaf = raw.detach().requires_grad_(True)
        modified = rule.modify(leaf)
    if not modified.requires_grad:  # a score_fn of the positions alone: the scores do not reach the output
        return (lambda ds: torch.zeros_like(ds)), modified
    return (lambda ds: torch.autograd.grad(modified, leaf, ds, materialize_grads=True)[0]), modified.detach()


class TorchBackend(Backend):
    name = "torch"
    caps = Capabilities(kinds=("torch",), devices=(), dtypes=("float64", "float32", "bfloat16", "float16"),
                        gradients=True, forward_ad=True, dropout=True)
    rereads_rules = True

    def missing(self):
        try:
            import torch  # noqa: F401
        except ImportError:
            return "PyTorch is not installed (pip install qkv[torch])"
        return None

    def extra_reasons(self, inp):
        if _selective_checkpointing():
            return ["selective activation checkpointing caches operators' outputs, which this backend's tiles "
                    "change in place (the recompute would read them changed: dq off by 9.7)"]
        return []

    def block_sizes(self, inp):
        return choose_blocks(inp.B * inp.Hkv, inp.group, inp.Lq, inp.Lk)

    def run_backward(self, inp, q, k, v, out, lse, dout, dlse, float32_grads=False, lse_lo=None):
        """(dq, dk, dv) from a saved forward (used by ring attention for its blocks): in the
        inputs' dtype, or, with float32_grads, in the dtype they were summed in (float32 or wider)."""
        return backward_tiled(inp, q, k, v, out, lse, dout, dlse, keep_sum_dtype=float32_grads, lse_lo=lse_lo)

    def run_forward(self, inp, q, k, v, float32_out=False):
        """(out, lse, lse_lo) without autograd (used by ring attention for its blocks): out in the
        inputs' dtype, or, with float32_out, in the dtype it was summed in (float32 or wider)."""
        return forward_tiled(inp, q, k, v, keep_sum_dtype=float32_out)

    def forward(self, inp):
        if inp.needs_grad:
            return autograd_attention(functools.partial(forward_tiled, keep_sum_dtype=True), backward_tiled,
                                      inp.q, inp.k, inp.v, inp, inp.held_tensors())
        return forward_tiled(inp, inp.q, inp.k, inp.v)[:2]

    def workspace_bytes(self, inp):
        rows = inp.B * inp.Hkv
        block_q, block_k = choose_blocks(rows, inp.group, inp.Lq, inp.Lk)
        lse = 2 * inp.B * inp.Hq * inp.Lq * (8 if inp.dtype == "float64" else 4)  # lse and lse_lo
        # dropout's temporaries, on the high side (B=1, H=4, 1024 x 2048: 23 bytes a score held
        # in float32, 60 in float64; counted 49 and 65)
        dropout = rows * block_q * block_k * dropout_bytes_per_score(inp, int64_words=4, float_copies=4)
        mask = rows * block_q * block_k * self._mask_bytes_per_score(inp)
        return tile_workspace(rows, block_q, block_k, inp.group, inp.D, inp.Dv, inp.dtype) + lse + dropout + mask \
            + saved_output_bytes(inp)

    @staticmethod
    def _mask_bytes_per_score(inp) -> int:
        """A masked tile's temporaries, per (query, key) pair: for each head of the group the
        rule's answer and its negation (bool) and the masked copy of the scores; a rule of
        the user's is assumed to hold two int64 temporaries per head, as `(qi + ki + h) % 3`
        does (B=1, H=8, L=2048, float32: the peak grew by 74-83 MiB with it, 34-38 without)."""
        if inp.mask is None:
            return 0
        user_rule = 2 * 8 if runs_user_rule(inp.mask) else 0
        return inp.group * (2 + nbytes(compute_dtype_name(inp.dtype)) + user_rule)
