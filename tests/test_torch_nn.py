"""qkv.torch.MultiHeadAttention: same results as the NumPy module and the float64 reference,
interchangeable state dicts, gradients, dropout, and from_torch(torch.nn.MultiheadAttention)."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import qkv  # noqa: E402
import qkv.torch as qt  # noqa: E402
from mha_reference import causal_allowed, reference_mha  # noqa: E402
from qkv.nn import MultiHeadAttention as NumpyMHA  # noqa: E402

TIGHT = dict(rtol=1e-10, atol=1e-12)


def t64(x):
    return torch.tensor(x, dtype=torch.float64)


def np64(x):
    return x.detach().to(torch.float64).numpy()


def test_qkv_torch_is_the_module():
    assert qt.MultiHeadAttention is qkv.torch_nn.MultiHeadAttention
    assert issubclass(qt.MultiHeadAttention, torch.nn.Module)


@pytest.mark.parametrize("num_kv_heads,bias", [(4, False), (2, True), (1, True)])
def test_same_outputs_as_numpy_module(num_kv_heads, bias):
    rng = np.random.default_rng(num_kv_heads)
    np_mha = NumpyMHA(32, 4, num_kv_heads=num_kv_heads, bias=bias, rng=rng)
    np_mha.load_state_dict({n: rng.standard_normal(v.shape) * 0.3 for n, v in np_mha.state_dict().items()})
    mha = qt.MultiHeadAttention(32, 4, num_kv_heads=num_kv_heads, bias=bias, dtype=torch.float64)
    mha.load_state_dict(np_mha.state_dict())  # NumPy arrays into the torch module
    x, kv = rng.standard_normal((2, 6, 32)), rng.standard_normal((2, 9, 32))
    for mask_np, mask_t in [(None, None), (qkv.causal(), qkv.causal()),
                            (causal_allowed(6, 9), torch.tensor(causal_allowed(6, 9)))]:
        out_np, w_np = np_mha(x, kv, mask=mask_np, need_weights=True)
        out, w = mha(t64(x), t64(kv), mask=mask_t, need_weights=True)
        np.testing.assert_allclose(np64(out), out_np, **TIGHT)
        np.testing.assert_allclose(np64(w), w_np, **TIGHT)
    want = reference_mha(x, kv, kv, np_mha.state_dict(), 4, num_kv_heads)[0]
    np.testing.assert_allclose(np64(mha(t64(x), t64(kv))[0]), want, **TIGHT)
    # and back: the torch state dict into the NumPy module
    back = NumpyMHA(32, 4, num_kv_heads=num_kv_heads, bias=bias)
    back.load_state_dict(mha.state_dict())
    np.testing.assert_array_equal(back(x)[0], np_mha(x)[0])


@pytest.mark.parametrize("on_meta", [False, True])
def test_load_state_dict_with_assign_casts_to_the_module_dtype(on_meta):
    rng = np.random.default_rng(12)
    state = {n: rng.standard_normal(v.shape) * 0.3 for n, v in NumpyMHA(16, 4, bias=True).state_dict().items()}
    with torch.device("meta" if on_meta else "cpu"):
        mha = qt.MultiHeadAttention(16, 4, bias=True)  # float32
    mha.load_state_dict(state, assign=True)  # float64 NumPy arrays
    for name, param in mha.named_parameters():
        assert isinstance(param, torch.nn.Parameter) and param.requires_grad, name
        assert param.dtype == torch.float32 and param.device.type == "cpu", name
        np.testing.assert_array_equal(param.detach().numpy(), state[name].astype(np.float32))
    copied = qt.MultiHeadAttention(16, 4, bias=True)
    copied.load_state_dict(state)
    x = torch.randn(2, 6, 16, generator=torch.Generator().manual_seed(1))
    out = mha(x, mask=qkv.causal())[0]
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, copied(x, mask=qkv.causal())[0], rtol=0, atol=0)
    x64, allowed = x.double().numpy(), causal_allowed(6, 6)
    state32 = mha.numpy_state_dict()
    want = reference_mha(x64, x64, x64, state32, 4, allowed=allowed)[0]
    formula32 = reference_mha(x.numpy(), x.numpy(), x.numpy(), state32, 4, allowed=allowed)[0]
    err, ref_err = np.abs(np64(out) - want).max(), np.abs(formula32 - want).max()
    assert err <= 2 * ref_err + 2e-6, (err, ref_err)


def test_state_dict_keys_match_and_numpy_state_dict():
    mha = qt.MultiHeadAttention(16, 4, num_kv_heads=2, bias=True)
    np_mha = NumpyMHA(16, 4, num_kv_heads=2, bias=True)
    assert list(mha.state_dict()) == list(np_mha.state_dict())
    for name, value in mha.numpy_state_dict().items():
        assert isinstance(value, np.ndarray) and value.shape == np_mha.state_dict()[name].shape
    with pytest.raises(ValueError, match="missing keys"):
        qt.MultiHeadAttention(16, 4, bias=True).load_state_dict(NumpyMHA(16, 4).state_dict())


def test_float32_within_the_tolerance_rule():
    mha = qt.MultiHeadAttention(64, 8, num_kv_heads=2, bias=True)
    x = torch.randn(2, 33, 64, generator=torch.Generator().manual_seed(0))
    out = mha(x, mask=qkv.causal())[0]
    state = mha.numpy_state_dict()
    allowed = causal_allowed(33, 33)
    want = reference_mha(x.double().numpy(), x.double().numpy(), x.double().numpy(), state, 8, 2, allowed)[0]
    formula32 = reference_mha(x.numpy(), x.numpy(), x.numpy(), state, 8, 2, allowed)[0]
    err, ref_err = np.abs(np64(out) - want).max(), np.abs(formula32 - want).max()
    assert out.dtype == torch.float32
    assert err <= 2 * ref_err + 2e-6, (err, ref_err)


def literal_forward(mha, x, allowed, modify=lambda s: s):
    """The formula in torch ops (autograd), for gradients: self-attention, GQA, biases, and
    `modify` applied to the scaled scores (a score modifier written out)."""
    B, L, E = x.shape
    H, Hkv, d = mha.num_heads, mha.num_kv_heads, mha.depth
    q = (x @ mha.W_q + mha.b_q).reshape(B, L, H, d).transpose(1, 2)
    k = (x @ mha.W_k + mha.b_k).reshape(B, L, Hkv, d).transpose(1, 2).repeat_interleave(H // Hkv, 1)
    v = (x @ mha.W_v + mha.b_v).reshape(B, L, Hkv, d).transpose(1, 2).repeat_interleave(H // Hkv, 1)
    s = modify(q @ k.transpose(-1, -2) / d ** 0.5).masked_fill(~allowed, float("-inf"))
    out = (torch.softmax(s, -1) @ v).transpose(1, 2).reshape(B, L, H * d)
    return out @ mha.W_o + mha.b_o


def test_gradients_match_the_literal_formula():
    torch.manual_seed(0)
    mha = qt.MultiHeadAttention(16, 4, num_kv_heads=2, bias=True, dtype=torch.float64)
    x = torch.randn(2, 5, 16, dtype=torch.float64, requires_grad=True)
    grad_out = torch.randn(2, 5, 16, dtype=torch.float64)
    out = mha(x, mask=qkv.causal())[0]
    got = torch.autograd.grad(out, [x, *mha.parameters()], grad_out)
    want_out = literal_forward(mha, x, torch.tensor(causal_allowed(5, 5)))
    want = torch.autograd.grad(want_out, [x, *mha.parameters()], grad_out)
    torch.testing.assert_close(out, want_out, rtol=1e-10, atol=1e-12)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-11)


def test_gradcheck_input():
    torch.manual_seed(1)
    mha = qt.MultiHeadAttention(8, 2, num_kv_heads=1, bias=True, dtype=torch.float64)
    x = torch.randn(1, 4, 8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x: mha(x, mask=qkv.causal())[0], (x,))


def test_dropout():
    torch.manual_seed(0)
    mha = qt.MultiHeadAttention(16, 4, dropout=0.5, dtype=torch.float64)
    x = torch.randn(2, 8, 16, dtype=torch.float64)
    mha.eval()
    plain = mha(x)[0]
    mha.train()
    torch.manual_seed(3)
    dropped = mha(x)[0]
    torch.manual_seed(3)
    again = mha(x)[0]
    assert not torch.allclose(dropped, plain)
    torch.testing.assert_close(dropped, again)  # dropout follows torch's generator
    mha.dropout = 0.0
    torch.testing.assert_close(mha(x)[0], plain)

def test_dropout_errors_name_the_argument():
    with pytest.raises(ValueError, match=r"^dropout must be a number in \[0, 1\), got 1\.0$"):
        qt.MultiHeadAttention(16, 4, dropout=1.0)
    mha = qt.MultiHeadAttention(16, 4, dropout=0.25)
    with pytest.raises(ValueError, match=r"^dropout must be a number in \[0, 1\), got -0\.5$"):
        mha.dropout = -0.5
    assert mha.dropout == 0.25  # the refused value was not kept
    mha.dropout = 0.5
    assert mha.dropout == 0.5 and "dropout=0.5" in repr(mha)


@pytest.mark.parametrize("dtype", [torch.int32, torch.complex64, "float32", torch.float8_e4m3fn])
def test_a_dtype_that_is_not_a_floating_torch_dtype_is_refused_at_construction(dtype):
    with pytest.raises(TypeError, match="dtype must be a floating torch dtype"):
        qt.MultiHeadAttention(16, 4, dtype=dtype)


def score_mods_under_test():
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625], dtype=torch.float64)
    return {"alibi": qkv.alibi(slopes), "softcap": qkv.softcap(0.7),
            "alibi then softcap": [qkv.alibi(slopes), qkv.softcap(0.7)]}


def heads_by_hand(mha, x, kv, mask, score_mod):
    """The module's projections written out, then the float64 reference qkv.attention."""
    B, Lq, Lk = x.shape[0], x.shape[1], kv.shape[1]
    H, Hkv, d = mha.num_heads, mha.num_kv_heads, mha.depth
    q = (x @ mha.W_q + mha.b_q).reshape(B, Lq, H, d).transpose(1, 2)  # (B, H, Lq, d)
    k = (kv @ mha.W_k + mha.b_k).reshape(B, Lk, Hkv, d).transpose(1, 2)  # (B, Hkv, Lk, d)
    v = (kv @ mha.W_v + mha.b_v).reshape(B, Lk, Hkv, d).transpose(1, 2)
    heads = qkv.attention(q, k, v, mask, score_mod=score_mod, backend="reference")  # (B, H, Lq, d)
    out = heads.transpose(1, 2).reshape(B, Lq, H * d) @ mha.W_o + mha.b_o
    return out, qkv.attention_weights(q, k, mask, score_mod=score_mod)


@pytest.mark.parametrize("name", list(score_mods_under_test()))
@pytest.mark.parametrize("mask", [None, "causal", "float bias"])
def test_score_mod_equals_functional_attention(name, mask):
    score_mod = score_mods_under_test()[name]
    torch.manual_seed(2)
    mha = qt.MultiHeadAttention(16, 4, num_kv_heads=2, bias=True, dtype=torch.float64)
    with torch.no_grad():
        for param in mha.parameters():
            param.normal_(0.0, 0.5)
    x, kv = torch.randn(2, 5, 16, dtype=torch.float64), torch.randn(2, 7, 16, dtype=torch.float64)
    mask = {None: None, "causal": qkv.causal(), "float bias": torch.randn(2, 4, 5, 7, dtype=torch.float64)}[mask]
    with torch.no_grad():
        out, w = mha(x, kv, mask=mask, score_mod=score_mod, need_weights=True)
        want_out, want_w = heads_by_hand(mha, x, kv, mask, score_mod)
        plain = mha(x, kv, mask=mask)[0]
    torch.testing.assert_close(out, want_out, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(w, want_w, rtol=1e-10, atol=1e-12)
    assert (out - plain).abs().max() > 1e-3  # the modifier did something


def test_score_mod_gradients_match_the_literal_formula():
    torch.manual_seed(4)
    mha = qt.MultiHeadAttention(16, 4, num_kv_heads=2, bias=True, dtype=torch.float64)
    x = torch.randn(2, 5, 16, dtype=torch.float64, requires_grad=True)
    grad_out = torch.randn(2, 5, 16, dtype=torch.float64)
    out = mha(x, mask=qkv.causal(), score_mod=qkv.softcap(0.7))[0]
    got = torch.autograd.grad(out, [x, *mha.parameters()], grad_out)
    want_out = literal_forward(mha, x, torch.tensor(causal_allowed(5, 5)), lambda s: 0.7 * torch.tanh(s / 0.7))
    want = torch.autograd.grad(want_out, [x, *mha.parameters()], grad_out)
    torch.testing.assert_close(out, want_out, rtol=1e-10, atol=1e-12)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-11)


def test_input_errors():
    mha = qt.MultiHeadAttention(16, 4)
    with pytest.raises(TypeError, match=r"query must be a torch.Tensor, got a numpy.ndarray; for numpy inputs use qkv.MultiHeadAttention"):
        mha(np.zeros((1, 2, 16), dtype=np.float32))
    with pytest.raises(TypeError, match="query has dtype torch.float64 but the module's parameters"):
        mha(torch.zeros(1, 2, 16, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"d_model=16\), got \(1, 2, 15\)"):
        mha(torch.zeros(1, 2, 15))
    with pytest.raises(ValueError, match="divisible"):
        qt.MultiHeadAttention(15, 4)


# ---- from_torch ----------------------------------------------------------------------------
E, H, B, L, S = 16, 4, 2, 5, 7


def torch_mha(bias=True, batch_first=True, seed=0):
    torch.manual_seed(seed)
    ref = torch.nn.MultiheadAttention(E, H, bias=bias, batch_first=batch_first, dtype=torch.float64).eval()
    if bias:  # torch starts biases at 0: make them matter
        with torch.no_grad():
            ref.in_proj_bias.normal_()
            ref.out_proj.bias.normal_()
    return ref


def rand_bool(seed, shape, p_ignore=0.4):
    """True = ignore (torch polarity), never a fully ignored row."""
    g = torch.Generator().manual_seed(seed)
    ignore = torch.rand(shape, generator=g) < p_ignore
    ignore[..., 0] = False
    return ignore


def mask_cases():
    g = torch.Generator().manual_seed(5)
    float_attn = torch.randn(L, S, generator=g, dtype=torch.float64)
    float_kpm = torch.randn(B, S, generator=g, dtype=torch.float64)
    return {
        "none": (None, None),
        "bool attn_mask": (rand_bool(1, (L, S)), None),
        "bool key_padding_mask": (None, rand_bool(2, (B, S))),
        "both bool": (rand_bool(3, (L, S)), rand_bool(4, (B, S))),
        "3-D bool attn_mask": (rand_bool(6, (B * H, L, S)), None),
        "float attn_mask": (float_attn, None),
        "float key_padding_mask": (None, float_kpm),
        "float attn_mask, bool key_padding_mask": (float_attn, rand_bool(7, (B, S))),
    }


@pytest.mark.filterwarnings("ignore:Support for mismatched key_padding_mask and attn_mask")
@pytest.mark.parametrize("case", list(mask_cases()))
@pytest.mark.parametrize("bias", [True, False])
def test_from_torch_reproduces_outputs_and_per_head_weights(case, bias):
    attn_mask, kpm = mask_cases()[case]
    ref = torch_mha(bias=bias)
    mha = qt.MultiHeadAttention.from_torch(ref)
    g = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(B, n, E, generator=g, dtype=torch.float64) for n in (L, S, S))
    want_out, want_w = ref(q, k, v, key_padding_mask=kpm, attn_mask=attn_mask, need_weights=True,
                           average_attn_weights=False)
    mask = qt.from_torch_masks(attn_mask, kpm, num_heads=H)
    out, w = mha(q, k, v, mask=mask, need_weights=True)
    torch.testing.assert_close(out, want_out, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(w, want_w, rtol=1e-10, atol=1e-12)


def test_from_torch_fully_masked_rows_give_zero_not_nan():
    ref = torch_mha(bias=True)
    mha = qt.MultiHeadAttention.from_torch(ref)
    x = torch.randn(B, L, E, dtype=torch.float64)
    ignore = rand_bool(1, (L, L))
    ignore[2] = True  # query 2 may see nothing
    want_out, want_w = ref(x, x, x, attn_mask=ignore, average_attn_weights=False)
    out, w = mha(x, mask=qt.from_torch_masks(ignore), need_weights=True)
    assert torch.isnan(want_out[:, 2]).all()  # torch's answer for that row
    rows = torch.arange(L) != 2
    torch.testing.assert_close(out[:, rows], want_out[:, rows], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(w[:, :, rows], want_w[:, :, rows], rtol=1e-10, atol=1e-12)
    assert (w[:, :, 2] == 0).all()
    torch.testing.assert_close(out[:, 2], ref.out_proj.bias.expand(B, E))  # attention gave 0


def test_from_torch_sequence_first_module_and_train_mode():
    ref = torch_mha(batch_first=False)
    x = torch.randn(L, B, E, dtype=torch.float64)  # (L, B, E): torch's sequence-first layout
    want = ref(x, x, x)[0]
    mha = qt.MultiHeadAttention.from_torch(ref)
    torch.testing.assert_close(mha(x.transpose(0, 1))[0].transpose(0, 1), want, rtol=1e-10, atol=1e-12)
    assert not mha.training
    trained = qt.MultiHeadAttention.from_torch(torch.nn.MultiheadAttention(E, H, dropout=0.25).train())
    assert trained.training and trained.dropout == 0.25 and trained.W_q.dtype == torch.float32


def test_from_torch_refuses_what_it_cannot_convert():
    with pytest.raises(ValueError, match="kdim == vdim == embed_dim"):
        qt.MultiHeadAttention.from_torch(torch.nn.MultiheadAttention(E, H, kdim=8, vdim=8))
    with pytest.raises(ValueError, match="add_bias_kv"):
        qt.MultiHeadAttention.from_torch(torch.nn.MultiheadAttention(E, H, add_bias_kv=True))
    with pytest.raises(TypeError, match="torch.nn.MultiheadAttention"):
        qt.MultiHeadAttention.from_torch(torch.nn.Linear(E, E))


def test_from_torch_masks():
    ignore = torch.tensor([[False, True], [True, False]])
    assert torch.equal(qt.from_torch_masks(ignore), ~ignore)  # polarity flipped: True = attend
    assert qt.from_torch_masks() is None
    kpm = torch.tensor([[False, True]])
    assert torch.equal(qt.from_torch_masks(key_padding_mask=kpm), torch.tensor([[[[True, False]]]]))
    mixed = qt.from_torch_masks(torch.zeros(2, 2), kpm)
    assert mixed.dtype == torch.float32 and mixed.shape == (1, 1, 2, 2)
    assert torch.isinf(mixed[..., 1]).all() and (mixed[..., 0] == 0).all()
    with pytest.raises(ValueError, match="needs num_heads"):
        qt.from_torch_masks(torch.zeros(4, 2, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match="multiple of num_heads=3"):
        qt.from_torch_masks(torch.zeros(4, 2, 2, dtype=torch.bool), num_heads=3)
    with pytest.raises(TypeError, match="boolean .* or float"):
        qt.from_torch_masks(torch.zeros(2, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"key_padding_mask must have shape \(B, S\)"):
        qt.from_torch_masks(key_padding_mask=torch.zeros(2, dtype=torch.bool))
    for attn_mask in (torch.zeros(5, 7, dtype=torch.bool), torch.zeros(5, 7)):  # S = 7 against 6
        with pytest.raises(ValueError, match="same number of keys S: attn_mask has 7, key_padding_mask 6"):
            qt.from_torch_masks(attn_mask, torch.zeros(2, 6, dtype=torch.bool))
    with pytest.raises(ValueError, match="unfolds to 3 batch rows .* but key_padding_mask has 2"):
        qt.from_torch_masks(torch.zeros(6, 5, 7, dtype=torch.bool), torch.zeros(2, 7, dtype=torch.bool), num_heads=2)


def test_a_3d_mask_tensor_is_refused_as_ambiguous_and_4d_ones_mean_what_they_say():
    """(B, L, S) could be batch rows (the seed function's masks) or heads (broadcasting) or
    torch's (B * H, L, S): with B == H the wrong reading would run silently, so it is refused."""
    torch.manual_seed(0)
    mha = qt.MultiHeadAttention(8, 2, dtype=torch.float64)
    x = torch.randn(2, 3, 8, dtype=torch.float64)
    per_row = torch.ones(2, 3, 3, dtype=torch.bool)
    per_row[1, :, 2] = False  # batch row 1 sees keys 0 and 1 only
    with pytest.raises(ValueError, match=r"a 3-D mask \(2, 3, 3\) is ambiguous"):
        mha(x, mask=per_row)
    out = mha(x, mask=per_row[:, None])[0]
    np.testing.assert_allclose(np64(out[1]), np64(mha(x[1:], x[1:, :2])[0][0]), **TIGHT)
    np.testing.assert_allclose(np64(out[0]), np64(mha(x[:1])[0][0]), **TIGHT)
    assert mha(x, mask=per_row[:1])[0].shape == (2, 3, 8)  # one row for every batch row: not ambiguous


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("cached", [False, True])
def test_under_autocast_the_module_takes_what_autocast_made_of_earlier_layers(bias, cached):
    """A Linear before it under autocast hands it bfloat16 activations, which torch's own module
    takes: they were refused as another dtype than the parameters'. Autocast casts a float32
    input to bfloat16 for the projections anyway, so both give the same output; and with a
    bias the output stays in autocast's dtype (the float32 bias promoted it back)."""
    torch.manual_seed(0)
    mha = qt.MultiHeadAttention(32, 4, num_kv_heads=2, bias=bias)
    with torch.no_grad():
        mha.b_q.normal_() if bias else None
    x = torch.randn(2, 6, 32)
    cache = lambda: mha.init_cache(2, 6) if cached else None  # noqa: E731
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        from_linear = x.to(torch.bfloat16)
        got = mha(from_linear, cache=cache())[0]
        want = mha(x, cache=cache())[0]
        crossed = mha(x, from_linear, from_linear)[0]  # a float32 query over bfloat16 keys and values
    assert got.dtype == want.dtype == crossed.dtype == torch.bfloat16
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    with pytest.raises(TypeError, match="query has dtype torch.bfloat16 but the module's parameters are"):
        mha(from_linear)  # outside autocast: a dtype the parameters are not
    wide = qt.MultiHeadAttention(32, 4, dtype=torch.float64)  # autocast leaves float64 alone: still refused
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(TypeError, match="parameters are torch.float64"):
        wide(from_linear, cache=wide.init_cache(2, 6) if cached else None)


@pytest.mark.parametrize("bias_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cached", [False, True])
def test_a_float_mask_under_autocast_takes_the_heads_dtype(bias_dtype, cached):
    """Under torch's autocast the heads are in autocast's dtype (widened back with a cache): a
    float mask in the module's dtype or in autocast's is cast to them, as torch's own module
    does; it used to be refused in one of the two, whichever the heads were not."""
    torch.manual_seed(0)
    mha = qt.MultiHeadAttention(32, 4, num_kv_heads=2)
    x = torch.randn(2, 6, 32)
    bias = torch.randn(6, 6)
    cache = lambda: mha.init_cache(2, 6) if cached else None  # noqa: E731 - a cached call is causal
    with torch.no_grad():
        want = mha(x, mask=bias, cache=cache())[0]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = mha(x, mask=bias.to(bias_dtype), cache=cache())[0]
    torch.testing.assert_close(got.float(), want, rtol=0, atol=0.05)
