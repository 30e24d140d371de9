"""Properties that hold for any input (hypothesis), on every backend."""
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import qkv
from helpers import REORDER_ATOL, convert, kind_of_backend, precise_dtype, to64, use_small_tiles

sizes = st.integers(1, 40)


@st.composite
def problems(draw):
    B, hkv, group = draw(st.integers(1, 2)), draw(st.integers(1, 2)), draw(st.sampled_from([1, 2]))
    Lq, Lk, D, Dv = draw(sizes), draw(sizes), draw(st.integers(1, 16)), draw(st.integers(1, 16))
    seed = draw(st.integers(0, 2**31))
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, hkv * group, Lq, D))
    k = rng.standard_normal((B, hkv, Lk, D))
    v = rng.standard_normal((B, hkv, Lk, Dv))
    mask = draw(st.sampled_from([None, "causal", "window", "padding", "random"]))
    if mask == "causal":
        mask = qkv.causal(align=draw(st.sampled_from(["bottom_right", "top_left"])))
    elif mask == "window":
        mask = qkv.window(draw(st.integers(0, 5)), draw(st.integers(0, 5)))
    elif mask == "padding":
        mask = qkv.padding(rng.integers(0, Lk + 1, B))
    elif mask == "random":
        mask = qkv.dense_mask(rng.random((B, 1, Lq, Lk)) < 0.7)
    return q, k, v, mask, rng


@given(problems())
def test_rows_of_weights_sum_to_one_where_any_key_is_allowed(problem):
    q, k, v, mask, _ = problem
    group = q.shape[1] // k.shape[1]
    w = qkv.attention_weights(q, np.repeat(k, group, 1), mask)
    allowed = np.ones(w.shape, bool) if mask is None else mask.materialize(
        q.shape[2], k.shape[2], batch=q.shape[0], heads=q.shape[1])
    has_key = allowed.any(-1)
    np.testing.assert_allclose(w.sum(-1)[has_key], 1.0, atol=1e-12)
    assert (w.sum(-1)[~has_key] == 0).all()
    assert (w[~allowed] == 0).all() and (w >= 0).all()


@given(problem=problems())
def test_permuting_keys_and_values_together_changes_nothing(backend, problem):
    q, k, v, mask, rng = problem
    if mask is not None:  # permute the mask's key axis too: use its materialised form
        mask = mask.materialize(q.shape[2], k.shape[2], batch=q.shape[0], heads=q.shape[1])
    perm = rng.permutation(k.shape[2])
    kind, dtype = kind_of_backend(backend), precise_dtype(backend)
    as_kind = lambda x: convert(x, kind, dtype)  # noqa: E731
    as_mask = lambda m: None if m is None else (as_kind(m.astype(float)) > 0.5)  # noqa: E731
    out = qkv.attention(as_kind(q), as_kind(k), as_kind(v), as_mask(mask), backend=backend)
    permuted = qkv.attention(as_kind(q), as_kind(k[:, :, perm]), as_kind(v[:, :, perm]),
                             None if mask is None else as_mask(mask[..., perm]), backend=backend)
    np.testing.assert_allclose(to64(permuted), to64(out), atol=REORDER_ATOL[dtype])


@given(problem=problems())
def test_all_true_mask_equals_no_mask(backend, problem):
    q, k, v, _, _ = problem
    kind, dtype = kind_of_backend(backend), precise_dtype(backend)
    q, k, v = (convert(x, kind, dtype) for x in (q, k, v))
    no_mask = to64(qkv.attention(q, k, v, backend=backend))
    dense_true = convert(np.ones(q.shape[:-1] + (k.shape[-2],)), kind, dtype) > 0  # a boolean array, all True
    for all_true in (qkv.mask_fn(lambda b, h, i, j: (i >= 0) & (j >= 0)), dense_true):
        np.testing.assert_allclose(to64(qkv.attention(q, k, v, all_true, backend=backend)), no_mask,
                                   atol=REORDER_ATOL[dtype])


@given(problems())
def test_tiled_backends_agree_with_the_oracle(problem):
    """On tiles of 4 x 8, so that these sizes take many tiles each way (their own tiles would
    hold the whole problem)."""
    q, k, v, mask, _ = problem
    want = qkv.attention(q, k, v, mask, backend="reference")
    torch = pytest.importorskip("torch")
    with pytest.MonkeyPatch.context() as patch:
        use_small_tiles(patch, 4, 8)
        np.testing.assert_allclose(qkv.attention(q, k, v, mask, backend="numpy"), want, atol=1e-12)
        got = qkv.attention(*(torch.tensor(x) for x in (q, k, v)), mask, backend="torch")
    np.testing.assert_allclose(got.numpy(), want, atol=1e-12)
