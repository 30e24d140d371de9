"""Decoding with a KV cache: the prompt, then a token (or a few) at a time, gives exactly
the outputs of one full causal pass — MHA and GQA, NumPy and torch, with user masks."""
import numpy as np
import pytest

import qkv
from mha_reference import causal_allowed, reference_mha
from qkv.kv_cache import KVCache
from qkv.nn import MultiHeadAttention as NumpyMHA

D_MODEL = 32
KINDS = ["numpy", "torch"]


def make(kind, num_heads=4, num_kv_heads=None, bias=True, seed=0):
    """(module, to_array, to_numpy) for one kind, with random float64 weights (biases included)."""
    rng = np.random.default_rng(seed)
    np_mha = NumpyMHA(D_MODEL, num_heads, num_kv_heads=num_kv_heads, bias=bias, rng=rng)
    np_mha.load_state_dict({n: rng.standard_normal(v.shape) * 0.3 for n, v in np_mha.state_dict().items()})
    if kind == "numpy":
        return np_mha, (lambda x: x), (lambda x: x)
    torch = pytest.importorskip("torch")
    import qkv.torch as qt

    mha = qt.MultiHeadAttention(D_MODEL, num_heads, num_kv_heads=num_kv_heads, bias=bias, dtype=torch.float64)
    mha.load_state_dict(np_mha.state_dict())
    return mha, (lambda x: torch.tensor(x)), (lambda x: x.detach().numpy())


def decode(mha, to, x, chunks, max_len=None, mask_for=None, score_mod=None):
    """Run x (B, L, d_model) through the cache in chunks; the outputs of every chunk, and the cache."""
    cache = mha.init_cache(x.shape[0], max_len or x.shape[1])
    outs, start = [], 0
    for n in chunks:
        mask = None if mask_for is None else mask_for(start, start + n)
        outs.append(mha(to(x[:, start:start + n]), mask=mask, cache=cache, score_mod=score_mod)[0])
        start += n
        assert cache.length == start
    return outs, cache


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("num_kv_heads", [4, 2, 1])
def test_prompt_then_tokens_equals_one_causal_pass(kind, num_kv_heads):
    mha, to, back = make(kind, num_kv_heads=num_kv_heads)
    x = np.random.default_rng(1).standard_normal((2, 12, D_MODEL))
    full = back(mha(to(x), mask=qkv.causal())[0])
    want = reference_mha(x, x, x, mha_state(mha), 4, num_kv_heads, allowed=causal_allowed(12, 12))[0]
    np.testing.assert_allclose(full, want, rtol=1e-10, atol=1e-12)
    outs, cache = decode(mha, to, x, [7, 1, 1, 1, 1, 1], max_len=16)
    assert [o.shape[1] for o in outs] == [7, 1, 1, 1, 1, 1]
    np.testing.assert_allclose(np.concatenate([back(o) for o in outs], axis=1), full, rtol=1e-10, atol=1e-12)
    assert cache.keys.shape == (2, num_kv_heads, 16, 8)


def test_gradients_reach_every_decoding_step():
    """With autograd recording, each step writes a new version of the cache: one backward over
    every step's output gives the gradients of one causal pass (in place, the earlier steps'
    saved keys would have changed under them)."""
    torch = pytest.importorskip("torch")
    mha, _, _ = make("torch", num_kv_heads=2)
    x = torch.tensor(np.random.default_rng(2).standard_normal((2, 9, D_MODEL)), requires_grad=True)
    weights = torch.tensor(np.random.default_rng(3).standard_normal((2, 9, D_MODEL)))  # d(loss)/d(out)

    def gradients(outputs):
        mha.zero_grad()
        x.grad = None
        (torch.cat(outputs, dim=1) * weights).sum().backward()
        return [x.grad.clone()] + [p.grad.clone() for p in mha.parameters()]

    full = gradients([mha(x, mask=qkv.causal())[0]])
    cache, outs, start = mha.init_cache(2, 9), [], 0
    for n in (4, 1, 3, 1):
        outs.append(mha(x[:, start:start + n], cache=cache)[0])
        start += n
    for got, want in zip(gradients(outs), full):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    cache.reset()  # a recorded graph holds the arrays: reset gives new ones
    with torch.no_grad():  # without a graph the cache is written in place again
        keys = cache.keys
        mha(x[:, :2], cache=cache)
        assert cache.keys is keys and not keys.requires_grad


def test_a_trainable_query_projection_alone_gets_the_gradient_of_one_causal_pass():
    """Keys and values frozen, the query projection trained: autograd saves views of the cache
    for the queries' gradient, so each step must write a new version (in place, the backward
    failed: a saved tensor had been modified)."""
    torch = pytest.importorskip("torch")
    mha, _, _ = make("torch", num_kv_heads=2)
    for name in ("W_k", "b_k", "W_v", "b_v"):
        getattr(mha, name).requires_grad_(False)
    x = torch.tensor(np.random.default_rng(7).standard_normal((1, 5, D_MODEL)))

    def query_gradients(outputs):
        mha.zero_grad()
        torch.cat(outputs, dim=1).square().sum().backward()
        return mha.W_q.grad.clone(), mha.b_q.grad.clone()

    full = query_gradients([mha(x, mask=qkv.causal())[0]])
    cache = mha.init_cache(1, 5)
    steps = query_gradients([mha(x[:, t:t + 1], cache=cache, need_weights=t == 2)[0] for t in range(5)])
    for got, want in zip(steps, full):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("then", ["a step under no_grad", "reset and a step under no_grad"])
def test_a_trainable_query_projection_keeps_its_graph_through_later_untracked_steps(then):
    """Frozen keys and values: the recorded step's cache arrays do not require grad, yet its
    graph saved views of them. A later step under no_grad (or after reset) wrote into them in
    place, and the pending backward failed."""
    torch = pytest.importorskip("torch")
    mha, _, _ = make("torch", num_kv_heads=2)
    for name in ("W_k", "b_k", "W_v", "b_v"):
        getattr(mha, name).requires_grad_(False)
    x = torch.tensor(np.random.default_rng(8).standard_normal((1, 6, D_MODEL)))
    cache = mha.init_cache(1, 8)
    out, _ = mha(x[:, :4], cache=cache)
    if then.startswith("reset"):
        cache.reset()
    with torch.no_grad():
        mha(x[:, 4:6], cache=cache)
    mha.zero_grad()
    out.square().sum().backward()
    got = mha.W_q.grad.clone()
    mha.zero_grad()
    mha(x[:, :4], mask=qkv.causal())[0].square().sum().backward()
    torch.testing.assert_close(got, mha.W_q.grad, rtol=1e-10, atol=1e-12)


def test_a_reset_cache_records_the_next_sequence_afresh():
    """After a recorded sequence and its backward, reset() and a second recorded sequence: its
    backward gives what a fresh cache's does (it used to backward into the first graph)."""
    torch = pytest.importorskip("torch")
    mha, _, _ = make("torch", num_kv_heads=2)
    xs = torch.tensor(np.random.default_rng(4).standard_normal((2, 2, 6, D_MODEL)))

    def sequence_grads(cache, x):
        mha.zero_grad()
        outs = [mha(x[:, :4], cache=cache)[0], mha(x[:, 4:5], cache=cache)[0], mha(x[:, 5:], cache=cache)[0]]
        torch.cat(outs, dim=1).square().sum().backward()
        return [p.grad.clone() for p in mha.parameters()]

    reused = mha.init_cache(2, 8)
    for x in xs:
        reused.reset()
        got = sequence_grads(reused, x)
        for g, want in zip(got, sequence_grads(mha.init_cache(2, 8), x)):
            torch.testing.assert_close(g, want, rtol=1e-12, atol=1e-12)


def test_a_step_without_grad_leaves_recorded_steps_intact():
    """A prompt recorded for a loss, then a token generated under no_grad with the same cache:
    the prompt's backward still works and gives what it gives without that token (the token
    used to be written in place into the keys the prompt's graph saved)."""
    torch = pytest.importorskip("torch")
    mha, _, _ = make("torch", num_kv_heads=2)
    x = torch.tensor(np.random.default_rng(5).standard_normal((2, 6, D_MODEL)))

    def prompt_grads(then_a_token):
        mha.zero_grad()
        cache = mha.init_cache(2, 8)
        prompt = mha(x[:, :4], cache=cache)[0]
        if then_a_token:
            with torch.no_grad():
                mha(x[:, 4:5], cache=cache)
            assert cache.length == 5
        prompt.square().sum().backward()
        return [p.grad.clone() for p in mha.parameters()]

    for got, want in zip(prompt_grads(True), prompt_grads(False)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def mha_state(mha):
    return {n: np.asarray(v.detach().numpy() if hasattr(v, "detach") else v) for n, v in mha.state_dict().items()}


@pytest.mark.parametrize("kind", KINDS)
def test_prompt_in_chunks_of_different_sizes(kind):
    mha, to, back = make(kind, num_kv_heads=2, seed=3)
    x = np.random.default_rng(2).standard_normal((1, 12, D_MODEL))
    full = back(mha(to(x), mask=qkv.causal())[0])
    outs, _ = decode(mha, to, x, [3, 1, 4, 2, 2])
    np.testing.assert_allclose(np.concatenate([back(o) for o in outs], axis=1), full, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("kind", KINDS)
def test_weights_with_cache_are_rows_of_the_full_weights(kind):
    mha, to, back = make(kind, num_kv_heads=2, seed=4)
    x = np.random.default_rng(3).standard_normal((2, 6, D_MODEL))
    full_w = back(mha(to(x), mask=qkv.causal(), need_weights=True)[1])  # (B, H, 6, 6)
    cache = mha.init_cache(2, 6)
    mha(to(x[:, :4]), cache=cache)
    _, w = mha(to(x[:, 4:5]), cache=cache, need_weights=True)
    assert tuple(w.shape) == (2, 4, 1, 5)
    np.testing.assert_allclose(back(w)[:, :, 0], full_w[:, :, 4, :5], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("kind", KINDS)
def test_user_masks_combine_with_the_cache(kind):
    """Left padding (a boolean array per step) and a float bias, each against one full pass."""
    mha, to, back = make(kind, num_kv_heads=2, seed=5)
    B, L = 2, 9
    x = np.random.default_rng(4).standard_normal((B, L, D_MODEL))
    keys_ok = np.arange(L)[None, :] >= np.array([0, 3])[:, None]  # row 1 starts with 3 padding tokens
    allowed = causal_allowed(L, L)[None, None] & keys_ok[:, None, None, :]  # (B, 1, L, L)
    full = back(mha(to(x), mask=to(allowed))[0])
    outs, _ = decode(mha, to, x, [5, 1, 2, 1], mask_for=lambda a, b: to(keys_ok[:, None, None, :b].copy()))
    got = np.concatenate([back(o) for o in outs], axis=1)
    np.testing.assert_allclose(got, full, rtol=1e-10, atol=1e-12)  # padding queries see nothing: b_o in both

    bias = np.random.default_rng(6).standard_normal((B, 4, L, L))
    causal_bias = np.where(causal_allowed(L, L), 0.0, -np.inf)
    full = back(mha(to(x), mask=to(bias + causal_bias))[0])
    outs, _ = decode(mha, to, x, [4, 3, 1, 1], mask_for=lambda a, b: to(bias[:, :, a:b, :b].copy()))
    np.testing.assert_allclose(np.concatenate([back(o) for o in outs], axis=1), full, rtol=1e-10, atol=1e-12)


def score_mods_under_test(to):
    slopes = to(np.array([0.5, 0.25, 0.125, 0.0625]))
    return {"alibi": qkv.alibi(slopes), "softcap": qkv.softcap(0.7),
            "alibi then softcap": [qkv.alibi(slopes), qkv.softcap(0.7)]}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", ["alibi", "softcap", "alibi then softcap"])
def test_score_mods_combine_with_the_cache(kind, name):
    """ALiBi is aligned bottom-right like the cache's causal mask; with a float bias mask the bias
    comes first, then the modifiers, in the cached steps as in the full pass."""
    mha, to, back = make(kind, num_kv_heads=2, seed=7)
    score_mod = score_mods_under_test(to)[name]
    B, L = 2, 9
    x = np.random.default_rng(8).standard_normal((B, L, D_MODEL))
    full = back(mha(to(x), mask=qkv.causal(), score_mod=score_mod)[0])
    outs, _ = decode(mha, to, x, [5, 1, 2, 1], score_mod=score_mod)
    np.testing.assert_allclose(np.concatenate([back(o) for o in outs], axis=1), full, rtol=1e-10, atol=1e-12)

    bias = np.random.default_rng(9).standard_normal((B, 4, L, L))
    causal_bias = np.where(causal_allowed(L, L), 0.0, -np.inf)
    full = back(mha(to(x), mask=to(bias + causal_bias), score_mod=score_mod)[0])
    outs, _ = decode(mha, to, x, [4, 3, 1, 1], mask_for=lambda a, b: to(bias[:, :, a:b, :b].copy()),
                     score_mod=score_mod)
    np.testing.assert_allclose(np.concatenate([back(o) for o in outs], axis=1), full, rtol=1e-10, atol=1e-12)


IDS = np.array([[0, 0, 0, 1, 1, 1, 1, 2, 2], [0, 1, 1, 1, 1, 2, 2, 2, 2]])  # packed documents, (B, L)
WHOLE_SEQUENCE_RULES = {  # mask objects and score rules read the query's position in the sequence
    "mask_fn": (lambda a, b: qkv.mask_fn(lambda bb, h, i, j: (i - j) % 3 != 1), None),
    "score_fn": (lambda a, b: None, qkv.score_fn(lambda s, bb, h, i, j: s - 0.25 * abs(i - j) + 0.1 * i)),
    "window top-left": (lambda a, b: qkv.window(3, 0, align="top_left"), None),
    "not a window": (lambda a, b: ~qkv.window(1, 0), None),
    "causal top-left & mask_fn": (lambda a, b: qkv.causal(align="top_left") & qkv.mask_fn(lambda bb, h, i, j: j != 1),
                                  None),
    "document": (lambda a, b: qkv.document(IDS[:, :b]), None),  # ids of the sequence so far
    "prefix_lm | window": (lambda a, b: qkv.prefix_lm([2, 4]) | qkv.window(1, 0), None),
    "padding with q_lengths": (lambda a, b: qkv.padding(np.minimum([9, 6], b), q_lengths=np.minimum([9, 7], b)), None),
}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", list(WHOLE_SEQUENCE_RULES))
def test_rules_of_the_whole_sequence_give_the_full_pass(kind, name):
    """A cached call's query i is position cached + i of the sequence, for masks and score rules
    alike (Mask.from_query): the steps give the full pass's rows."""
    mha, to, back = make(kind, num_kv_heads=2, seed=11)
    mask_for, score_mod = WHOLE_SEQUENCE_RULES[name]
    B, L = IDS.shape
    x = np.random.default_rng(12).standard_normal((B, L, D_MODEL))
    user_mask = mask_for(0, L)
    full = back(mha(to(x), mask=qkv.causal() if user_mask is None else qkv.causal() & user_mask,
                    score_mod=score_mod)[0])
    outs, _ = decode(mha, to, x, [4, 1, 2, 1, 1], mask_for=mask_for, score_mod=score_mod)
    np.testing.assert_allclose(np.concatenate([back(o) for o in outs], axis=1), full, rtol=1e-10, atol=1e-12)


def test_query_wider_than_the_cache_is_refused_not_rounded():
    """Uncached, NumPy promotes a float64 query through float32 weights to float64; the float32
    cache cannot widen, so the cached call refuses the query, naming both dtypes."""
    mha = NumpyMHA(D_MODEL, 4, num_kv_heads=2, bias=True, rng=0, dtype=np.float32)
    x = np.random.default_rng(1).standard_normal((2, 5, D_MODEL))  # float64
    assert mha(x)[0].dtype == np.float64
    cache = mha.init_cache(2, 8)
    with pytest.raises(TypeError, match=r"query has dtype float64 but the cache holds float32 .*"
                                        r"convert the query to float32"):
        mha(x, cache=cache)
    assert cache.length == 0
    out = mha(x.astype(np.float32), cache=cache)[0]
    assert out.dtype == np.float32 and cache.length == 5


def test_narrower_query_promotes_into_the_cache_as_without_one():
    mha = NumpyMHA(D_MODEL, 4, num_kv_heads=2, bias=True, rng=0)  # float64
    x = np.random.default_rng(2).standard_normal((2, 7, D_MODEL)).astype(np.float32)
    full = mha(x, mask=qkv.causal())[0]
    outs, _ = decode(mha, lambda a: a, x, [4, 1, 2])
    got = np.concatenate(outs, axis=1)
    assert got.dtype == full.dtype == np.float64
    np.testing.assert_allclose(got, full, rtol=1e-10, atol=1e-12)
    want = reference_mha(x.astype(np.float64), x, x, mha.state_dict(), 4, 2, allowed=causal_allowed(7, 7))[0]
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)


def test_float32_decoding_within_the_tolerance_rule():
    mha = NumpyMHA(D_MODEL, 4, num_kv_heads=2, bias=True, rng=3, dtype=np.float32)
    x = np.random.default_rng(3).standard_normal((2, 9, D_MODEL)).astype(np.float32)
    outs, cache = decode(mha, lambda a: a, x, [5, 1, 2, 1])
    got = np.concatenate(outs, axis=1)
    assert got.dtype == cache.keys.dtype == np.float32
    allowed = causal_allowed(9, 9)
    want = reference_mha(x.astype(np.float64), x, x, mha.state_dict(), 4, 2, allowed=allowed)[0]
    formula32 = reference_mha(x, x, x, mha.state_dict(), 4, 2, allowed=allowed)[0]
    err, ref_err = np.abs(got - want).max(), np.abs(formula32 - want).max()
    assert err <= 2 * ref_err + 2e-6, (err, ref_err)


def test_torch_module_converted_after_its_cache_was_made():
    torch = pytest.importorskip("torch")
    import qkv.torch as qt

    mha = qt.MultiHeadAttention(16, 4)
    cache = mha.init_cache(1, 4)  # float32
    mha.double()
    with torch.no_grad(), pytest.raises(TypeError, match=r"the cache holds torch.float32 but the module's parameters "
                                                         r"are torch.float64; make a new cache with init_cache"):
        mha(torch.zeros(1, 2, 16, dtype=torch.float64), cache=cache)
    assert cache.length == 0
    mha.float()  # back to the cache's dtype: the old message, which converting the query follows
    with torch.no_grad(), pytest.raises(TypeError, match="query has dtype torch.float64 but the module's"):
        mha(torch.zeros(1, 2, 16, dtype=torch.float64), cache=cache)


@pytest.mark.parametrize("kind", KINDS)
def test_overflow_is_a_clear_error_and_leaves_the_cache_intact(kind):
    mha, to, back = make(kind, seed=6)
    x = np.random.default_rng(5).standard_normal((1, 9, D_MODEL))
    cache = mha.init_cache(1, 8)
    mha(to(x[:, :7]), cache=cache)
    with pytest.raises(ValueError, match=r"max_len=8.*7 are filled and this call adds 2"):
        mha(to(x[:, 7:9]), cache=cache)
    assert cache.length == 7
    last = back(mha(to(x[:, 7:8]), cache=cache)[0])
    full = back(mha(to(x[:, :8]), mask=qkv.causal())[0])
    np.testing.assert_allclose(last[:, 0], full[:, 7], rtol=1e-10, atol=1e-12)
    with pytest.raises(ValueError, match="max_len"):
        mha(to(x[:, 8:9]), cache=cache)


@pytest.mark.parametrize("kind", KINDS)
def test_cache_errors(kind):
    mha, to, _ = make(kind, num_kv_heads=2)
    x = to(np.zeros((2, 3, D_MODEL)))
    cache = mha.init_cache(2, 8)
    with pytest.raises(ValueError, match="key and value must be None"):
        mha(x, x, cache=cache)
    with pytest.raises(ValueError, match="batch_size=2"):
        mha(to(np.zeros((1, 3, D_MODEL))), cache=cache)
    with pytest.raises(TypeError, match="cache must be a KVCache"):
        mha(x, cache={"keys": None})
    other, _, _ = make(kind, num_kv_heads=1)
    with pytest.raises(ValueError, match="cache was made for"):
        mha(x, cache=other.init_cache(2, 8))
    with pytest.raises(ValueError, match="max_len must be a positive integer"):
        mha.init_cache(2, 0)
    with pytest.raises(ValueError, match="mask .* does not broadcast"):  # the mask must fit (Lq, length + Lq)
        mha(x, mask=to(np.ones((2, 1, 3, 2), dtype=bool)), cache=cache)
    assert cache.length == 0  # nothing was committed by the failed calls
    mha(x, cache=cache)
    cache.reset()
    assert cache.length == 0 and "length=0, max_len=8" in repr(cache)


def test_kv_cache_checks_its_arrays():
    with pytest.raises(TypeError, match="NumPy arrays or torch tensors"):
        KVCache([0], [0])
    with pytest.raises(TypeError, match="keys and values must be of one kind and dtype; got ndarray float32 and "
                                        "ndarray float64"):
        KVCache(np.zeros((1, 1, 4, 2), np.float32), np.zeros((1, 1, 4, 2)))
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match="got ndarray float32 and Tensor torch.float32"):
        KVCache(np.zeros((1, 1, 4, 2), np.float32), torch.zeros(1, 1, 4, 2))
    with pytest.raises(ValueError, match="keys and values must be on one device; got cpu and meta"):
        KVCache(torch.zeros(1, 1, 4, 2), torch.zeros(1, 1, 4, 2, device="meta"))
    with pytest.raises(ValueError, match=r"shape \(B, Hkv, max_len, depth\)"):
        KVCache(np.zeros((1, 2, 3)), np.zeros((1, 2, 3)))
    cache = KVCache(np.zeros((1, 1, 4, 2), dtype=np.float32), np.zeros((1, 1, 4, 2), dtype=np.float32))
    with pytest.raises(TypeError, match="dtype float64 but the cache holds float32"):
        cache.stage(np.zeros((1, 1, 1, 2)), np.zeros((1, 1, 1, 2)))
    new = lambda n: np.ones((1, 1, n, 2), dtype=np.float32)  # noqa: E731
    with pytest.raises(ValueError, match=r"the same number of positions.*keys \(1, 1, 2, 2\), values \(1, 1, 1, 2\)"):
        cache.stage(new(2), new(1))
    with pytest.raises(ValueError, match=r"new keys must have shape \(batch, heads, n, depth\), got \(1, 2, 2\)"):
        cache.stage(new(2)[0], new(2)[0])
    for bad in (-3, 5, 1.0):
        with pytest.raises(ValueError, match=rf"(n must be a non-negative integer, got {bad})|cannot commit 5"):
            cache.commit(bad)
    assert cache.length == 0 and (cache.values == 0).all()  # nothing was written or committed
    cache.stage(new(3), new(3))
    cache.commit(3)
    with pytest.raises(ValueError, match="cannot commit 2 positions: 3 of max_len=4 are filled"):
        cache.commit(2)


def test_a_module_refuses_a_cache_of_the_other_array_kind():
    torch = pytest.importorskip("torch")
    import qkv.torch as qt

    torch_mha, numpy_mha = qt.MultiHeadAttention(16, 4), qkv.MultiHeadAttention(16, 4, dtype=np.float32)
    with pytest.raises(TypeError, match="cache holds numpy.ndarrays but this module computes on torch.Tensors"):
        torch_mha(torch.zeros(1, 2, 16), cache=numpy_mha.init_cache(1, 4))
    with pytest.raises(TypeError, match="cache holds torch.Tensors but this module computes on numpy.ndarrays"):
        numpy_mha(np.zeros((1, 2, 16), dtype=np.float32), cache=torch_mha.init_cache(1, 4))


def test_torch_decoding_under_no_grad_keeps_the_dtype_and_device():
    torch = pytest.importorskip("torch")
    import qkv.torch as qt

    mha = qt.MultiHeadAttention(16, 4, num_kv_heads=2)
    cache = mha.init_cache(1, 4)
    assert cache.keys.dtype == torch.float32 and not cache.keys.requires_grad
    prompt = torch.randn(1, 3, 16, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        first, _ = mha(prompt, cache=cache)
        step, _ = mha(first[:, -1:], cache=cache)  # its own last output fed back, as a generator does
    assert step.shape == (1, 1, 16) and cache.length == 4 and step.dtype == torch.float32
    tokens = torch.cat([prompt, first[:, -1:]], dim=1).double().numpy()  # (1, 4, 16), what the cache saw
    params = {name: p.detach().double().numpy() for name, p in mha.state_dict().items()}
    got = torch.cat([first, step], dim=1).numpy()
    want = reference_mha(tokens, tokens, tokens, params, 4, 2, allowed=causal_allowed(4, 4))[0]
    params32 = {name: p.astype(np.float32) for name, p in params.items()}
    in_dtype = reference_mha(*(tokens.astype(np.float32),) * 3, params32, 4, 2, allowed=causal_allowed(4, 4))[0]
    assert np.abs(got - want).max() <= 2 * np.abs(in_dtype - want).max() + 2e-6


def test_torch_decoding_under_autocast_keeps_the_caches_dtype():
    """autocast narrows the projections to bfloat16; the float32 cache takes them back (no loss),
    and the steps equal one causal pass over the same bfloat16-rounded projections."""
    torch = pytest.importorskip("torch")
    import qkv.torch as qt

    mha = qt.MultiHeadAttention(D_MODEL, 4, num_kv_heads=2).eval()
    x = torch.randn(1, 6, D_MODEL, generator=torch.Generator().manual_seed(0))
    cache = mha.init_cache(1, 6)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        outs = [mha(x[:, :4], cache=cache)[0], mha(x[:, 4:5], cache=cache)[0], mha(x[:, 5:], cache=cache)[0]]
        q, k, v = (mha._split_heads(mha._project(x, w), h).float() for w, h in (("q", 4), ("k", 2), ("v", 2)))
        heads = qkv.attention(q, k, v, qkv.causal())  # float32, as the cache holds them
        want = mha._project(mha._combine_heads(heads), "o")
    assert cache.keys.dtype == torch.float32 and cache.length == 6
    torch.testing.assert_close(cache.keys[:, :, :6], k, rtol=0, atol=0)
    torch.testing.assert_close(torch.cat(outs, dim=1), want)  # bfloat16: one rounding apart at most


@pytest.mark.parametrize("made_in", ["grad", "inference_mode"])
@pytest.mark.parametrize("modes", ["gin", "ggin", "grn", "gnin", "inn", "ing"])
def test_grad_no_grad_and_inference_mode_steps_mix(modes, made_in):
    """Steps under autograd (g), no_grad (n) and inference_mode (i), and reset() under
    inference_mode (r): every sequence runs, each step equals the causal pass over the tokens so
    far (a new version of the cache made under inference_mode used to be an inference tensor,
    which the next step outside it could not write; so did a cache made by init_cache there)."""
    torch = pytest.importorskip("torch")
    mha, _, _ = make("torch", num_kv_heads=2)
    x = torch.tensor(np.random.default_rng(6).standard_normal((2, len(modes), D_MODEL)))
    modes_of = {"g": torch.enable_grad, "n": torch.no_grad, "i": torch.inference_mode}
    with torch.inference_mode(made_in == "inference_mode"):
        cache, start = mha.init_cache(2, len(modes)), 0
    for mode in modes:
        if mode == "r":
            with torch.inference_mode():
                cache.reset()
            start = 0
            continue
        with modes_of[mode]():
            got = mha(x[:, start:start + 1], cache=cache)[0]
        with torch.no_grad():
            want = mha(x[:, :start + 1], mask=qkv.causal())[0][:, -1:]
        torch.testing.assert_close(got.detach(), want, rtol=1e-12, atol=1e-12)
        start += 1
