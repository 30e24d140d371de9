"""qkv.attention_stats (streamed statistics of the weights) and attention_weights(rows=...).

Every statistic is compared with the same statistic computed from the explicit matrix
``qkv.attention_weights`` in float64, on every mask kind, score modifiers and
grouped-query heads, with small tiles (so that EMPTY, PARTIAL and FULL tiles all occur)
and with the default ones.
"""
import sys
import textwrap

import numpy as np
import pytest
from helpers import run_measured

import qkv
from qkv import stats as stats_module
from qkv.stats import attention_stats

try:
    import torch
except ImportError:  # pragma: no cover - the dev extra installs torch
    torch = None

B, HQ, HKV, LQ, LK, D = 2, 4, 2, 37, 53, 16


def statistics_of(w, topk=0):
    """The statistics by their definitions, from explicit weights w (..., Lq, Lk) in float64."""
    with np.errstate(divide="ignore", invalid="ignore"):
        entropy = -np.where(w > 0, w * np.log(w), 0.0).sum(-1)
    out = {"entropy": entropy, "max_weight": w.max(-1), "received": w.sum(-2)}
    if topk:
        out["topk_weights"] = -np.sort(-w, axis=-1)[..., :topk]
    return out


def check_against_weights(got, w, topk=0, atol=1e-12):
    """Compare AttentionStats `got` with the statistics of the explicit weights w."""
    want = statistics_of(w, topk)
    for name in ("entropy", "max_weight", "received"):
        np.testing.assert_allclose(np.asarray(getattr(got, name)), want[name], rtol=0, atol=atol, err_msg=name)
    if not topk:
        assert got.topk_indices is None and got.topk_weights is None
        return
    idx, top = np.asarray(got.topk_indices), np.asarray(got.topk_weights)
    assert idx.dtype == np.int64 and idx.shape == w.shape[:-1] + (topk,)
    allowed = (w > 0).sum(-1)  # random inputs: no allowed weight underflows to 0
    np.testing.assert_array_equal((idx >= 0).sum(-1), np.minimum(allowed, topk))  # -1 only past the allowed keys
    picked = np.take_along_axis(w, np.maximum(idx, 0), -1) * (idx >= 0)
    np.testing.assert_allclose(top, picked, atol=atol)  # each weight belongs to its index
    np.testing.assert_allclose(top, want["topk_weights"], atol=atol)  # and they are the largest, in order
    real = np.where(idx >= 0, idx, -np.arange(1, topk + 1))  # distinct keys in each row
    assert (np.diff(np.sort(real, -1), axis=-1) != 0).all()


def _rng_bool(rng, shape, p):
    return rng.random(shape) < p


def mask_cases(rng, Lq=LQ, Lk=LK):
    """(name, mask) for every kind of the mask language, at these sizes."""
    ids_q = np.sort(rng.integers(0, 3, (B, Lq)), axis=1)
    ids_k = np.sort(rng.integers(0, 3, (B, Lk)), axis=1)
    dense = _rng_bool(rng, (B, HQ, Lq, Lk), 0.6)
    dense[0, 1, :5] = False  # rows with no allowed key
    return [
        ("none", None),
        ("causal", qkv.causal()),
        ("causal_top_left", qkv.causal(align="top_left")),
        ("window", qkv.window(left=5, right=2)),
        ("padding_empty_rows", qkv.padding([Lk, 11], q_lengths=[Lq - 3, 0])),
        ("document", qkv.document(ids_q, ids_k)),
        ("document_unsorted", qkv.document(rng.integers(0, 3, (B, Lq)), rng.integers(0, 3, (B, Lk)))),
        ("prefix_lm", qkv.prefix_lm([4, Lk // 2])),
        ("mask_fn", qkv.mask_fn(lambda b, h, qi, ki: (qi + ki + h) % 3 != 0)),
        ("dense", qkv.dense_mask(dense)),
        ("bool_array", _rng_bool(rng, (Lq, Lk), 0.5)),
        ("combined", qkv.causal() & qkv.window(left=7) | qkv.prefix_lm([2, 3])),
    ]


MASK_NAMES = [name for name, _ in mask_cases(np.random.default_rng(0))]


@pytest.fixture(params=["small tiles", "default tiles"])
def tiles(request, monkeypatch):
    """Small tiles make every mask produce EMPTY, PARTIAL and FULL tiles; default ones one tile."""
    if request.param == "small tiles":
        monkeypatch.setattr(stats_module, "available_cpus", lambda: 3)  # NumPy's tiles split among 3 workers
        monkeypatch.setattr(stats_module, "TILE_ELEMENTS", B * HQ * 8 * 16)
        monkeypatch.setattr(stats_module, "MAX_BLOCK_K", 16)
        monkeypatch.setattr(stats_module, "MIN_BLOCK_Q", 1)
    return request.param


def qk64(rng, Lq=LQ, Lk=LK, hq=HQ, hkv=HKV):
    return rng.standard_normal((B, hq, Lq, D)), rng.standard_normal((B, hkv, Lk, D))


@pytest.mark.parametrize("mask_name", MASK_NAMES)
def test_every_mask_kind_matches_the_explicit_weights(mask_name, tiles):
    rng = np.random.default_rng(7)
    q, k = qk64(rng)  # 4 query heads share 2 kv heads
    mask = dict(mask_cases(rng))[mask_name]
    got = attention_stats(q, k, mask, 5)  # topk is the fourth positional argument (DESIGN.md's signature)
    w = qkv.attention_weights(q, k, mask)  # (B, HQ, LQ, LK)
    check_against_weights(got, w, topk=5)
    assert got.entropy.shape == got.max_weight.shape == got.lse.shape == (B, HQ, LQ)
    assert got.received.shape == (B, HQ, LK)


@pytest.mark.parametrize("Lq,Lk", [(53, 37), (1, 40), (40, 1), (130, 130)])
@pytest.mark.parametrize("align", ["bottom_right", "top_left"])
def test_causal_alignments_and_odd_sizes(Lq, Lk, align, tiles):
    rng = np.random.default_rng(Lq * 1000 + Lk)
    q, k = qk64(rng, Lq, Lk)
    mask = qkv.causal(align=align)
    check_against_weights(attention_stats(q, k, mask, topk=1), qkv.attention_weights(q, k, mask), topk=1)


@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 1), (6, 2)])
def test_grouped_query_heads(hq, hkv, tiles):
    rng = np.random.default_rng(hq * 10 + hkv)
    q, k = qk64(rng, hq=hq, hkv=hkv)
    check_against_weights(attention_stats(q, k, qkv.causal(), topk=3), qkv.attention_weights(q, k, qkv.causal()),
                          topk=3)


def test_score_modifiers_scale_and_bias(tiles):
    rng = np.random.default_rng(3)
    q, k = qk64(rng)
    bias = rng.standard_normal((LQ, LK))
    bias[:, ::4] = -np.inf  # a float mask may hide keys too
    for kwargs in ({"score_mod": qkv.alibi(np.linspace(0.1, 1, HQ))},
                   {"score_mod": [qkv.softcap(2.0), qkv.score_fn(lambda s, b, h, qi, ki: s * 0.5 + (qi == ki))]},
                   {"mask": bias, "scale": 0.3}):
        got = attention_stats(q, k, topk=2, **kwargs)
        check_against_weights(got, qkv.attention_weights(q, k, **kwargs), topk=2)


def test_leading_dims_and_two_dim_inputs():
    rng = np.random.default_rng(5)
    q, k = rng.standard_normal((2, 3, 4, 9, 8)), rng.standard_normal((2, 3, 2, 11, 8))
    got = attention_stats(q, k, topk=2)
    assert got.entropy.shape == (2, 3, 4, 9) and got.received.shape == (2, 3, 4, 11)
    assert got.topk_indices.shape == (2, 3, 4, 9, 2)
    check_against_weights(got, qkv.attention_weights(q, k), topk=2)
    q2, k2 = rng.standard_normal((9, 8)), rng.standard_normal((11, 8))  # one head
    got2 = attention_stats(q2, k2)
    assert got2.entropy.shape == (9,) and got2.received.shape == (11,)
    check_against_weights(got2, qkv.attention_weights(q2, k2))


def test_what_the_statistics_mean():
    rng = np.random.default_rng(11)
    q, k = qk64(rng)
    mask = qkv.padding([LK, 20], q_lengths=[LQ, 30])
    got = attention_stats(q, k, mask)
    allowed = mask.materialize(LQ, LK, batch=B, heads=HQ).sum(-1)  # (B, HQ, LQ) keys each row may see
    assert (got.entropy >= -1e-12).all() and (got.entropy <= np.log(np.maximum(allowed, 1)) + 1e-12).all()
    assert (got.max_weight[allowed > 0] >= 1 / allowed[allowed > 0] - 1e-12).all() and (got.max_weight <= 1).all()
    np.testing.assert_allclose(got.received.sum(-1), (allowed > 0).sum(-1), rtol=1e-12)  # rows sum to 1
    empty = allowed == 0
    assert (got.entropy[empty] == 0).all() and (got.max_weight[empty] == 0).all() and np.isneginf(got.lse[empty]).all()
    uniform = attention_stats(np.zeros((1, 1, 3, 4)), rng.standard_normal((1, 1, 8, 4)))
    np.testing.assert_allclose(uniform.entropy, np.log(8), rtol=1e-14)  # even spread over 8 keys


def test_public_names():
    assert qkv.attention_stats is attention_stats
    assert "attention_stats" in qkv.__all__


def test_lse_is_the_log_sum_exp_of_the_allowed_scores():
    """Against the definition in float64: log of the sum of exp(scale * q·k) over allowed keys."""
    rng = np.random.default_rng(2)
    q, k = qk64(rng)
    mask = qkv.causal() & qkv.padding([LK, 30], q_lengths=[LQ, 20])  # rows 20.. of batch row 1 see no key: -inf
    scores = q @ np.repeat(k, HQ // HKV, axis=1).swapaxes(-1, -2) / np.sqrt(D)  # (B, Hq, Lq, Lk)
    allowed = mask.materialize(LQ, LK, batch=B, heads=HQ)
    with np.errstate(divide="ignore"):
        want = np.log(np.where(allowed, np.exp(scores), 0.0).sum(-1))
    np.testing.assert_allclose(attention_stats(q, k, mask).lse, want, rtol=0, atol=1e-12)


def test_nan_in_an_allowed_input_propagates():
    rng = np.random.default_rng(4)
    q, k = qk64(rng)
    q[0, 0, 3, 0] = np.nan
    got = attention_stats(q, k)
    assert np.isnan(got.entropy[0, 0, 3]) and np.isfinite(np.delete(got.entropy[0, 0], 3)).all()


@pytest.mark.skipif(torch is None, reason="needs torch")
def test_nan_weights_lead_the_top_k_on_numpy_as_on_torch():
    """NumPy's sorts put NaN last, torch's first: a NaN row's top weights are NaN on both
    (not -1 indices and 0 weights, which would read as a row with nothing allowed)."""
    rng = np.random.default_rng(4)
    q, k = qk64(rng)
    q[0, 0, 3, 0] = np.nan
    got, on_torch = attention_stats(q, k, topk=2), attention_stats(torch.from_numpy(q), torch.from_numpy(k), topk=2)
    for weights in (got.topk_weights, on_torch.topk_weights.numpy()):
        assert np.isnan(weights[0, 0, 3]).all() and not np.isnan(np.delete(weights[0, 0], 3, axis=0)).any()
    assert (got.topk_indices[0, 0, 3] >= 0).all()
    np.testing.assert_array_equal(np.delete(got.topk_indices[0, 0], 3, axis=0),
                                  np.delete(on_torch.topk_indices[0, 0].numpy(), 3, axis=0))


@pytest.mark.skipif(torch is None, reason="needs torch")
@pytest.mark.parametrize("dtype", ["float32", "float64", "bfloat16"])
def test_torch_in_torch_out(dtype):
    rng = np.random.default_rng(9)
    q64, k64 = qk64(rng)
    tdtype = getattr(torch, dtype)
    q, k = (torch.tensor(x, dtype=tdtype, requires_grad=True) for x in (q64, k64))
    mask = qkv.causal() & qkv.padding([LK, 30])
    got = attention_stats(q, k, mask, topk=4)
    work = torch.float64 if dtype == "float64" else torch.float32
    assert isinstance(got.entropy, torch.Tensor) and got.entropy.dtype == work and not got.entropy.requires_grad
    assert got.topk_indices.dtype == torch.int64
    as64 = lambda x: x.detach().double().numpy()  # noqa: E731 - the same rounded inputs, in float64
    w = qkv.attention_weights(as64(q), as64(k), mask)
    atol = 1e-12 if dtype == "float64" else 2e-5
    want = statistics_of(w, 4)
    for name in ("entropy", "max_weight", "received"):
        np.testing.assert_allclose(getattr(got, name).numpy(), want[name], atol=atol * 10, err_msg=name)
    np.testing.assert_allclose(got.topk_weights.numpy(), want["topk_weights"], atol=atol)


def check_float32_rule(got, want, formula, names=("entropy", "max_weight", "received", "topk_weights"),
                       relative=True):
    """Each statistic of `got` within the tolerance rule: twice the float32 formula's error
    (`formula`, from float32 weights) from float64's (`want`), plus float32's atol (times the
    statistic's size with `relative`)."""
    from qkv.backends.base import ATOL

    for name in names:
        err = np.abs(np.asarray(getattr(got, name), dtype=np.float64) - want[name]).max()
        size = max(1.0, np.abs(want[name]).max()) if relative else 1.0
        bound = 2 * np.abs(formula[name] - want[name]).max() + ATOL["float32"] * size
        assert err <= bound, f"{name}: {err:.2e} > {bound:.2e}"


@pytest.mark.parametrize("kind", ["numpy", "torch"])
@pytest.mark.parametrize("Lk", [5000, 32768, 131072])
def test_near_uniform_rows_of_many_keys_follow_the_rule(kind, Lk):
    """Many key tiles: their parts of the entropy were summed in float32, the renormalisation
    too, and a correction below an ulp of |log w| was lost in float32 logs, the same way for
    every key of the row: the entropy of 5000 equal weights was off by 2.5e-6, of 131072 by
    3.4e-5, where the plain formula's was 3.5e-7 and 1.5e-6. Held to atol itself, unscaled."""
    if kind == "torch" and torch is None:
        pytest.skip("needs torch")
    rng = np.random.default_rng(Lk)
    q32 = rng.standard_normal((1, 4, 8)).astype(np.float32)
    k32 = np.concatenate([np.zeros((1, Lk // 2, 8)), 0.1 * rng.standard_normal((1, Lk - Lk // 2, 8))], 1)
    k32 = k32.astype(np.float32)  # equal scores on the first half of the keys, nearly so on the rest
    w64 = qkv.attention_weights(q32.astype(np.float64), k32.astype(np.float64))
    w32 = qkv.attention_weights(q32, k32).astype(np.float64)
    q, k = (q32, k32) if kind == "numpy" else (torch.from_numpy(q32), torch.from_numpy(k32))
    got = attention_stats(q, k)
    check_float32_rule(got, statistics_of(w64), statistics_of(w32), ("entropy", "max_weight"), relative=False)


def test_statistics_read_a_bias_that_requires_grad_as_a_constant():
    """They compute no gradient: a float mask that requires grad is read as it is under
    no_grad (it was refused as if gradients were asked of it)."""
    if torch is None:
        pytest.skip("needs torch")
    q, k = torch.randn(1, 2, 9, 8, dtype=torch.float64), torch.randn(1, 2, 11, 8, dtype=torch.float64)
    bias = torch.randn(9, 11, dtype=torch.float64, requires_grad=True)
    got = attention_stats(q, k, bias)
    check_against_weights(got, qkv.attention_weights(q, k, bias.detach()).numpy())
    assert not got.entropy.requires_grad


def test_float64_statistics_at_huge_scores_follow_the_rule():
    """float64 skipped the renormalisation as exact enough: at scores of std 2000 the weights
    rebuilt from the backend's lse were off by 7e-12 where the formula's are by 8e-13."""
    if torch is None:
        pytest.skip("needs torch")
    rng = np.random.default_rng(3)
    q, k = rng.standard_normal((1, 4, 300, 64)) * 60, rng.standard_normal((1, 4, 500, 64)) * 60
    wide = lambda x: np.asarray(x, np.longdouble)  # noqa: E731
    s = wide(q) @ wide(k).swapaxes(-1, -2) / 8
    w = np.exp(s - s.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    formula = np.abs(qkv.attention_weights(q, k).max(-1) - w.max(-1)).max()
    got = attention_stats(torch.from_numpy(q), torch.from_numpy(k)).max_weight.numpy()
    assert np.abs(got - w.max(-1)).max() <= 2 * formula + 1e-12


@pytest.mark.parametrize("kind", ["numpy", "torch"])
@pytest.mark.parametrize("std", [6, 30])
def test_float32_statistics_at_large_scores_follow_the_rule(kind, std):
    """The weights are renormalised against the scores computed here: with the kernel's lse
    alone they summed to 1 only up to |lse|·1e-7: at q and k of std 6 (scores of std 36) the
    entropy was off by 1.5e-5 (bound 8.7e-6), at std 30 by 2.4e-4 (bound 1.6e-5)."""
    if kind == "torch" and torch is None:
        pytest.skip("needs torch")
    rng = np.random.default_rng(11)
    q32, k32 = ((x * std).astype(np.float32) for x in qk64(rng))
    mask = qkv.causal(align="top_left")
    w64 = qkv.attention_weights(q32.astype(np.float64), k32.astype(np.float64), mask)
    w32 = qkv.attention_weights(q32, k32, mask).astype(np.float64)
    want, formula = statistics_of(w64, 3), statistics_of(w32, 3)
    q, k = (q32, k32) if kind == "numpy" else (torch.from_numpy(q32), torch.from_numpy(k32))
    got = attention_stats(q, k, mask, topk=3)
    check_float32_rule(got, want, formula)


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_float32_statistics_with_an_inexact_scale_follow_the_rule(kind):
    """The scale multiplies the finished q·kᵀ, as in the formula. Integer q and k make q·kᵀ
    exact; folded into q first (q·(-0.45) rounded per element), the entropy was off by
    2.9e-5 where the rule allows 1.8e-5, on NumPy and torch inputs alike."""
    if kind == "torch" and torch is None:
        pytest.skip("needs torch")
    rng = np.random.default_rng(2)
    q32, k32 = (rng.integers(-20, 21, s).astype(np.float32) for s in ((1, 4, 40, 16), (1, 2, 300, 16)))
    w64 = qkv.attention_weights(q32.astype(np.float64), k32.astype(np.float64), scale=-0.45)
    w32 = qkv.attention_weights(q32, k32, scale=-0.45).astype(np.float64)
    want, formula = statistics_of(w64, 2), statistics_of(w32, 2)
    q, k = (q32, k32) if kind == "numpy" else (torch.from_numpy(q32), torch.from_numpy(k32))
    got = attention_stats(q, k, scale=-0.45, topk=2)
    check_float32_rule(got, want, formula)


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_equal_weights_rank_the_lower_keys_first(kind, tiles):
    """q = 0 gives every allowed key of a row the same weight: the top-k are the first allowed
    keys, as a stable sort of the explicit weights ranks them (they used to be any of them,
    and NumPy and torch picked different ones)."""
    if kind == "torch" and torch is None:
        pytest.skip("needs torch")
    rng = np.random.default_rng(13)
    q, k = np.zeros((B, HQ, LQ, D), np.float32), rng.standard_normal((B, HKV, LK, D)).astype(np.float32)
    mask = qkv.window(left=9, right=3) & qkv.padding([LK, 30])
    w = qkv.attention_weights(q.astype(np.float64), k.astype(np.float64), mask)
    first = np.argsort(-w, axis=-1, kind="stable")[..., :6]
    want = np.where(np.take_along_axis(w, first, -1) > 0, first, -1)
    args = (q, k) if kind == "numpy" else (torch.from_numpy(q), torch.from_numpy(k))
    got = attention_stats(*args, mask, topk=6)
    np.testing.assert_array_equal(np.asarray(got.topk_indices), want)


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_huge_scores_give_one_hot_rows_not_nan(kind):
    """At scale 1e9 the scores computed here and the kernel's differ by more than exp takes:
    the renormalisation shifts by each row's largest before it sums (unshifted, its sum
    overflowed and rows with allowed keys came out with entropy NaN and max_weight 0)."""
    if kind == "torch" and torch is None:
        pytest.skip("needs torch")
    rng = np.random.default_rng(3)
    q, k = (rng.standard_normal(shape).astype(np.float32) for shape in ((2, 4, 64, 16), (2, 4, 80, 16)))
    w = qkv.attention_weights(q.astype(np.float64), k.astype(np.float64), scale=1e9)
    args = (q, k) if kind == "numpy" else (torch.from_numpy(q), torch.from_numpy(k))
    got = attention_stats(*args, scale=1e9, topk=1)
    check_against_weights(got, w, topk=1, atol=1e-6)


def test_statistics_do_not_depend_on_how_the_lse_was_rounded(monkeypatch):
    """An lse rounded otherwise than the scores computed here (a kernel's other summation
    order, float32 products on AMX) is renormalised away: moved by 1e-3, the statistics stay
    where they were."""
    rng = np.random.default_rng(12)
    q, k = (x.astype(np.float32) for x in qk64(rng))
    exact = attention_stats(q, k, qkv.causal(), topk=2)
    row_lse = stats_module._row_lse
    monkeypatch.setattr(stats_module, "_row_lse", lambda *args: row_lse(*args) + np.float32(1e-3))
    moved = attention_stats(q, k, qkv.causal(), topk=2)
    np.testing.assert_allclose(moved.lse, exact.lse + np.float32(1e-3), rtol=1e-6)  # the lse returned as given
    for name in ("entropy", "max_weight", "received", "topk_weights"):
        np.testing.assert_allclose(getattr(moved, name), getattr(exact, name), rtol=0, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_numpy_low_precision_works_in_float32(dtype):
    rng = np.random.default_rng(6)
    q, k = (x.astype(dtype) for x in qk64(rng))
    got = attention_stats(q, k, qkv.window(left=8), topk=2)
    assert got.entropy.dtype == np.float32 and got.received.dtype == np.float32
    w = qkv.attention_weights(q.astype(np.float64), k.astype(np.float64), qkv.window(left=8))
    want = statistics_of(w, 2)
    for name in ("entropy", "max_weight", "received"):
        np.testing.assert_allclose(getattr(got, name), want[name], atol=1e-4, err_msg=name)


def test_bad_arguments_say_what_is_wrong():
    rng = np.random.default_rng(0)
    q, k = qk64(rng)
    with pytest.raises(ValueError, match="topk"):
        attention_stats(q, k, topk=-1)
    with pytest.raises(ValueError, match=r"topk \(54\) must be at most the number of keys Lk \(53\)"):
        attention_stats(q, k, topk=LK + 1)
    with pytest.raises(ValueError, match="topk"):
        attention_stats(q, k, topk=1.5)
    with pytest.raises(TypeError, match="k must be a numpy.ndarray or torch.Tensor"):
        attention_stats(q, k.tolist())
    with pytest.raises(ValueError, match="multiple of k's heads"):
        attention_stats(q, k[:, :1].repeat(3, axis=1))
    with pytest.raises(ValueError, match="kv_lengths"):
        attention_stats(q, k, qkv.padding([1, 2, 3]))


# --------------------------------------------------------------------------------------
# attention_weights(..., rows=...)
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("rows", [0, 36, -1, slice(3, 30, 4), [0, 36, 7, 7], np.array([30, 31, -2]), []])
@pytest.mark.parametrize("mask_name", ["none", "causal", "padding_empty_rows", "mask_fn", "dense"])
def test_rows_equal_those_of_the_full_matrix(rows, mask_name):
    rng = np.random.default_rng(8)
    q, k = qk64(rng)
    mask = dict(mask_cases(rng))[mask_name]
    full = qkv.attention_weights(q, k, mask)  # (B, HQ, LQ, LK)
    got = qkv.attention_weights(q, k, mask, rows=rows)
    want = full[..., rows, :]
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-15)


@pytest.mark.skipif(torch is None, reason="needs torch")
def test_rows_of_a_reversed_slice_on_torch_tensors():
    q, k = (torch.from_numpy(x) for x in qk64(np.random.default_rng(2)))
    want = qkv.attention_weights(q, k, qkv.causal())[..., torch.arange(q.shape[-2] - 1, -1, -2), :]
    torch.testing.assert_close(qkv.attention_weights(q, k, qkv.causal(), rows=slice(None, None, -2)), want,
                               rtol=0, atol=1e-15)


@pytest.mark.skipif(torch is None, reason="needs torch")
def test_rows_keep_torch_autograd():
    rng = np.random.default_rng(1)
    q64, k64 = qk64(rng)
    q, k = (torch.tensor(x, requires_grad=True) for x in (q64, k64))
    rows = torch.tensor([5, 20])
    picked = qkv.attention_weights(q, k, qkv.causal(), rows=rows)  # (B, HQ, 2, LK)
    (picked[..., 3] * 2).sum().backward()
    q2, k2 = (torch.tensor(x, requires_grad=True) for x in (q64, k64))
    (qkv.attention_weights(q2, k2, qkv.causal())[..., [5, 20], 3] * 2).sum().backward()
    torch.testing.assert_close(q.grad, q2.grad)
    torch.testing.assert_close(k.grad, k2.grad)


def test_rows_of_a_long_sequence_without_the_full_matrix():
    rng = np.random.default_rng(12)
    L = 20000  # the full float32 matrix would be 1.6 GB
    q, k = (rng.standard_normal((1, L, 32), dtype=np.float32) for _ in range(2))
    got = qkv.attention_weights(q, k, qkv.causal(), rows=[0, L // 2, L - 1])  # (1, 3, L)
    assert got.shape == (1, 3, L) and got.dtype == np.float32
    np.testing.assert_allclose(got.sum(-1), 1, rtol=1e-5)
    assert got[0, 0, 0] == 1 and (got[0, 0, 1:] == 0).all() and (got[0, 1, L // 2 + 1:] == 0).all()
    _, lse = qkv.attention(q[:, -1:], k, k, return_lse=True)  # the last row's softmax, another way
    np.testing.assert_allclose(got[0, 2], np.exp(q[0, -1] @ k[0].T / np.sqrt(32) - lse[0, 0]), rtol=2e-4, atol=1e-9)


def test_rows_that_do_not_fit_are_errors():
    rng = np.random.default_rng(0)
    q, k = qk64(rng)
    with pytest.raises(ValueError, match=r"rows must be query positions in \[-Lq, Lq\) = \[-37, 37\), got \[37\]"):
        qkv.attention_weights(q, k, rows=[37])
    with pytest.raises(ValueError, match="rows must be query positions"):
        qkv.attention_weights(q, k, rows=-38)
    for bad in ([[1, 2]], 1.5, [0.5], np.array([True, False]), "3"):
        with pytest.raises(TypeError, match="rows must be an int, a slice or a 1-D sequence of ints"):
            qkv.attention_weights(q, k, rows=bad)


# --------------------------------------------------------------------------------------
# O(N) memory
# --------------------------------------------------------------------------------------
LIMIT = 64 * 2**20

SCRIPT = textwrap.dedent("""
    import json, sys
    import numpy as np
    from qkv.stats import attention_stats

    def status(key):  # bytes, from /proc/self/status
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))

    L = int(sys.argv[1])
    rng = np.random.default_rng(0)
    q, k = (rng.standard_normal((1, L, 64), dtype=np.float32) for _ in range(2))
    attention_stats(q[:, :300], k[:, :300], topk=2)  # warm up libraries, thread pools and allocators
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak (VmHWM) to the memory in use now
    before = status("VmRSS")
    s = attention_stats(q, k)
    grown = status("VmHWM") - before
    print(json.dumps({"grown": grown, "received": float(s.received.sum(dtype=np.float64)),
                      "entropy_max": float(s.entropy.max()), "finite": bool(np.isfinite(s.entropy).all())}))
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the peak memory from /proc (Linux)")
def test_65536_tokens_stay_under_64_mib():
    L = 65536  # one head; its float32 weights would take 16 GiB
    report = run_measured(SCRIPT, str(L), timeout=900)
    assert report["finite"] and report["entropy_max"] <= np.log(L)
    assert abs(report["received"] - L) < 1e-3 * L  # every row's weights sum to 1
    assert report["grown"] < LIMIT, f"peak memory grew by {report['grown'] / 2**20:.1f} MiB"


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_rows_with_fewer_allowed_keys_than_topk_end_in_minus_one(kind):
    """Under a causal mask row i has i + 1 keys: the rest of its top-k is index -1, weight 0."""
    rng = np.random.default_rng(11)
    q, k = qk64(rng, 700, 700)
    if kind == "torch":
        torch = pytest.importorskip("torch")
        q, k = torch.from_numpy(q), torch.from_numpy(k)
    got = attention_stats(q, k, qkv.causal(), topk=4)
    first_row = (Ellipsis, 0, slice(None))  # (B, Hq, topk)
    np.testing.assert_array_equal(np.asarray(got.topk_indices)[first_row], np.broadcast_to([0, -1, -1, -1], (B, HQ, 4)))
    np.testing.assert_array_equal(np.asarray(got.topk_weights)[first_row], np.broadcast_to([1., 0, 0, 0], (B, HQ, 4)))
    check_against_weights(got, np.asarray(qkv.attention_weights(q, k, qkv.causal())), topk=4)
