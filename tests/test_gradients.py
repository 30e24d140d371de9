"""Gradients: float64 gradcheck on torch paths, and dQ/dK/dV against the oracle's gradients."""
import numpy as np
import pytest

import qkv
from helpers import (assert_within_rule, check_bfloat16_short_row, check_gradients, native_here, needs_native,
                     reference_grads, to64)
from qkv import dispatch, inputs
from qkv.backends.native import _few_queries

torch = pytest.importorskip("torch")

GRAD_BACKENDS = [n for n, b in dispatch.REGISTRY.items() if b.caps.gradients and b.missing() is None and b.runs_on_cpu]

CASES = {
    "plain": dict(),
    "causal": dict(mask=qkv.causal()),
    "causal_lq_gt_lk": dict(mask=qkv.causal(align="top_left")),
    "padding_empty_rows": dict(mask=qkv.padding([5, 0], q_lengths=[3, 6])),
    "window_alibi": dict(mask=qkv.window(2, 1), score_mod=qkv.alibi(np.array([0.5, 0.25, 0.125, 0.0625]))),
    "softcap": dict(mask=qkv.document(np.array([[0, 0, 1, 1, 1, 2, 2], [3, 3, 3, 3, 3, 3, 3]])), score_mod=qkv.softcap(1.0)),
    "score_fn": dict(score_mod=qkv.score_fn(lambda s, b, h, i, j: s * 0.5 - abs(i - j) * 0.25)),
    "dropout": dict(dropout_p=0.3, seed=7),
}


def _sizes(case, small):
    """Lq and Lk for a case: more queries than keys where the case is about that; 7 x 7 where
    its mask data is sized for it (or small); else more than one tile of each."""
    if case == "causal_lq_gt_lk":
        return dict(Lq=9, Lk=6) if small else dict(Lq=41, Lk=37)
    if small or case in ("padding_empty_rows", "softcap"):
        return dict(Lq=7, Lk=7)
    return dict(Lq=37, Lk=41)


def leaves(rng, dtype=torch.float64, Lq=7, Lk=7, hq=4, hkv=2, D=5, Dv=3):
    make = lambda *s: torch.tensor(rng.standard_normal(s), dtype=dtype, requires_grad=True)  # noqa: E731
    return make(2, hq, Lq, D), make(2, hkv, Lk, D), make(2, hkv, Lk, Dv)


@pytest.mark.parametrize("backend", [b for b in GRAD_BACKENDS if "float64" in dispatch.REGISTRY[b].caps.dtypes])
@pytest.mark.parametrize("case", CASES)
def test_gradcheck_float64(backend, rng, case):
    q, k, v = leaves(rng, **_sizes(case, small=True))
    kwargs = CASES[case]

    def f(q, k, v):
        out, lse = qkv.attention(q, k, v, backend=backend, return_lse=True, **kwargs)
        return out, torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)  # lse gradients too

    assert torch.autograd.gradcheck(f, (q, k, v), eps=1e-6, atol=1e-7, fast_mode=True)


def _oracle_cases():
    """(backend, dtype, case) for every gradient backend, dtype and case it supports."""
    for b in GRAD_BACKENDS:
        caps = dispatch.REGISTRY[b].caps
        for d in ("float64", "float32", "bfloat16"):
            for c in CASES:
                if d in caps.dtypes and c != "score_fn" and (caps.dropout or "dropout_p" not in CASES[c]):
                    yield b, d, c


@pytest.mark.parametrize("backend,dtype,case", list(_oracle_cases()))
def test_gradients_match_oracle(backend, rng, case, dtype):
    q, k, v = leaves(rng, getattr(torch, dtype), **_sizes(case, small=False))
    check_gradients(backend, (q, k, v), CASES[case], rng)


def test_reference_backward_matches_autograd_of_the_formula(rng):
    """The oracle's hand-written backward equals torch autograd through the plain formula."""
    q, k, v = leaves(rng)
    kwargs = CASES["window_alibi"]
    out = qkv.attention_weights(q, k, **kwargs) @ torch.repeat_interleave(v, 2, dim=1)
    dout = torch.tensor(rng.standard_normal(out.shape))
    (out * dout).sum().backward()
    grads = reference_grads([to64(x) for x in (q, k, v)], to64(dout), np.zeros(out.shape[:-1]), kwargs)
    for g, want in zip((q.grad, k.grad, v.grad), grads):
        np.testing.assert_allclose(to64(g), want, atol=1e-12)


def test_fully_masked_rows_have_zero_gradient(rng):
    q, k, v = leaves(rng)
    out = qkv.attention(q, k, v, qkv.padding([7, 7], q_lengths=[2, 7]), backend="torch")
    out.sum().backward()
    assert (q.grad[0, :, 2:] == 0).all()
    assert torch.isfinite(k.grad).all() and torch.isfinite(v.grad).all()


@pytest.mark.parametrize("backend,dtype", [(b, d) for b in GRAD_BACKENDS for d in ("float64", "float32")
                                           if d in dispatch.REGISTRY[b].caps.dtypes])
def test_softcap_over_a_minus_inf_bias(backend, rng, dtype):
    """Keys a -inf bias masks stay masked under softcap, in the gradients too."""
    q, k, v = leaves(rng, getattr(torch, dtype))
    allowed = torch.from_numpy(rng.random((2, 1, 7, 7)) < 0.5)
    allowed[0, 0, 3] = False  # a row with no key: gradient 0
    bias = torch.zeros(allowed.shape, dtype=q.dtype).masked_fill(~allowed, float("-inf"))
    check_gradients(backend, (q, k, v), dict(mask=bias, score_mod=qkv.softcap(1.0)), rng)


@pytest.mark.parametrize("backend", ["reference", *GRAD_BACKENDS])
def test_no_grad_runs_any_backend_and_records_nothing(backend, rng):
    """Under torch.no_grad() inputs that require grad are plain inputs: no graph, and backends
    without a backward (the oracle) run too."""
    q, k, v = leaves(rng, torch.float32)
    with torch.no_grad():
        out = qkv.attention(q, k, v, qkv.causal(), backend=backend)
    assert out.grad_fn is None and not out.requires_grad
    want = qkv.attention(*(to64(x) for x in (q, k, v)), qkv.causal(), backend="reference")
    ref = qkv.attention(*(to64(x).astype(np.float32) for x in (q, k, v)), qkv.causal(), backend="reference")
    assert_within_rule(to64(out), want, ref, "float32")


@pytest.mark.parametrize("backend", GRAD_BACKENDS)
@pytest.mark.parametrize("Lq,Lk", [(0, 7), (7, 0)])
def test_empty_sequences_have_empty_or_zero_gradients_as_the_oracle_says(backend, rng, Lq, Lk):
    check_gradients(backend, leaves(rng, torch.float32, Lq=Lq, Lk=Lk), {}, rng)


# ---- what torch's autograd offers around qkv.attention ----------------------------------------
def _float32_leaves(rng, Lq=9, Lk=9):
    return leaves(rng, torch.float32, Lq=Lq, Lk=Lk)


def _oracle(q, k, v, bias=None):
    s = q.double() @ k.double().repeat_interleave(q.shape[1] // k.shape[1], 1).transpose(-1, -2) / q.shape[-1] ** 0.5
    s = s if bias is None else s + bias.double()
    return torch.softmax(s, -1) @ v.double().repeat_interleave(q.shape[1] // v.shape[1], 1)


@pytest.mark.parametrize("backend", GRAD_BACKENDS)
def test_a_mask_changed_in_place_before_the_backward_is_refused(backend, rng):
    q, k, v = _float32_leaves(rng)
    for mask in (torch.randn(2, 1, 9, 9), torch.ones(2, 1, 9, 9, dtype=torch.bool)):
        out = qkv.attention(q, k, v, mask, backend=backend)
        mask.mul_(5) if mask.is_floating_point() else mask[..., 1:].fill_(False)  # the backward would read these
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            out.sum().backward()


@pytest.mark.parametrize("backend", GRAD_BACKENDS)
def test_a_numpy_mask_is_refused_where_the_backward_reads_it_again(backend, rng):
    """A change to a NumPy array in place cannot be seen, and these backwards read the mask
    again: with torch inputs that record gradients a dense mask must be a tensor."""
    q, k, v = _float32_leaves(rng)
    allowed = rng.random((9, 9)) < 0.5
    for mask in (qkv.dense_mask(allowed), qkv.causal() & ~qkv.dense_mask(allowed)):
        with pytest.raises(TypeError, match="holds a NumPy array, and torch inputs record gradients"):
            qkv.attention(q, k, v, mask, backend=backend)
    with torch.no_grad():  # no backward: nothing is read again
        qkv.attention(q, k, v, qkv.dense_mask(allowed), backend=backend)


@pytest.mark.parametrize("backend", GRAD_BACKENDS)
def test_second_derivatives_are_refused_not_zero(backend, rng):
    q, k, v = _float32_leaves(rng)
    out = qkv.attention(q, k, v, backend=backend)
    with pytest.raises(RuntimeError, match="backward is not differentiable: second derivatives"):
        torch.autograd.grad(out.pow(2).sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="backward is not differentiable"):
        torch.autograd.functional.hvp(lambda x: qkv.attention(x, k, v, backend=backend).sum(), q.detach(),
                                      torch.ones_like(q))


def test_forward_mode_derivatives_are_right_or_refused(rng):
    import torch.autograd.forward_ad as fwAD

    q, k, v = (x.detach() for x in _float32_leaves(rng))
    tangent = torch.from_numpy(rng.standard_normal(q.shape)).float()
    want = torch.func.jvp(lambda x: _oracle(x, k, v), (q.double(),), (tangent.double(),))[1]
    with fwAD.dual_level():
        dual = fwAD.make_dual(q, tangent)
        got = fwAD.unpack_dual(qkv.attention(dual, k, v)).tangent  # the automatic choice: torch's own operations
        assert (got.double() - want).abs().max() < 1e-5
        for backend in ("native", "reference")[not native_here():]:  # values only: the tangent would be lost
            with pytest.raises(qkv.BackendError, match="no forward-mode derivative"):
                qkv.attention(dual, k, v, backend=backend)
        recording = fwAD.make_dual(q.clone().requires_grad_(), tangent)
        with pytest.raises(NotImplementedError, match=r"qkv.attention has no forward-mode derivative .* while it "
                                                      r"records gradients; under torch.no_grad\(\)"):
            qkv.attention(recording, k, v, backend="torch")
        with torch.no_grad():  # what the message says to do
            got = fwAD.unpack_dual(qkv.attention(recording, k, v)).tangent
        assert (got.double() - want).abs().max() < 1e-5


@pytest.mark.parametrize("backend", GRAD_BACKENDS)
def test_autocast_leaves_the_computation_in_the_inputs_dtype(backend, rng):
    q, k, v = _float32_leaves(rng)
    want = _oracle(q, k, v)
    with torch.autocast("cpu", torch.bfloat16):
        out = qkv.attention(q, k, v, backend=backend)
        weights = qkv.attention_weights(q, k)
    assert out.dtype == torch.float32 and (out.double() - want).abs().max() < 1e-5  # bfloat16 would be ~1e-2
    assert (weights.double().sum(-1) - 1).abs().max() < 1e-6
    out.sum().backward()
    assert q.grad.dtype == torch.float32


@pytest.mark.parametrize("transform", ["vmap", "grad"])
def test_function_transforms_are_refused_by_name(transform, rng):
    q, k, v = (x.detach() for x in _float32_leaves(rng))
    run = (lambda: torch.vmap(lambda x: qkv.attention(x, k, v))(q[None].expand(3, -1, -1, -1, -1))) \
        if transform == "vmap" else (lambda: torch.func.grad(lambda x: qkv.attention(x, k, v).sum())(q))
    with pytest.raises(TypeError, match="qkv.attention does not run inside torch.func transforms"):
        run()


@pytest.mark.filterwarnings("ignore:Dynamo does not know how to trace")  # the graph break at the kernel
def test_torch_compile_runs_with_graph_breaks_around_the_kernels(rng):
    q, k, v = _float32_leaves(rng)
    lengths = torch.tensor([7, 9])

    def f(q, k, v):
        return qkv.attention(q * 2, k, v, qkv.causal() & qkv.padding(lengths)).square()

    compiled = torch.compile(f, backend="aot_eager")  # dynamo's tracing and autograd, without code generation
    eager, out = f(q, k, v), compiled(q, k, v)
    want = torch.autograd.grad(eager.sum(), (q, k, v))
    torch.testing.assert_close(out, eager, rtol=0, atol=0)
    for got, expected in zip(torch.autograd.grad(out.sum(), (q, k, v)), want):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::torch.jit.TracerWarning")  # the trace's own
def test_tracing_is_refused_by_name(rng):
    """torch.jit.trace would record the output's allocation and not the kernel that fills it."""
    q, k, v = (x.detach() for x in _float32_leaves(rng))
    with pytest.raises(TypeError, match="qkv.attention does not run under torch.jit.trace"):
        torch.jit.trace(lambda x: qkv.attention(x, k, v), (q,))


@pytest.mark.parametrize("backend", ["native", "torch"])
@pytest.mark.parametrize("output", ["out", "lse"])
def test_batched_gradients_are_refused_by_name(rng, backend, output):
    if dispatch.REGISTRY[backend].missing():
        pytest.skip(dispatch.REGISTRY[backend].missing())
    q, k, v = _float32_leaves(rng)
    result = qkv.attention(q, k, v, backend=backend, return_lse=True)[output == "lse"]
    batched = torch.ones((3,) + result.shape)
    with pytest.raises(TypeError, match="qkv.attention's backward takes one gradient at a time"):
        torch.autograd.grad(result, q, batched, is_grads_batched=True)


def test_function_transforms_run_through_the_explicit_formula(rng):
    """attention_weights and the seed's door record torch's own operations: vmap and grad run
    through them and equal the plain formula."""
    q, k, v = (x.detach().double() for x in _float32_leaves(rng))
    k_all, v_all = (x.repeat_interleave(q.shape[1] // x.shape[1], 1) for x in (k, v))

    def plain(q):
        return torch.softmax(q @ k_all.transpose(-1, -2) / q.shape[-1] ** 0.5, -1) @ v_all

    def through_weights(q):
        return qkv.attention_weights(q, k) @ v_all

    def through_door(q):  # (B*H, L, D) inputs: one head each
        out, _ = qkv.scaled_dot_product_attention(q.flatten(0, 1), k_all.flatten(0, 1), v_all.flatten(0, 1))
        return out.reshape(q.shape[:-1] + (v.shape[-1],))

    batched = q[None].expand(3, -1, -1, -1, -1)
    for f in (through_weights, through_door):
        torch.testing.assert_close(torch.vmap(f)(batched), torch.vmap(plain)(batched), rtol=1e-12, atol=1e-12)
        grad = torch.func.grad(lambda x: f(x).pow(2).sum())(q)
        torch.testing.assert_close(grad, torch.func.grad(lambda x: plain(x).pow(2).sum())(q), rtol=1e-12, atol=1e-12)


def large_score_leaves(rng, Lk, dtype=torch.float32, Lq=33, Hq=2, Dv=8):
    """Integer q and k of D = 16: their scores (scale 1) are exact in float32 in any summation
    order, and the rows' lse lie near 1000-2000, where float32 rounds an lse by 1e-4."""
    ints = lambda *s: torch.tensor(rng.integers(-20, 21, s), dtype=dtype, requires_grad=True)  # noqa: E731
    v = torch.tensor(rng.standard_normal((1, 1, Lk, Dv)), dtype=dtype, requires_grad=True)
    return ints(1, Hq, Lq, 16), ints(1, 1, Lk, 16), v


@pytest.mark.parametrize("backend", [b for b in GRAD_BACKENDS if "float32" in dispatch.REGISTRY[b].caps.dtypes])
@pytest.mark.parametrize("mask", [None, qkv.causal()], ids=["plain", "causal"])
def test_gradients_at_large_scores(backend, rng, mask):
    """The backward rebuilds the weights from the forward's lse and lse_lo (what the lse's float32
    rounding lost): from the lse alone they were off by |lse|·6e-8 each, which broke the rule
    here (dq off by 1.2e-3, bound 1.0e-4)."""
    leaves = large_score_leaves(rng, Lk=300)
    out, lse = qkv.attention(*leaves, mask, scale=1.0, backend=backend, return_lse=True)
    assert lse.abs().max() > 1000  # the regime this is about
    check_gradients(backend, leaves, dict(mask=mask, scale=1.0), rng)


@pytest.mark.parametrize("backend", [b for b in GRAD_BACKENDS if "float32" in dispatch.REGISTRY[b].caps.dtypes])
@pytest.mark.parametrize("seed", [2, 4])
@pytest.mark.parametrize("shape", [dict(), dict(Lq=1, Hq=4, Dv=16)], ids=["tiles", "decoding"])
def test_gradients_at_large_scores_with_an_inexact_scale(backend, seed, shape):
    """The scale multiplies the finished q·kᵀ, in the forward and in the backward's recomputed
    scores. Folded into q first (q·0.3 rounded per element), it put dq off by 8.9e-5 where
    the rule allows 5.5e-5 (tiles, seed 4) and dv off by 3.1e-5 where it allows 1.4e-5
    (tiles, seed 2); with one query of four heads (the native decoding path), dq by 4.2e-4
    against 5.7e-5 (seed 2)."""
    rng = np.random.default_rng(seed)
    check_gradients(backend, large_score_leaves(rng, Lk=300, **shape), dict(scale=0.3), rng)


@pytest.mark.skipif("native" not in GRAD_BACKENDS, reason="no native kernel")
@pytest.mark.parametrize("seed", [4, 9])
def test_native_decoding_backward_rebuilds_the_forwards_scores(seed):
    """Few stacked queries run on the native decoding path, whose dot products sum along the
    head dim in vector lanes: the backward recomputes the scores that way too. From the
    products' sums instead, P was rebuilt against the lse of other scores, 7.6e-6 apart at
    scale 7, and dq was off by 4.7e-5 where the rule allows 3.1e-5 (seed 4), by 2.7e-4
    against 1.1e-4 (seed 9)."""
    rng = np.random.default_rng(seed)
    make = lambda *s: torch.tensor(rng.standard_normal(s), dtype=torch.float32, requires_grad=True)  # noqa: E731
    leaves = make(1, 4, 1, 16), make(1, 2, 300, 16), make(1, 2, 300, 16)
    assert _few_queries(inputs.prepare(*leaves))  # the decoding path
    check_gradients("native", leaves, dict(scale=7.0), rng)


@pytest.mark.parametrize("backend", [b for b in GRAD_BACKENDS if "bfloat16" in dispatch.REGISTRY[b].caps.dtypes])
def test_bfloat16_backward_reads_the_output_as_summed(backend):
    """rowsum(dO ∘ O) comes from the output in float32, not rounded to bfloat16: from the
    rounded one dq was off by 0.0225 where the rule allows 0.0176 (one of some 160 random
    cases, a short masked row)."""
    check_bfloat16_short_row(backend, torch.tensor([[True, False, True]]))


@pytest.mark.parametrize("backend, rule", [(b, "mask_fn") for b in GRAD_BACKENDS] + [("torch", "score_fn")])
def test_a_tensor_a_rule_reads_changed_before_the_backward_is_refused(backend, rule, rng):
    """The backward evaluates the rule again: a tensor it captured, changed in place after the
    forward, gave silently wrong gradients (dq off by 8.6 for a mask_fn table)."""
    q, k, v = _float32_leaves(rng)
    table = torch.from_numpy(rng.random((9, 9))).float()
    mod = dict(mask=qkv.mask_fn(lambda b, h, i, j: table[i, j] > 0.3)) if rule == "mask_fn" else \
        dict(score_mod=qkv.score_fn(lambda s, b, h, i, j: s + table[i, j]))
    out = qkv.attention(q, k, v, backend=backend, **mod)
    table.mul_(3)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


@pytest.mark.parametrize("backend", GRAD_BACKENDS)
def test_a_bias_changed_under_allow_mutation_on_saved_tensors_is_refused(backend, rng):
    """torch then saves a copy and lets the change pass, but the backward read the changed bias
    again: gradients off by 2.4e7 (native) and 4.8e13 (torch)."""
    q, k, v = _float32_leaves(rng)
    bias = torch.from_numpy(rng.standard_normal((9, 9))).float()
    with torch.autograd.graph.allow_mutation_on_saved_tensors():
        out = qkv.attention(q, k, v, bias, backend=backend)
        bias.mul_(10)
        with pytest.raises(RuntimeError, match="changed in place after qkv.attention's forward"):
            out.sum().backward()


def test_tangents_of_a_bias_or_of_alibi_slopes_are_carried_or_refused(rng):
    """Only q, k and v were looked at for tangents: native ran on a bias with one and dropped it,
    and alibi slopes with one lost it on every backend."""
    import torch.autograd.forward_ad as fwAD

    q, k, v = (x.detach() for x in _float32_leaves(rng))
    bias, direction = (torch.from_numpy(rng.standard_normal((9, 9))).float() for _ in range(2))
    want = torch.func.jvp(lambda b: _oracle(q, k, v, b), (bias.double(),), (direction.double(),))[1]
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625])
    with fwAD.dual_level():
        dual = fwAD.make_dual(bias, direction)
        assert "native" in qkv.explain(q, k, v, dual).refused
        got = fwAD.unpack_dual(qkv.attention(q, k, v, dual)).tangent
        assert got is not None and (got.double() - want).abs().max() < 1e-5
        dual_slopes = fwAD.make_dual(slopes, torch.ones(4))
        for backend in ("torch", None):
            with pytest.raises(ValueError, match="alibi slopes that require grad or carry a forward-mode tangent"):
                qkv.attention(q, k, v, score_mod=qkv.alibi(dual_slopes), backend=backend)
        weights = qkv.attention_weights(q, k, score_mod=qkv.alibi(dual_slopes))  # the formula carries it
        assert fwAD.unpack_dual(weights).tangent.abs().max() > 0


def test_what_a_rule_reads_is_held_only_where_it_can_change_unseen(rng):
    """An attribute named like a global tensor is not that tensor (cfg.window held a global
    `window`, and changing it refused the backward); an inference tensor keeps no version (the
    forward failed reading it); NumPy inputs record nothing (torch slopes that require grad
    were refused for them)."""
    q, k, v = _float32_leaves(rng)
    cfg = type("Config", (), {"window": 4})()
    with torch.inference_mode():
        ids = torch.arange(9) // 5
    out = qkv.attention(q, k, v, qkv.mask_fn(lambda b, h, i, j: ((i - j).abs() <= cfg.window) & (ids[i] == ids[j])))
    window.add_(1)
    out.sum().backward()
    assert torch.isfinite(q.grad).all()
    numpy_q = q.detach().numpy()
    trainable_slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625], requires_grad=True)
    assert qkv.attention(numpy_q, numpy_q, numpy_q, score_mod=qkv.alibi(trainable_slopes)).shape == numpy_q.shape


window = torch.zeros(3)  # a global tensor named like the attribute the rule above reads


@needs_native  # the torch backend is refused there, and the others take no gradients
@pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")  # torch's checkpoint notes
def test_selective_activation_checkpointing_gives_the_gradients_of_the_plain_call(rng):
    """Its dispatch mode caches operators' outputs; with the native kernel refused under every
    dispatch mode, the torch backend ran and scaled a cached product in place (dq off by 9.7).
    The torch backend, which changes its tiles in place, is refused there by name."""
    import functools

    from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

    q, k, v = _float32_leaves(rng, Lq=200, Lk=200)
    run = lambda q, k, v: qkv.attention(q, k, v, qkv.causal())  # noqa: E731
    policy = lambda ctx, op, *args, **kwargs: CheckpointPolicy.MUST_SAVE  # noqa: E731
    out = checkpoint(run, q, k, v, use_reentrant=False,
                     context_fn=functools.partial(create_selective_checkpoint_contexts, policy))
    got = torch.autograd.grad(out.sum(), (q, k, v))
    for g, want in zip(got, torch.autograd.grad(run(q, k, v).sum(), (q, k, v))):
        torch.testing.assert_close(g, want, rtol=0, atol=0)
    on_torch = lambda q, k, v: qkv.attention(q, k, v, qkv.causal(), backend="torch")  # noqa: E731
    with pytest.raises(qkv.BackendError, match="selective activation checkpointing caches operators' outputs"):
        checkpoint(on_torch, q, k, v, use_reentrant=False,
                   context_fn=functools.partial(create_selective_checkpoint_contexts, policy))


def test_make_fx_traces_the_operators_that_compute_attention(rng):
    """Under a dispatch mode the native kernel ran unseen: make_fx recorded only its output's
    allocation, and the traced graph returned uninitialised memory."""
    from torch.fx.experimental.proxy_tensor import make_fx

    q, k, v = (x.detach() for x in _float32_leaves(rng))
    traced = make_fx(lambda q, k, v: qkv.attention(q, k, v, qkv.causal()))(q, k, v)
    assert len([n for n in traced.graph.nodes if n.op == "call_function"]) > 5
    torch.testing.assert_close(traced(q * 2, k, v), qkv.attention(q * 2, k, v, qkv.causal()))


@pytest.mark.parametrize("backend", ["torch", None])
def test_a_score_fn_of_the_positions_alone_has_gradients(backend, rng):
    """A rule that does not read the score: the backward failed ('element 0 of tensors does not
    require grad'); the scores' gradient is zero there."""
    q, k, v = _float32_leaves(rng)
    position_bias = qkv.score_fn(lambda s, b, h, i, j: -0.1 * (i - j).abs().to(s.dtype))
    qkv.attention(q, k, v, score_mod=position_bias, backend=backend).sum().backward()
    i = torch.arange(9)
    v64 = v.detach().double().requires_grad_()
    weights = torch.softmax(-0.1 * (i[:, None] - i).abs().double(), -1)  # (Lq, Lk): the scores play no part
    (weights @ v64.repeat_interleave(q.shape[1] // v.shape[1], 1)).sum().backward()
    torch.testing.assert_close(v.grad.double(), v64.grad, rtol=0, atol=1e-5)
    assert q.grad.abs().max() == 0 and k.grad.abs().max() == 0
