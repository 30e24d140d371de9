"""Dropout: the right keep rate and scaling, reproducible seeds, the same drops on every backend."""
import numpy as np
import pytest

import qkv
from helpers import convert, to64
from qkv.backends.base import dropout_keep
from qkv.masks import tile_indices

torch = pytest.importorskip("torch")

L, P = 256, 0.3


def keep_pattern(backend, kind, p=P, seed=11):
    """With uniform weights (q = 0) and v = identity, out[i, j] = keep[i, j] / ((1 - p) * L)."""
    q = convert(np.zeros((1, 1, L, 4)), kind, "float64")
    k = convert(np.ones((1, 1, L, 4)), kind, "float64")
    v = convert(np.eye(L)[None, None], kind, "float64")
    out = to64(qkv.attention(q, k, v, dropout_p=p, seed=seed, backend=backend))[0, 0]
    return out * (1 - p) * L


@pytest.mark.parametrize("backend,kind", [("torch", "torch"), ("numpy", "numpy"), ("reference", "numpy")])
def test_keep_rate_and_scaling(backend, kind):
    keep = keep_pattern(backend, kind)
    np.testing.assert_allclose(keep[(keep > 0.5)], 1.0, atol=1e-12)  # kept entries scaled by 1/(1-p)
    assert np.isin(np.round(keep, 9), [0.0, 1.0]).all()
    rate = keep.mean()
    sigma = np.sqrt(P * (1 - P) / keep.size)
    assert abs(rate - (1 - P)) < 5 * sigma, f"keep rate {rate:.4f}, expected {1 - P} ± {5 * sigma:.4f}"


def test_the_keep_rate_holds_up_to_the_largest_p():
    """Keep decisions are drawn in steps of 2**-32: at the largest p accepted, 1 - 2**-13, the
    rate is still 1 - p (a step of 2**-24 used to keep nothing at all past 1 - 2**-25)."""
    import qkv.torch
    from qkv.inputs import DROPOUT_P_MAX

    b, h, qi, ki = np.arange(64)[:, None, None, None], 0, np.arange(256)[:, None], np.arange(256)
    for p in (DROPOUT_P_MAX, 1 - 2**-10):
        keep = dropout_keep(7, p, 1, b, h, qi, ki)
        expected = keep.size * (1 - p)
        assert abs(keep.sum() - expected) < 5 * np.sqrt(expected), (p, keep.sum(), expected)
    with pytest.raises(ValueError, match=r"dropout must be at most 1 - 2\*\*-13"):
        qkv.torch.MultiHeadAttention(8, 2, dropout=1 - 2**-20)


def test_same_seed_same_drops_on_every_backend():
    patterns = [keep_pattern(b, k) for b, k in [("torch", "torch"), ("numpy", "numpy"), ("reference", "numpy")]]
    for other in patterns[1:]:
        np.testing.assert_array_equal(np.round(other), np.round(patterns[0]))
    assert not np.array_equal(np.round(keep_pattern("torch", "torch", seed=12)), np.round(patterns[0]))


@pytest.mark.parametrize("backend,kind", [("torch", "torch"), ("numpy", "numpy"), ("reference", "numpy")])
def test_every_bit_of_a_64_bit_seed_counts_and_numpy_integers_are_seeds(backend, kind):
    base = keep_pattern(backend, kind, seed=1)
    for other in (2**32 + 1, 2**63 + 1):  # same low word, other high words
        assert not np.array_equal(np.round(keep_pattern(backend, kind, seed=other)), np.round(base))
    for seed in (np.int32(1), np.uint64(1)):
        np.testing.assert_array_equal(np.round(keep_pattern(backend, kind, seed=seed)), np.round(base))
    np.testing.assert_array_equal(np.round(keep_pattern(backend, kind, seed=2**63 + 1)),
                                  np.round(keep_pattern("reference", "numpy", seed=2**63 + 1)))


def test_no_seed_follows_torch_manual_seed():
    q = k = v = torch.randn(1, 1, 16, 8)
    torch.manual_seed(0)
    a = qkv.attention(q, k, v, dropout_p=0.5)
    torch.manual_seed(0)
    b = qkv.attention(q, k, v, dropout_p=0.5)
    c = qkv.attention(q, k, v, dropout_p=0.5)
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_dropout_is_unbiased_on_average():
    rng = np.random.default_rng(0)
    q, k, v = (torch.tensor(rng.standard_normal((1, 2, 8, 4))) for _ in range(3))
    mean = sum(qkv.attention(q, k, v, dropout_p=0.5, seed=s) for s in range(2000)) / 2000
    np.testing.assert_allclose(mean.numpy(), qkv.attention(q, k, v).numpy(), atol=0.06)


def test_the_keep_mask_compiles_for_any_seed():
    """torch.compile (inductor) traces the seed as a symbol; its C++ code once shifted the
    seed's words as floats and did not build. Once compiled, every seed keeps the same entries."""
    b, h, qi, ki = tile_indices(torch.zeros(0), [0], [0, 1], 0, 8, 0, 8)
    keep = torch.compile(lambda qi, seed: dropout_keep(seed, 0.5, 2, b, h, qi, ki), dynamic=True)
    for seed in (1, 2**40 + 5):  # one word, then two
        assert torch.equal(keep(qi, seed), dropout_keep(seed, 0.5, 2, b, h, qi, ki)), seed
