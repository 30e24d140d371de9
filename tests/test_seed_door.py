"""The seed's function, qkv.scaled_dot_product_attention: its results against the original
function written out literally in float64, for its example, its masks and both array kinds."""
import numpy as np
import pytest

import qkv
from helpers import assert_within_rule
from mha_reference import seed_sdpa

torch = pytest.importorskip("torch")
BATCH, LQ, LK, D, DV = 2, 10, 12, 64, 48


def _inputs(rng):
    return [rng.standard_normal(shape) for shape in ((BATCH, LQ, D), (BATCH, LK, D), (BATCH, LK, DV))]


def _masks(rng):
    """The seed's masks: mask == 0 is masked, in any dtype, broadcastable to (batch, seq_q, seq_k)."""
    padding = np.ones((BATCH, 1, LK), dtype=np.int64)
    padding[1, :, 9:] = 0  # the second sequence has 9 keys
    causal = np.tril(np.ones((LQ, LK)), k=LK - LQ)  # a float 0/1 mask: a mask, not a bias
    return {"none": None, "padding": padding, "causal": causal, "bool": rng.random((BATCH, LQ, LK)) < 0.7}


@pytest.mark.parametrize("mask_name", ["none", "padding", "causal", "bool"])
@pytest.mark.parametrize("kind", ["torch", "numpy"])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_results_match_the_original_function(rng, mask_name, kind, dtype):
    arrays = _inputs(rng)
    mask = _masks(rng)[mask_name]
    literal = lambda dt: seed_sdpa(*(torch.from_numpy(x).to(dt) for x in arrays),  # noqa: E731
                                   None if mask is None else torch.from_numpy(np.asarray(mask)))
    oracle, in_dtype = literal(torch.float64), literal(getattr(torch, dtype))
    inputs = [x.astype(dtype) for x in arrays]
    if kind == "torch":
        inputs = [torch.from_numpy(x) for x in inputs]
        mask = None if mask is None else torch.from_numpy(np.asarray(mask))
    out, weights = qkv.scaled_dot_product_attention(*inputs, mask)
    assert isinstance(out, type(inputs[0])) and str(out.dtype).endswith(dtype)
    assert tuple(out.shape) == (BATCH, LQ, DV) and tuple(weights.shape) == (BATCH, LQ, LK)
    for got, want, ref, what in zip((out, weights), oracle, in_dtype, ("output", "weights")):
        assert_within_rule(np.asarray(got), want.numpy(), ref.double().numpy(), dtype, what)


def test_the_worked_example(rng):
    """Batch 2, seq 10, d_model 64: output (2, 10, 64), weights (2, 10, 10) whose rows sum to 1."""
    q, k, v = (torch.from_numpy(rng.standard_normal((2, 10, 64))) for _ in range(3))
    out, weights = qkv.scaled_dot_product_attention(q, k, v)
    want_out, want_weights = seed_sdpa(q, k, v)
    np.testing.assert_allclose(out.numpy(), want_out.numpy(), rtol=0, atol=1e-12)
    np.testing.assert_allclose(weights.numpy(), want_weights.numpy(), rtol=0, atol=1e-12)
    np.testing.assert_allclose(weights.sum(-1).numpy(), 1.0, atol=1e-12)


def test_a_row_with_every_key_masked_gives_zeros_not_nan(rng):
    """Where the original gives NaN (softmax of all -inf), the door gives 0, and other rows are unchanged."""
    q, k, v = (torch.from_numpy(x) for x in _inputs(rng))
    mask = torch.ones(BATCH, LQ, LK)
    mask[0, 3] = 0
    out, weights = qkv.scaled_dot_product_attention(q, k, v, mask)
    want_out, want_weights = seed_sdpa(q, k, v, mask)
    assert torch.isnan(want_out[0, 3]).all()  # the original's answer for that row
    assert (out[0, 3] == 0).all() and (weights[0, 3] == 0).all()
    keep = torch.ones(BATCH, LQ, dtype=torch.bool)
    keep[0, 3] = False
    np.testing.assert_allclose(out[keep].numpy(), want_out[keep].numpy(), rtol=0, atol=1e-12)
    np.testing.assert_allclose(weights[keep].numpy(), want_weights[keep].numpy(), rtol=0, atol=1e-12)
