"""The NumPy MultiHeadAttention: the seed's example and algorithm, the grown-up module
(GQA, biases, masks, weights), its state dict and its errors."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import qkv
from mha_reference import causal_allowed, reference_mha, seed_mha
from qkv.nn import MultiHeadAttention, parameter_shapes

TIGHT = dict(rtol=1e-10, atol=1e-12)


def randn(rng, *shape):
    return rng.standard_normal(shape)


# ---- the seed ------------------------------------------------------------------------------
def test_seed_example_shapes_and_algorithm():
    np.random.seed(0)
    mha = MultiHeadAttention(d_model=512, num_heads=8)
    Q, K, V = (np.random.randn(2, 10, 512) for _ in range(3))
    output, attention_weights = mha.call([Q, K, V])
    assert output.shape == (2, 10, 512) and attention_weights.shape == (2, 8, 10, 10)
    assert mha.depth == 64
    want_out, want_w = seed_mha(Q, K, V, mha.W_q, mha.W_k, mha.W_v, mha.W_o, 8)
    np.testing.assert_allclose(output, want_out, **TIGHT)
    np.testing.assert_allclose(attention_weights, want_w, **TIGHT)
    np.testing.assert_allclose(attention_weights.sum(-1), 1.0, rtol=0, atol=1e-12)


def test_seed_weights_are_drawn_like_the_original():
    np.random.seed(7)
    mha = MultiHeadAttention(64, 4)
    np.random.seed(7)
    for name in ("W_q", "W_k", "W_v", "W_o"):  # the original's order
        want = np.random.randn(64, 64) * np.sqrt(2 / 64)
        np.testing.assert_array_equal(getattr(mha, name), want)
        assert getattr(mha, name).dtype == np.float64
    assert not mha.bias and not hasattr(mha, "b_q")


@pytest.mark.parametrize("Lk", [17, 3, 1])
def test_seed_cross_attention_longer_and_shorter_keys(Lk):
    rng = np.random.default_rng(Lk)
    mha = MultiHeadAttention(48, 6, rng=rng)
    Q, K, V = randn(rng, 2, 10, 48), randn(rng, 2, Lk, 48), randn(rng, 2, Lk, 48)
    output, weights = mha.call([Q, K, V])
    assert output.shape == (2, 10, 48) and weights.shape == (2, 6, 10, Lk)
    want_out, want_w = seed_mha(Q, K, V, mha.W_q, mha.W_k, mha.W_v, mha.W_o, 6)
    np.testing.assert_allclose(output, want_out, **TIGHT)
    np.testing.assert_allclose(weights, want_w, **TIGHT)


def test_split_and_combine_heads():
    mha = MultiHeadAttention(12, 3, num_kv_heads=1, rng=0)
    x = np.arange(2 * 5 * 12, dtype=float).reshape(2, 5, 12)
    heads = mha.split_heads(x, 2)  # the seed's signature
    assert heads.shape == (2, 3, 5, 4)
    np.testing.assert_array_equal(heads[1, 2, 4], x[1, 4, 8:12])  # head h holds features h*depth...
    np.testing.assert_array_equal(mha.combine_heads(heads), x)
    assert mha.split_heads(x[..., :4], heads=1).shape == (2, 1, 5, 4)
    with pytest.raises(ValueError, match="batch_size"):
        mha.split_heads(x, 3)


@pytest.mark.parametrize("method,shape,match", [
    ("split_heads", (2, 5, 10), r"split_heads expects x of shape \(batch, length, 12\): 3 heads of depth 4 "
                                r"= d_model // num_heads \(d_model=12, num_heads=3\); got \(2, 5, 10\)"),
    ("split_heads", (5, 12), r"split_heads expects x of shape \(batch, length, 12\).*got \(5, 12\)"),
    ("combine_heads", (2, 5, 12), r"combine_heads expects x of shape \(batch, heads, length, depth=4\).*"
                                  r"got \(2, 5, 12\)"),
    ("combine_heads", (2, 3, 5, 3), r"combine_heads expects x .* \(d_model=12, num_heads=3\); got \(2, 3, 5, 3\)"),
])
def test_split_and_combine_heads_refuse_the_wrong_shape(method, shape, match):
    mha = MultiHeadAttention(12, 3, rng=0)
    with pytest.raises(ValueError, match=match):
        getattr(mha, method)(np.zeros(shape))


def test_split_heads_errors_name_heads_and_the_argument():
    mha = MultiHeadAttention(12, 3, num_kv_heads=1, rng=0)
    with pytest.raises(ValueError, match=r"\(batch, length, 4\): 1 heads of depth 4"):
        mha.split_heads(np.zeros((2, 5, 12)), heads=1)
    with pytest.raises(ValueError, match="heads must be a positive integer"):
        mha.split_heads(np.zeros((2, 5, 12)), heads=0)
    with pytest.raises(TypeError, match="split_heads expects x as a numpy.ndarray or torch.Tensor, got list"):
        mha.split_heads([[0.0] * 12])


# ---- grown up ------------------------------------------------------------------------------
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (4, 2), (4, 1)])
@pytest.mark.parametrize("bias", [False, True])
def test_gqa_and_bias_against_reference(num_heads, num_kv_heads, bias):
    rng = np.random.default_rng(3)
    mha = MultiHeadAttention(32, num_heads, num_kv_heads=num_kv_heads, bias=bias, rng=rng)
    if bias:  # make the biases matter
        mha.load_state_dict({n: randn(rng, *v.shape) * 0.3 for n, v in mha.state_dict().items()})
    assert mha.W_k.shape == (32, num_kv_heads * 8) and mha.W_o.shape == (32, 32)
    x, kv = randn(rng, 2, 7, 32), randn(rng, 2, 5, 32)
    out, w = mha(x, kv, need_weights=True)
    want_out, want_w = reference_mha(x, kv, kv, mha.state_dict(), num_heads, num_kv_heads)
    np.testing.assert_allclose(out, want_out, **TIGHT)
    np.testing.assert_allclose(w, want_w, **TIGHT)
    self_out, none = mha(x)  # key = value = query
    assert none is None
    np.testing.assert_allclose(self_out, reference_mha(x, x, x, mha.state_dict(), num_heads, num_kv_heads)[0],
                               **TIGHT)


def masks_under_test(B, H, L):
    rng = np.random.default_rng(11)
    dense = rng.random((B, 1, L, L)) < 0.6
    dense[..., 0] = True  # every row sees key 0
    lengths = [L, 3]
    pad = np.arange(L)[None, None, None, :] < np.array(lengths)[:, None, None, None]
    return [
        ("causal", qkv.causal(), causal_allowed(L, L), None),
        ("causal & padding", qkv.causal() & qkv.padding(lengths), causal_allowed(L, L) & pad, None),
        ("bool array", dense, dense, None),
        ("float bias", rng.standard_normal((B, H, L, L)), None, "bias"),
    ]


@pytest.mark.parametrize("case", range(4))
def test_masks(case):
    B, H, L = 2, 4, 6
    name, mask, allowed, kind = masks_under_test(B, H, L)[case]
    rng = np.random.default_rng(case)
    mha = MultiHeadAttention(16, H, num_kv_heads=2, bias=True, rng=rng)
    x = randn(rng, B, L, 16)
    out, w = mha(x, mask=mask, need_weights=True)
    bias = mask if kind == "bias" else None
    want_out, want_w = reference_mha(x, x, x, mha.state_dict(), H, 2, allowed=allowed, bias=bias)
    np.testing.assert_allclose(out, want_out, **TIGHT, err_msg=name)
    np.testing.assert_allclose(w, want_w, **TIGHT, err_msg=name)
    if allowed is not None:
        assert (w[~np.broadcast_to(allowed, w.shape)] == 0).all()


def test_a_float32_bias_in_a_float64_module_is_widened_as_its_inputs_are(rng):
    """float32 inputs to a float64 module are promoted, as NumPy promotes them; a float32 bias
    is widened alike (lossless). It used to be refused as not of "q's dtype float64", a q
    the caller never passed."""
    mha = qkv.MultiHeadAttention(16, 4, rng=rng)
    x = rng.standard_normal((2, 5, 16)).astype(np.float32)
    bias = rng.standard_normal((5, 5)).astype(np.float32)
    out, _ = mha(x, mask=bias)
    want, _ = mha(x.astype(np.float64), mask=bias.astype(np.float64))
    assert out.dtype == np.float64
    np.testing.assert_array_equal(out, want)


def test_query_that_sees_nothing_gives_bias_only():
    rng = np.random.default_rng(5)
    mha = MultiHeadAttention(8, 2, bias=True, rng=rng)
    mha.b_o = randn(rng, 8)
    x = randn(rng, 2, 4, 8)
    out, w = mha(x, mask=qkv.padding([4, 4], q_lengths=[4, 2]), need_weights=True)
    assert np.isfinite(out).all()
    np.testing.assert_array_equal(w[1, :, 2:], 0)
    np.testing.assert_allclose(out[1, 2:], np.broadcast_to(mha.b_o, (2, 8)), **TIGHT)  # attention gave 0


@settings(max_examples=20, deadline=None)
@given(st.integers(1, 9), st.integers(0, 2**31))
def test_permuting_keys_and_values_together_changes_nothing(Lk, seed):
    rng = np.random.default_rng(seed)
    mha = MultiHeadAttention(12, 3, rng=rng)
    x, kv = randn(rng, 1, 4, 12), randn(rng, 1, Lk, 12)
    perm = rng.permutation(Lk)
    out, w = mha(x, kv, need_weights=True)
    out_p, w_p = mha(x, kv[:, perm], need_weights=True)
    np.testing.assert_allclose(out_p, out, **TIGHT)
    np.testing.assert_allclose(w_p, w[..., perm], **TIGHT)


def test_float32_inputs_follow_numpy_promotion_and_float32_module():
    rng = np.random.default_rng(0)
    x = randn(rng, 2, 5, 16).astype(np.float32)
    mha64 = MultiHeadAttention(16, 4, rng=1)
    assert mha64(x)[0].dtype == np.float64
    mha32 = MultiHeadAttention(16, 4, rng=1, dtype=np.float32)
    out32 = mha32(x, mask=qkv.causal())[0]
    assert out32.dtype == np.float32
    want = reference_mha(x.astype(np.float64), x, x, mha32.state_dict(), 4, allowed=causal_allowed(5, 5))[0]
    formula32 = reference_mha(x, x, x, mha32.state_dict(), 4, allowed=causal_allowed(5, 5))[0]
    err, ref_err = np.abs(out32 - want).max(), np.abs(formula32 - want).max()
    assert err <= 2 * ref_err + 2e-6


def test_float16_module_within_the_tolerance_rule():
    rng = np.random.default_rng(4)
    mha = MultiHeadAttention(16, 4, rng=rng, dtype=np.float16)
    x = randn(rng, 2, 7, 16).astype(np.float16)
    out = mha(x, mask=qkv.causal())[0]
    assert out.dtype == np.float16
    allowed = causal_allowed(7, 7)
    want = reference_mha(x.astype(np.float64), x, x, mha.state_dict(), 4, allowed=allowed)[0]
    formula16 = reference_mha(x, x, x, mha.state_dict(), 4, allowed=allowed)[0]
    err, ref_err = np.abs(out - want).max(), np.abs(formula16.astype(np.float64) - want).max()
    assert err <= 2 * ref_err + 2e-3, (err, ref_err)


@pytest.mark.parametrize("dtype,shown", [
    (np.longdouble, np.dtype(np.longdouble).name), (np.int32, "int32"), (np.complex128, "complex128"),
    ("bogus", "'bogus'"),
])
def test_unsupported_dtype_is_refused_by_the_constructor(dtype, shown):
    with pytest.raises(TypeError, match=rf"dtype must be one of float64, float32, float16, got {shown}$"):
        MultiHeadAttention(16, 4, dtype=dtype)


def test_cross_attention_inputs_of_different_dtypes_are_refused_by_name():
    mha = MultiHeadAttention(16, 4, dtype=np.float32)
    with pytest.raises(TypeError, match="query, key and value must share one dtype; got query float64, key float32"):
        mha(np.zeros((1, 3, 16)), np.zeros((1, 5, 16), np.float32))
    assert mha(np.zeros((1, 3, 16)))[0].dtype == np.float64  # self-attention: NumPy promotes, as documented


# ---- score modifiers -----------------------------------------------------------------------
def score_mods_under_test():
    slopes = np.array([0.5, 0.25, 0.125, 0.0625])
    return {"alibi": qkv.alibi(slopes), "softcap": qkv.softcap(0.7),
            "alibi then softcap": [qkv.alibi(slopes), qkv.softcap(0.7)]}


def heads_by_hand(mha, x, kv, mask, score_mod):
    """The module's projections written out, then the float64 reference qkv.attention."""
    state = mha.state_dict()
    B, Lq, Lk = x.shape[0], x.shape[1], kv.shape[1]
    H, Hkv, d = mha.num_heads, mha.num_kv_heads, mha.depth
    q = (x @ state["W_q"] + state["b_q"]).reshape(B, Lq, H, d).transpose(0, 2, 1, 3)  # (B, H, Lq, d)
    k = (kv @ state["W_k"] + state["b_k"]).reshape(B, Lk, Hkv, d).transpose(0, 2, 1, 3)  # (B, Hkv, Lk, d)
    v = (kv @ state["W_v"] + state["b_v"]).reshape(B, Lk, Hkv, d).transpose(0, 2, 1, 3)
    heads = qkv.attention(q, k, v, mask, score_mod=score_mod, backend="reference")  # (B, H, Lq, d)
    out = heads.transpose(0, 2, 1, 3).reshape(B, Lq, H * d) @ state["W_o"] + state["b_o"]
    return out, qkv.attention_weights(q, k, mask, score_mod=score_mod)


@pytest.mark.parametrize("name", list(score_mods_under_test()))
@pytest.mark.parametrize("mask", [None, "causal", "float bias"])
def test_score_mod_equals_functional_attention(name, mask):
    score_mod = score_mods_under_test()[name]
    rng = np.random.default_rng(8)
    mha = MultiHeadAttention(16, 4, num_kv_heads=2, bias=True, rng=rng)
    mha.load_state_dict({n: randn(rng, *v.shape) * 0.5 for n, v in mha.state_dict().items()})
    x, kv = randn(rng, 2, 5, 16), randn(rng, 2, 7, 16)
    mask = {None: None, "causal": qkv.causal(), "float bias": randn(rng, 2, 4, 5, 7)}[mask]
    out, w = mha(x, kv, mask=mask, score_mod=score_mod, need_weights=True)
    want_out, want_w = heads_by_hand(mha, x, kv, mask, score_mod)
    np.testing.assert_allclose(out, want_out, **TIGHT)
    np.testing.assert_allclose(w, want_w, **TIGHT)
    plain = mha(x, kv, mask=mask)[0]
    assert np.abs(out - plain).max() > 1e-3  # the modifier did something


def test_score_modifier_given_as_mask_points_to_score_mod():
    mha = MultiHeadAttention(16, 4, rng=0)
    x = np.zeros((1, 3, 16))
    with pytest.raises(TypeError, match="pass it as score_mod="):
        mha(x, mask=qkv.softcap(1.0))
    with pytest.raises(TypeError, match="score_mod must be a qkv score modifier"):
        mha(x, score_mod=qkv.causal())


# ---- state dict ----------------------------------------------------------------------------
def test_state_dict_round_trip_and_copies():
    a = MultiHeadAttention(16, 4, num_kv_heads=2, bias=True, rng=0)
    b = MultiHeadAttention(16, 4, num_kv_heads=2, bias=True, rng=1)
    state = a.state_dict()
    assert list(state) == ["W_q", "W_k", "W_v", "W_o", "b_q", "b_k", "b_v", "b_o"]
    assert {n: v.shape for n, v in state.items()} == parameter_shapes(16, 4, 2, bias=True)
    b.load_state_dict(state)
    x = np.random.default_rng(2).standard_normal((1, 3, 16))
    np.testing.assert_array_equal(a(x)[0], b(x)[0])
    state["W_q"][:] = 0  # a copy: the module is untouched
    assert np.abs(a.W_q).sum() > 0


def test_load_state_dict_errors():
    mha = MultiHeadAttention(16, 4)
    with pytest.raises(ValueError, match=r"missing keys \['b_q'"):
        MultiHeadAttention(16, 4, bias=True).load_state_dict(mha.state_dict())
    with pytest.raises(ValueError, match="unexpected keys"):
        mha.load_state_dict({**mha.state_dict(), "extra": np.zeros(1)})
    with pytest.raises(ValueError, match=r"state_dict\['W_k'\] must have shape \(16, 8\)"):
        MultiHeadAttention(16, 4, num_kv_heads=2).load_state_dict(mha.state_dict())
    with pytest.raises(TypeError, match="W_q"):
        mha.load_state_dict({**mha.state_dict(), "W_q": [[0.0]]})


# ---- errors --------------------------------------------------------------------------------
@pytest.mark.parametrize("args,match", [
    ((10, 3), r"d_model \(10\) must be divisible by num_heads \(3\)"),
    ((16, 8, 3), r"num_heads \(8\) must be a multiple of num_kv_heads \(3\)"),
    ((0, 1), "d_model must be a positive integer"),
    ((16, 2.0), "num_heads must be a positive integer"),
    ((16, 4, 0), "num_kv_heads must be a positive integer"),
])
def test_bad_config(args, match):
    with pytest.raises(ValueError, match=match):
        MultiHeadAttention(*args)


def test_bad_inputs():
    mha = MultiHeadAttention(16, 4, rng=0)
    x = np.zeros((2, 5, 16))
    cases = [
        (ValueError, r"query must have shape \(batch, length, d_model=16\), got \(2, 5, 8\)", dict(query=x[..., :8])),
        (ValueError, r"query must have shape .* got \(5, 16\)", dict(query=x[0])),
        (ValueError, "key must have shape", dict(query=x, key=np.zeros((2, 5, 15)))),
        (ValueError, "same batch size", dict(query=x, key=x[:1])),
        (ValueError, r"key and value must have the same \(batch, length\)", dict(query=x, key=x, value=x[:, :3])),
        (TypeError, "query must have dtype float64, float32 or float16, got int64",
         dict(query=np.zeros((2, 5, 16), dtype=int))),
        (TypeError, "key is a masked array: its mask would not be applied",
         dict(query=x, key=np.ma.masked_array(x, mask=x > 0))),
        (TypeError, r"query has non-native byte order \(>f8\)", dict(query=x.astype(">f8"))),
        (TypeError, "query must be a numpy.ndarray, got list", dict(query=[[0.0]])),
    ]
    if np.dtype(np.longdouble).itemsize > 8:  # where long double is wider than float64
        cases.append((TypeError, f"query must have dtype float64, float32 or float16, got {np.dtype(np.longdouble)}",
                      dict(query=np.zeros((2, 5, 16), dtype=np.longdouble))))
    for error, match, kwargs in cases:
        with pytest.raises(error, match=match):
            mha(**kwargs)
    with pytest.raises(TypeError, match=r"call expects a list \[Q, K, V\]"):
        mha.call([x, x])
    with pytest.raises(ValueError, match=r"a 3-D mask \(3, 5, 5\) is ambiguous: give it 4-D, \(B, 1, Lq, Lk\)"):
        mha(x, mask=np.ones((3, 5, 5), dtype=bool))
    with pytest.raises(ValueError, match="does not broadcast"):
        mha(x, mask=np.ones((3, 1, 5, 5), dtype=bool))


def test_torch_tensor_points_to_the_torch_module():
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match="qkv.torch.MultiHeadAttention"):
        MultiHeadAttention(16, 4)(torch.zeros(2, 5, 16))


def test_public_names():
    import qkv.nn
    import qkv.torch

    assert qkv.MultiHeadAttention is qkv.nn.MultiHeadAttention
    assert qkv.torch.MultiHeadAttention.__module__ == "qkv.torch_nn"
