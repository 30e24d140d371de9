"""The triton backend: its kernels against the float64 oracle, forward and backward.

On a CUDA machine the kernels run compiled on the GPU (a wider sweep); elsewhere they run
through Triton's interpreter (TRITON_INTERPRET=1) on CPU tensors, a small sweep.
"""
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import qkv
from helpers import check_backend, check_bfloat16_short_row, check_gradients, to64
from qkv import dispatch, inputs
from qkv.backends.triton import MAX_ALIBI_TERM, interpreting

torch = pytest.importorskip("torch")
pytest.importorskip("triton", reason="Triton is not installed (pip install 'qkv[triton]')")

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
DTYPES = ["float32", "float16", "bfloat16"]


if not ON_GPU and not interpreting():
    pytest.skip("no GPU, and TRITON_INTERPRET=1 was not set before triton was imported (conftest.py sets it)",
                allow_module_level=True)


def make(rng, shape, dtype, requires_grad=False):
    x = torch.tensor(rng.standard_normal(shape), dtype=getattr(torch, dtype), device=DEVICE)
    return x.requires_grad_(requires_grad)


def qkv_of(rng, dtype, B=2, Hq=2, Hkv=1, Lq=37, Lk=45, D=24, Dv=40, requires_grad=False):
    return [make(rng, s, dtype, requires_grad) for s in ((B, Hq, Lq, D), (B, Hkv, Lk, D), (B, Hkv, Lk, Dv))]


def check_forward(rng, dtype, kwargs, **shape):
    arrays = qkv_of(rng, dtype, **shape)
    check_backend("triton", arrays, [to64(a) for a in arrays], dtype, **kwargs)


SORTED_IDS = np.array([[0] * 10 + [1] * 20 + [2] * 15, [5] * 45])
UNSORTED_IDS = np.array([[0, 1] * 22 + [2], [3] * 20 + [4] * 25])

MASKS = {
    "none": dict(),
    "causal": dict(mask=qkv.causal()),
    "causal_top_left": dict(mask=qkv.causal(align="top_left")),
    "window": dict(mask=qkv.window(5, 3)),
    "padding_empty_rows": dict(mask=qkv.padding([30, 0], q_lengths=[20, 37])),
    "prefix_lm": dict(mask=qkv.prefix_lm([12, 40])),
    "document_sorted": dict(mask=qkv.document(SORTED_IDS)),
    "document_unsorted": dict(mask=qkv.document(UNSORTED_IDS)),
    "document_and_causal": dict(mask=qkv.document(SORTED_IDS) & qkv.causal()),
    "unsorted_and_window": dict(mask=qkv.document(UNSORTED_IDS) & qkv.window(4, None)),
    "alibi": dict(score_mod=qkv.alibi(np.array([0.5, 0.125]))),
    "softcap_causal": dict(mask=qkv.causal(), score_mod=qkv.softcap(2.0)),
    "alibi_softcap_window": dict(mask=qkv.window(8, 2), score_mod=[qkv.alibi(np.array([0.3, 0.05])),
                                                                     qkv.softcap(1.5)]),
}


def _lq_lk(case):
    """Document ids fix both lengths at 45."""
    return dict(Lq=45, Lk=45) if "document" in case or "unsorted" in case else dict(Lq=37, Lk=45)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", MASKS)
def test_forward_masks_and_modifiers(rng, dtype, case):
    check_forward(rng, dtype, MASKS[case], **_lq_lk(case))


SHAPES = {
    "single": dict(B=1, Hq=1, Hkv=1, Lq=1, Lk=1, D=16, Dv=16),
    "lk_one_short_of_a_block": dict(B=1, Hq=2, Hkv=1, Lq=70, Lk=31, D=16, Dv=16),  # key bounds clipped to Lk
    "decode_gqa": dict(B=1, Hq=4, Hkv=1, Lq=1, Lk=77, D=32, Dv=32),
    "lq_gt_lk": dict(B=1, Hq=2, Hkv=2, Lq=70, Lk=19, D=8, Dv=8),
    "odd_dims": dict(B=2, Hq=3, Hkv=1, Lq=33, Lk=65, D=17, Dv=5),
    "keys_wider_than_values": dict(B=1, Hq=2, Hkv=1, Lq=50, Lk=70, D=40, Dv=8),
    "head_dim_256": dict(B=1, Hq=2, Hkv=1, Lq=20, Lk=40, D=256, Dv=256),
}
if ON_GPU:
    SHAPES.update(long=dict(B=2, Hq=8, Hkv=2, Lq=1000, Lk=1500, D=128, Dv=128),
                  dims_64=dict(B=1, Hq=4, Hkv=4, Lq=4096, Lk=4096, D=64, Dv=64))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
def test_forward_shapes(rng, shape, causal):
    check_forward(rng, "float16" if ON_GPU else "float32", dict(mask=qkv.causal()) if causal else {}, **SHAPES[shape])


@pytest.mark.parametrize("mask", [qkv.causal(align="top_left"), qkv.window(3, None)])
def test_key_bounds_past_the_last_key_never_widen_a_full_tile(rng, mask):
    """Bounds clipped to Lk (top-left causal with Lq > Lk, an unbounded window) with Lk one
    short of a whole block (31 here; 127 on a GPU): no FULL tile may reach past the keys."""
    check_forward(rng, "float32", dict(mask=mask), Lq=70, Lk=127 if ON_GPU else 31)
    check_gradients("triton", qkv_of(rng, "float32", requires_grad=True, Lq=70, Lk=127 if ON_GPU else 31),
                    dict(mask=mask), rng)


GRAD_CASES = ["none", "causal", "causal_top_left", "padding_empty_rows", "document_sorted", "document_unsorted",
              "softcap_causal", "alibi_softcap_window"]


def _grad_cases():
    """Every case in float32; the half types (slow in the interpreter) on a few."""
    for case in GRAD_CASES:
        for dtype in DTYPES:
            if dtype == "float32" or ON_GPU or case in ("causal", "document_unsorted", "alibi_softcap_window"):
                yield case, dtype


@pytest.mark.parametrize("case,dtype", list(_grad_cases()))
def test_gradients_match_oracle(rng, dtype, case):
    check_gradients("triton", qkv_of(rng, dtype, requires_grad=True, **_lq_lk(case)), MASKS[case], rng)


def test_bfloat16_backward_reads_the_output_as_summed():
    """The forward under autograd writes its output in float32 for the backward's
    rowsum(dO ∘ O): from the bfloat16 one dq was off by 0.0322 where the rule allows 0.0176."""
    check_bfloat16_short_row("triton", qkv.document(np.array([[0]]), kv_ids=np.array([[0, 1, 0]])), DEVICE)


@pytest.mark.parametrize("mask", [None, qkv.causal()], ids=["plain", "causal"])
def test_gradients_at_large_scores(rng, mask):
    """The backward's probabilities come from lse + lse_lo, converted to log2 units in float64.
    Integer q and k make q·kᵀ exact in any summation order (the interpreter's products sum in
    an order of their own per kernel), and the rows' lse lie at 290-690: from the lse alone dq
    was off by 4.2e-4, bound 2.3e-4. (Scale 0.3, not 1: scores in log2 units are rounded once,
    as the float32 oracle's are only when the scale is not a power of two.)"""
    q, k = (torch.tensor(rng.integers(-20, 21, s), dtype=torch.float32, device=DEVICE, requires_grad=True)
            for s in ((1, 2, 33, 16), (1, 1, 150, 16)))
    v = make(rng, (1, 1, 150, 8), "float32", requires_grad=True)
    check_gradients("triton", (q, k, v), dict(mask=mask, scale=0.3), rng)


@pytest.mark.parametrize("dtype", DTYPES if ON_GPU else ["float32"])
@pytest.mark.parametrize("shape", ["decode_gqa", "lq_gt_lk", "odd_dims"])
def test_gradients_shapes(rng, shape, dtype):
    dims = SHAPES[shape]
    leaves = [make(rng, s, dtype, True) for s in ((dims["B"], dims["Hq"], dims["Lq"], dims["D"]),
                                                       (dims["B"], dims["Hkv"], dims["Lk"], dims["D"]),
                                                       (dims["B"], dims["Hkv"], dims["Lk"], dims["Dv"]))]
    check_gradients("triton", leaves, dict(mask=qkv.causal()), rng)


@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_several_waves_of_programs(rng, head_dim, causal):
    """Enough programs for several per multiprocessor: a Triton build error that showed only
    then (a dQ kernel that stopped with "misaligned address" on an H100) fails here."""
    kwargs = dict(mask=qkv.causal()) if causal else {}
    shape = dict(B=4, Hq=8, Hkv=2, Lq=1024, Lk=1024, D=head_dim, Dv=head_dim)
    check_forward(rng, "bfloat16", kwargs, **shape)
    check_gradients("triton", qkv_of(rng, "bfloat16", requires_grad=True, **shape), kwargs, rng)


def test_strided_inputs_are_read_in_place(rng):
    """(B, L, H, D) memory viewed as (B, H, L, D): no copy needed, same result."""
    q, k, v = (make(rng, s, "float32").transpose(1, 2) for s in ((2, 30, 4, 16), (2, 50, 2, 16), (2, 50, 2, 16)))
    assert not q.is_contiguous()
    check_backend("triton", (q, k, v), [to64(x) for x in (q, k, v)], "float32", mask=qkv.causal())


def test_keys_past_2_31_elements_are_read_where_they_are(rng):
    """Keys 2^30 elements apart (as in a long (B, L, H, D) layout): key 2 lies past 2^31, which
    32-bit offsets in the Kᵀ and Vᵀ tiles of the forward and dQ wrapped (4 GiB reserved a
    tensor, a few pages touched)."""
    def far_apart(values):
        x = torch.empty_strided(values.shape, (1, 1, 2**30, 1), dtype=torch.float16, device=DEVICE)
        with torch.no_grad():
            x.copy_(values)
        return x.requires_grad_(True)

    q = make(rng, (1, 1, 4, 16), "float16", requires_grad=True)
    k, v = (far_apart(make(rng, (1, 1, 3, 16), "float16")) for _ in range(2))
    check_backend("triton", (q, k, v), [to64(x) for x in (q, k, v)], "float16")
    check_gradients("triton", (q, k, v), {}, rng)


@pytest.mark.parametrize("mask", [qkv.causal(), qkv.padding([3]), qkv.window(2)], ids=repr)
def test_no_queries_give_zero_key_gradients(mask):
    q = torch.zeros(1, 1, 0, 16, device=DEVICE, requires_grad=True)
    k, v = (torch.randn(1, 1, 5, 16, device=DEVICE, requires_grad=True) for _ in range(2))
    qkv.attention(q, k, v, mask, backend="triton").sum().backward()
    assert torch.equal(k.grad, torch.zeros_like(k)) and torch.equal(v.grad, torch.zeros_like(v))


def test_bfloat16_is_refused_on_gpus_before_ampere(monkeypatch):
    from types import SimpleNamespace

    from qkv.backends import triton as triton_backend

    monkeypatch.setattr(triton_backend, "_capability", lambda device: (7, 0))
    on_gpu = SimpleNamespace(dtype="bfloat16", device="cuda:0", q=SimpleNamespace(device="cuda:0"))
    assert triton_backend._bfloat16_reasons(on_gpu) == [
        "bfloat16 needs a GPU of compute capability 8.0 or later; this one has 7.0"]
    assert triton_backend._bfloat16_reasons(SimpleNamespace(**{**vars(on_gpu), "dtype": "float16"})) == []
    monkeypatch.setattr(triton_backend, "_capability", lambda device: (8, 0))
    assert triton_backend._bfloat16_reasons(on_gpu) == []


def test_results_are_deterministic(rng):
    q, k, v = qkv_of(rng, "float32", requires_grad=True)
    runs = []
    for _ in range(2):
        out = qkv.attention(q, k, v, qkv.causal(), backend="triton")
        grads = torch.autograd.grad(out.square().sum(), (q, k, v))
        runs.append((out, *grads))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


@pytest.mark.filterwarnings("ignore:All-NaN slice")  # the NaNs are the point
def test_masked_key_tiles_are_never_read(rng):
    """NaN in keys, values and queries that a block never sees stays out of its results:
    the kernels skip those tiles instead of masking them (0 * NaN would be NaN)."""
    half = 128 if ON_GPU else 32  # a multiple of every block size the kernels use here
    q, k, v = (make(rng, (1, 1, 2 * half, 16), "float32", True) for _ in range(3))
    with torch.no_grad():
        k[:, :, half:] = float("nan")  # causal: query rows < half never see keys >= half
        v[:, :, half:] = float("nan")
    out = qkv.attention(q, k, v, qkv.causal(), backend="triton")
    assert torch.isfinite(out[:, :, :half]).all() and torch.isnan(out[:, :, half:]).all()
    dq, = torch.autograd.grad(out[:, :, :half].sum(), (q,))
    assert torch.isfinite(dq[:, :, :half]).all()

    q2 = q.detach().clone()
    q2[:, :, :half] = float("nan")  # keys >= half are seen only by query rows >= half
    q2.requires_grad_(True)
    k2, v2 = (make(rng, (1, 1, 2 * half, 16), "float32", True) for _ in range(2))
    out2 = qkv.attention(q2, k2, v2, qkv.causal(), backend="triton")
    dk, dv = torch.autograd.grad(out2[:, :, half:].sum(), (k2, v2))
    assert torch.isfinite(dk[:, :, half:]).all() and torch.isfinite(dv[:, :, half:]).all()


def test_query_block_ranges_cover_exactly_the_blocks_that_see_each_key_block(rng):
    from qkv.backends.triton import query_block_ranges

    Lq, Lk, bm, bn = 50, 70, 16, 32
    lo = rng.integers(-1, Lk, size=(3, Lq)).astype(np.int32)
    hi = np.minimum(lo + rng.integers(-3, 30, size=(3, Lq)), Lk).astype(np.int32)
    lo[1] = 0
    hi[1] = np.arange(Lq) // 3  # monotone, like causal
    first, end = query_block_ranges(lo, hi, Lq, Lk, bm, bn)
    for b in range(3):
        for j in range(-(-Lk // bn)):
            keys = np.arange(j * bn, min((j + 1) * bn, Lk))
            sees = [(lo[b, i] <= keys.max()) and (hi[b, i] >= keys.min()) and lo[b, i] <= hi[b, i]
                    for i in range(Lq)]
            blocks = sorted({i // bm for i, s in enumerate(sees) if s})
            assert (first[b, j], end[b, j]) == ((blocks[0], blocks[-1] + 1) if blocks else (0, 0))


@pytest.mark.parametrize("align,shift", [("bottom_right", 45 - 37), ("top_left", 0)])
def test_a_lone_causal_mask_is_computed_in_the_kernels(rng, align, shift):
    """No bounds leave the host for it; combined with another mask it is lowered to bounds."""
    from qkv.backends.triton import _plan_masks

    q, k, v = qkv_of(rng, "float32")
    plan = _plan_masks(inputs.prepare(q, k, v, mask=qkv.causal(align=align)))
    assert plan.causal_shift == shift and plan.lo is None and plan.hi is None
    plan = _plan_masks(inputs.prepare(q, k, v, mask=qkv.causal(align=align) & qkv.window(5, None)))
    assert plan.causal_shift is None and plan.lo.shape == (2, 37)


@pytest.mark.parametrize("kwargs,reason", [
    (dict(mask=qkv.mask_fn(lambda b, h, i, j: (i + j) % 2 == 0)), "interval and document masks"),
    (dict(mask=qkv.causal() | qkv.window(2)), "interval and document masks"),
    (dict(mask=qkv.document(UNSORTED_IDS) & qkv.document(UNSORTED_IDS[::-1])), "one set of unsorted"),
    (dict(score_mod=qkv.score_fn(lambda s, b, h, i, j: s)), "not score_fn"),
    (dict(score_mod=[qkv.softcap(1.0), qkv.alibi(np.ones(2))]), "softcap last"),
    (dict(dropout_p=0.1), "no dropout"),
    (dict(scale=3e38), r"a scale above 2.36e\+38"),  # scale·log2(e) overflowed: every output NaN
])
def test_unsupported_calls_are_refused_with_the_reason(rng, kwargs, reason):
    q, k, v = qkv_of(rng, "float32", Lq=45, Lk=45)
    with pytest.raises(qkv.BackendError, match=reason):
        qkv.attention(q, k, v, backend="triton", **kwargs)


def test_more_batch_rows_than_the_launch_grid_holds_are_refused():
    q = torch.zeros(65536, 1, 1, 8, device=DEVICE)  # B x H flattened into the batch: 65536 rows
    with pytest.raises(qkv.BackendError, match="at most 65535 of each"):
        qkv.attention(q, q, q, backend="triton")


def test_a_rung_that_spills_registers_is_left_for_the_next(monkeypatch):
    """A launch whose kernel spills runs again on the next rung, which later calls start from (so
    every call gives the same result); the last rung stays even if it spills."""
    from types import SimpleNamespace

    from qkv.backends import triton as backend

    monkeypatch.setattr(backend, "_ladder", lambda kernel, head_dim, dtype: ["large", "medium", "small"])
    monkeypatch.setattr(backend, "_chosen", {})
    spills = {"large": 1798, "medium": 0, "small": 5}
    launched = []

    def run(blocks):
        launched.append(blocks)
        return SimpleNamespace(n_spills=spills[blocks])

    for _ in range(3):
        backend._launch("forward", ("key",), 128, "float32", run)
    assert launched == ["large", "medium", "medium", "medium"]
    launched.clear()
    spills["medium"] = 3  # a second spilling rung moves on too, but never past the last
    for _ in range(3):
        backend._launch("dq", ("key",), 128, "float32", run)
    assert launched == ["large", "medium", "small", "small", "small"]


def test_float64_is_refused(rng):
    q, k, v = qkv_of(rng, "float32")
    with pytest.raises(qkv.BackendError, match="float64"):
        qkv.attention(q.double(), k.double(), v.double(), backend="triton")


@pytest.mark.skipif(ON_GPU, reason="checks the CPU (interpreter) dispatch")
def test_interpreter_is_never_chosen_automatically(rng):
    q, k, v = qkv_of(rng, "float16")
    choice = dispatch.choose(inputs.prepare(q, k, v))
    assert choice.backend.name != "triton" and "only when named" in " ".join(choice.refused["triton"])


@pytest.mark.skipif(ON_GPU, reason="checks the message on a machine without a GPU")
def test_without_interpreter_or_gpu_it_says_why(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert "no CUDA GPU" in dispatch.REGISTRY["triton"].missing()


@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
def test_chosen_automatically_for_cuda_tensors(rng):
    q, k, v = qkv_of(rng, "bfloat16")
    assert qkv.explain(q, k, v, mask=qkv.causal()).backend == "triton"


def test_kernels_compile_for_an_h100():
    """The compiler, unlike the interpreter, rejects what a GPU would: compile every kernel
    (plain, with every mask and modifier, with causal bounds computed, and with Lq = Lk = Hq = 1
    as constants) for sm_90, in a process without the interpreter."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).with_name("triton_compile.py")
    done = subprocess.run([sys.executable, str(script), "90"], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line.split() for line in done.stdout.splitlines()]
    assert [line[0] for line in lines] == ["forward"] * 4 + ["dkdv"] * 4 + ["dq"] * 4
    assert all(int(line[2]) <= 227 * 1024 for line in lines)  # an H100 block's shared memory


def test_outside_the_interpreter_cpu_inputs_are_refused_for_their_device_only():
    """Naming triton for CPU inputs without the interpreter cannot run them, so the refusal
    does not say "chosen only when named"."""
    script = ("import numpy as np, qkv\nq = np.zeros((1, 2, 8, 4), np.float32)\n"
              "print(qkv.explain(q, q, q).refused['triton'])")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "inputs are on cpu" in out.stdout and "only when named" not in out.stdout


def test_triton_imported_before_the_interpreter_was_asked_for_is_refused_by_name():
    """Its own library's functions were made for the GPU then: the call failed inside triton
    ('Cannot call @triton.jit'd outside of the scope of a kernel')."""
    script = ("import os, torch, triton, qkv\nos.environ['TRITON_INTERPRET'] = '1'\nq = torch.zeros(1, 1, 8, 16)\n"
              "print(qkv.dispatch.REGISTRY['triton'].unsupported(qkv.inputs.prepare(q, q, q)))")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "TRITON_INTERPRET=1 was set after triton was imported" in out.stdout


@pytest.mark.skipif(ON_GPU, reason="float16 on the interpreter: a small exact case")
def test_float16_gradients_where_ds_passes_float16s_range():
    """dS = P·(dP - delta) was rounded to float16 before its products with K and Q: past 65504
    it became inf, and dq inf, dk NaN, where the true ones are 500 and 0."""
    q = torch.zeros(1, 1, 1, 16, dtype=torch.float16, requires_grad=True)
    k = torch.zeros(1, 1, 2, 16, dtype=torch.float16)
    v = torch.zeros(1, 1, 2, 16, dtype=torch.float16)
    k[..., 0, 0], k[..., 1, 0], v[..., 0, 0], v[..., 1, 0] = 0.01, -0.01, 200, -200
    k.requires_grad_(), v.requires_grad_()
    dout = torch.zeros(1, 1, 1, 16, dtype=torch.float16)
    dout[..., 0] = 1000
    qkv.attention(q, k, v, backend="triton").backward(dout)
    assert q.grad[0, 0, 0, 0].item() == pytest.approx(500, rel=1e-2) and torch.isfinite(q.grad).all()
    assert k.grad.abs().max().item() < 1 and v.grad[0, 0, :, 0].tolist() == [500.0, 500.0]


def test_alibi_near_float32s_range_gives_no_nan(rng):
    """slope·distance overflowing to -inf filled whole unmasked tiles, which skipped the guard
    against a -inf maximum: 45 of 100 rows came out NaN. Such slopes are now refused for
    float32 inputs; the largest accepted gives what the torch backend gives."""
    q, k, v = (make(rng, (1, 1, 100, 8), "float32") for _ in range(3))
    with pytest.raises(ValueError, match=r"slopes times the largest distance \(99\) must lie within float32's range"):
        qkv.attention(q, k, v, score_mod=qkv.alibi(np.array([1e37])), backend="triton")
    past_log2 = qkv.alibi(np.array([3.4e38 / 99]))  # accepted, but times log2(e) past float32 in the kernels
    with pytest.raises(qkv.BackendError, match=r"alibi slopes whose term at the farthest key \(99\) passes 1.18e\+38"):
        qkv.attention(q, k, v, score_mod=past_log2, backend="triton")
    slopes = np.array([MAX_ALIBI_TERM / 99])
    got = qkv.attention(q, k, v, score_mod=qkv.alibi(slopes), backend="triton")
    want = qkv.attention(q, k, v, score_mod=qkv.alibi(slopes), backend="torch")
    assert not got.isnan().any()
    torch.testing.assert_close(got, want)


def test_a_document_mask_from_a_later_query_runs_as_a_document_mask(rng):
    """What the modules build for a KV cache's step, causal() & document(ids).from_query(n),
    was refused ('takes interval and document masks ..., not document(ids) from query 5')."""
    ids = np.array([[0, 0, 0, 1, 1, 1, 1, 1]])
    q, k, v = make(rng, (1, 1, 3, 16), "float32"), make(rng, (1, 1, 8, 16), "float32"), make(rng, (1, 1, 8, 16), "float32")
    mask = qkv.causal() & qkv.document(ids).from_query(5)
    torch.testing.assert_close(qkv.attention(q, k, v, mask, backend="triton"), qkv.attention(q, k, v, mask, backend="torch"))
