"""The native kernel: determinism, instruction-set variants, strides, NumPy input, fallback,
and a randomized differential test (forward and backward) against the float64 reference."""
import contextlib
import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import qkv
from helpers import assert_within_rule, check_backend, check_gradients, to64
from qkv import dispatch, inputs
from qkv._threads import available_cpus
from qkv.backends.native import default_threads

torch = pytest.importorskip("torch")
native = dispatch.REGISTRY["native"]
pytestmark = pytest.mark.skipif(native.missing() is not None, reason=f"native kernel: {native.missing()}")

SHAPES = {  # (B, Hq, Hkv, Lq, Lk, D, Dv)
    "square": (2, 4, 2, 200, 200, 64, 64),
    "decode": (1, 8, 2, 1, 5000, 128, 128),  # few queries, many keys: the key-split path
    "odd": (1, 3, 1, 77, 131, 40, 24),
    "split_query_tiles": (1, 2, 1, 200, 3000, 32, 32),  # key splits merged per query tile (nq > 1)
    "one_head_per_kv": (1, 2, 2, 300, 600, 64, 48),  # unmasked bfloat16 on AMX: 128 x 256 tiles, partial last ones
}


def _inputs(shape, dtype=torch.float32, seed=0, grad=False):
    B, Hq, Hkv, Lq, Lk, D, Dv = shape
    g = torch.Generator().manual_seed(seed)
    make = lambda *s: torch.randn(*s, generator=g).to(dtype).requires_grad_(grad)  # noqa: E731
    return make(B, Hq, Lq, D), make(B, Hkv, Lk, D), make(B, Hkv, Lk, Dv)


def _outputs_and_grads(q, k, v, mask):
    out, lse = qkv.attention(q, k, v, mask, backend="native", return_lse=True)
    grads = ()
    if q.requires_grad:
        (out.float() * torch.linspace(-1, 1, out.shape[-1])).sum().backward()
        grads = tuple(x.grad.clone() for x in (q, k, v))
        for x in (q, k, v):
            x.grad = None
    return (out.detach(), lse.detach()) + grads


def _run(q, k, v, mask, threads):
    native.num_threads = threads
    try:
        return _outputs_and_grads(q, k, v, mask)
    finally:
        native.num_threads = default_threads()


@contextlib.contextmanager
def float32_products(unit, dtype=torch.float32, skip_repeat=True):
    """Float32 forward products on AMX tiles (as bfloat16 parts) or on the FMA units. Without
    AMX a float32 'amx' case would run the 'fma' one again: it is skipped, not passed twice
    (skip_repeat=False: a drawn example, which runs either way)."""
    if skip_repeat and unit == "amx" and dtype == torch.float32 and _native_isa() != "amx":
        pytest.skip("no AMX here: float32 products run on the FMA units (the 'fma' case)")
    default, native.float32_on_amx = native.float32_on_amx, unit == "amx"
    try:
        yield
    finally:
        native.float32_on_amx = default


MASKS = {None: None, "causal": qkv.causal(), "mask_fn": qkv.mask_fn(lambda b, h, i, j: (i + j) % 3 != 1),
         "window": qkv.window(40, 3)}


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("unit", ["amx", "fma"])
def test_float32_products_on_either_unit(shape, mask, unit):
    """Float32 on AMX (each operand split exactly into three bfloat16 parts) and on the FMA
    units both keep the float32 rule, output and lse."""
    q, k, v = _inputs(SHAPES[shape])
    with float32_products(unit):
        if unit == "amx" and _native_isa() == "amx":
            assert native.on_bf16_products(inputs.prepare(q, k, v)) == (shape != "decode")
        check_backend("native", (q, k, v), tuple(to64(x) for x in (q, k, v)), "float32", mask=MASKS[mask])


@pytest.mark.parametrize("unit", ["amx", "fma"])
def test_float32_large_scores_and_nan(unit):
    """Scores in the hundreds (the exp's range reduction) keep the rule; a NaN in one query
    row makes that row's output and lse NaN and leaves every other row as it was."""
    q, k, v = _inputs((1, 2, 1, 150, 260, 64, 64))
    q = q * 40
    with float32_products(unit):
        clean, clean_lse = check_backend("native", (q, k, v), tuple(to64(x) for x in (q, k, v)), "float32")
        q[0, 1, 7, 3] = float("nan")
        out, lse = qkv.attention(q, k, v, backend="native", return_lse=True)
    assert torch.isnan(out[0, 1, 7]).all() and torch.isnan(lse[0, 1, 7])
    rest = torch.ones(150, dtype=torch.bool)
    rest[7] = False
    assert torch.equal(out[0, 1, rest], clean[0, 1, rest]) and torch.equal(out[0, 0], clean[0, 0])
    assert torch.equal(lse[0, 1, rest], clean_lse[0, 1, rest])


def _native_isa():
    from qkv import _native

    return _native.isa()


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype,unit", [(torch.float32, "amx"), (torch.float32, "fma"), (torch.bfloat16, "amx")])
@pytest.mark.parametrize("mask", [None, "causal", "mask_fn"])
def test_bitwise_identical_across_threads_and_calls(shape, dtype, unit, mask):
    m = MASKS[mask]
    q, k, v = _inputs(SHAPES[shape], dtype, grad=shape != "decode")
    with float32_products(unit, dtype):
        one = _run(q, k, v, m, threads=1)
        two = _run(q, k, v, m, threads=2)
        again = _run(q, k, v, m, threads=2)
    for a, b, c in zip(one, two, again):
        assert torch.equal(a, b) and torch.equal(b, c)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch,kv_heads", [(1, 1), (3, 1), (1, 5), (2, 4)])
def test_the_backward_shares_rows_between_its_passes_without_changing_the_bits(batch, kv_heads, dtype):
    """The backward runs the rows that share out evenly over the threads in one pass and the
    rest in two (each pair twice, every thread busy): with 1, 2 and 3 threads, 1, 3, 5 and 8
    rows split differently between the passes, and every output and gradient keeps its bits."""
    q, k, v = _inputs((batch, 2 * kv_heads, kv_heads, 150, 230, 48, 32), dtype, grad=True)
    one, two, three = (_run(q, k, v, qkv.causal(), threads=n) for n in (1, 2, 3))
    for a, b, c in zip(one, two, three):
        assert torch.equal(a, b) and torch.equal(a, c)


def test_results_do_not_depend_on_earlier_calls():
    """The kernel's scratch memory is a per-thread stack kept between calls, left as the last
    call wrote it: every shape, run after the others in two orders (the stack grows at
    different points), gives the same bits."""
    calls = [(shape, dtype) for shape in (*SHAPES, "wide") for dtype in (torch.float32, torch.bfloat16)]
    shapes = {**SHAPES, "wide": (1, 4, 1, 300, 700, 256, 256)}  # the largest tiles and scratch

    def run_all(order):
        return {c: _run(*_inputs(shapes[c[0]], c[1], grad=c[0] != "decode"), qkv.causal(), threads=2)
                for c in order}

    forward, backward = run_all(calls), run_all(calls[::-1])
    for c in calls:
        assert all(torch.equal(a, b) for a, b in zip(forward[c], backward[c])), c


def test_the_backwards_scratch_is_kept_between_calls_and_released_on_request():
    """The backward's packed operands (more than a thread's scratch stack) come from one block
    the process keeps between calls, so that their pages are not faulted in again: its size
    stays after the call, a release frees it, and the gradients are the same bits from the kept
    block, from a fresh one, and from malloc while another call holds it (two at once)."""
    from concurrent.futures import ThreadPoolExecutor

    from qkv.backends.native import kept_memory_bytes, release_kept_memory

    q, k, v = _inputs((1, 8, 4, 256, 256, 64, 64), grad=True)  # 4 rows: each row's thread sums its dQ
    # float32 per (row, query tile) of 2 x 64 rows: Q, dO, lse, lse_lo and delta; per (row, key
    # tile of 128): Kᵀ and Vᵀ, 64 rows 160 floats apart, and K; per thread (2), a row's dQ and a flag
    needed = 4 * (4 * 4 * 128 * (64 + 64 + 3) + 4 * 2 * (64 * 160 * 2 + 128 * 64) + 2 * (4 * 128 * 64 + 1))
    assert release_kept_memory() and kept_memory_bytes() == 0
    fresh = _run(q, k, v, qkv.causal(), threads=2)
    assert needed <= kept_memory_bytes() <= needed + 64
    kept = _run(q, k, v, qkv.causal(), threads=2)
    assert release_kept_memory() and kept_memory_bytes() == 0
    with ThreadPoolExecutor(2) as pool:  # the GIL is let go during the kernel's calls
        both = list(pool.map(lambda inputs: _outputs_and_grads(*inputs, qkv.causal()),
                             [_inputs((1, 8, 4, 256, 256, 64, 64), grad=True) for _ in range(2)]))
    for a, b, c, d in zip(fresh, kept, *both):
        assert torch.equal(a, b) and torch.equal(b, c) and torch.equal(c, d)
    check_gradients("native", (q, k, v), {"mask": qkv.causal()}, np.random.default_rng(0))


@pytest.mark.skipif(native.missing() is None and _native_isa() != "avx512bf16",
                    reason="the backward's bfloat16 products run on VDPBF16PS (avx512bf16) only")
def test_the_bfloat16_backward_packs_bfloat16_operands_for_its_products():
    """On VDPBF16PS the bfloat16 backward packs its operands as bfloat16, not float32: the kept
    block holds that layout's size (and the gradients meet the tolerance rule)."""
    from qkv.backends.native import kept_memory_bytes, release_kept_memory

    q, k, v = _inputs((1, 8, 4, 256, 256, 64, 64), dtype=torch.bfloat16, grad=True)
    # per (row, query tile) of 2 x 64 rows: Q, dO, Qᵀ and dOᵀ in bfloat16 (2 bytes) and lse,
    # lse_lo and delta in float32; per (row, key tile of 128): Kᵀ and Vᵀ in pairs along the
    # head dim and K in pairs of keys, bfloat16; per thread (2), a row's float32 dQ and a flag
    needed = 2 * 4 * 4 * 128 * 64 * 4 + 4 * 4 * 4 * 128 * 3 + 2 * 4 * 2 * 128 * 64 * 3 + 4 * 2 * (4 * 128 * 64 + 1)
    assert release_kept_memory()
    _run(q, k, v, qkv.causal(), threads=2)
    assert needed <= kept_memory_bytes() <= needed + 64
    check_gradients("native", (q, k, v), {"mask": qkv.causal()}, np.random.default_rng(0))


@pytest.mark.parametrize("D,Dv", [(1, 1), (40, 24), (80, 128), (256, 256)])
# on two threads, one row: a pass for dQ, one for dK and dV; four rows: one pass a row
@pytest.mark.parametrize("B,Hkv", [(1, 1), (2, 2)])
def test_bfloat16_gradients_at_every_head_dim(D, Dv, B, Hkv):
    """bfloat16 gradients against the oracle where the backward pads its bfloat16 operands
    (head dims to 4 and dQ's columns to 32, an odd count of query rows) and crosses tiles."""
    q, k, v = _inputs((B, 2 * Hkv, Hkv, 67, 150, D, Dv), dtype=torch.bfloat16, grad=True)
    check_gradients("native", (q, k, v), {"mask": qkv.causal()}, np.random.default_rng(D))


def test_measured_peak_memory_counts_the_kept_block(monkeypatch):
    """qkv bench's peak memory frees the kept block before the measured call, so the block
    counts as that call's growth; left kept, it was resident already and counted nothing."""
    from qkv import _memory
    from qkv.backends import native as native_module

    q, k, v = _inputs((1, 8, 8, 2048, 2048, 64, 64), grad=True)
    call = lambda: _run(q, k, v, None, threads=2)  # noqa: E731
    call()
    kept = native_module.kept_memory_bytes()
    _, released, how = _memory.peak_growth(call)
    if how != "peak resident set":
        pytest.skip("needs Linux's peak counters (native memory is not traced)")
    monkeypatch.setattr(native_module, "release_kept_memory", lambda: False)
    _, not_released, _ = _memory.peak_growth(call)
    assert kept > 16 * 2**20 and released - not_released >= kept / 2, (kept, released, not_released)


@pytest.mark.parametrize("shape", ["decode", "odd"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_output_without_lse_is_the_same(shape, dtype):
    """A call that does not ask for lse leaves it out of the kernel (lse=None) and gets the
    same output bits; the backend returns None for it."""
    q, k, v = _inputs(SHAPES[shape], dtype)
    out, lse = qkv.attention(q, k, v, qkv.causal(), backend="native", return_lse=True)
    assert torch.equal(qkv.attention(q, k, v, qkv.causal(), backend="native"), out)
    inp = inputs.prepare(q, k, v, qkv.causal())
    inp.needs_lse = False
    alone, no_lse = native.forward(inp)
    assert no_lse is None and torch.equal(alone, out)
    check_backend("native", (q, k, v), tuple(to64(x) for x in (q, k, v)), inputs.dtype_name(q), mask=qkv.causal())


def test_packed_values_are_counted_whole_tiles():
    """Where bfloat16 products run, the kernel packs Vᵀ of every key tile, the last one padded
    to a whole tile: 257 keys in tiles of 256 take two, 2 x 256 keys x 8 heads x 128 dims x 2
    bytes. explain counted 257 keys, rounded up to 288."""
    q, k = torch.zeros(1, 8, 4096, 128, dtype=torch.bfloat16), torch.zeros(1, 8, 257, 128, dtype=torch.bfloat16)
    inp = inputs.prepare(q, k, k)
    if not native.on_bf16_products(inp):
        pytest.skip("no bfloat16 products here (AMX or AVX-512 BF16): nothing is packed")
    assert native.block_sizes(inp)[1] == 256
    assert native._packed_bytes(inp) == 2 * 256 * 8 * 128 * 2


@pytest.mark.parametrize("shape", ["one_head_per_kv", "square"])
@pytest.mark.parametrize("mask", [None, "causal"])
def test_tile_sizes_by_call(shape, mask):
    """Unmasked bfloat16 takes the larger tiles where its products are bfloat16 ones (AMX or
    VDPBF16PS: about 128 queries over the group's heads, 256 keys), else on the FMA units 64
    queries and 256 keys; masked calls 64 x 128. All agree with the float64 oracle."""
    from qkv.backends.native import BF16_PRODUCT_BLOCK_K, BF16_PRODUCT_QUERIES, BLOCK_K, BLOCK_Q, UNMASKED_BLOCK_K

    m = None if mask is None else qkv.causal()
    q, k, v = _inputs(SHAPES[shape], torch.bfloat16)
    inp = inputs.prepare(q, k, v, m)
    large = mask is None and _native_isa() in ("amx", "avx512bf16")
    want = (BF16_PRODUCT_QUERIES // inp.group, BF16_PRODUCT_BLOCK_K) if large else \
        (BLOCK_Q, UNMASKED_BLOCK_K if mask is None else BLOCK_K)
    assert native.block_sizes(inp) == want
    check_backend("native", (q, k, v), tuple(to64(x) for x in (q, k, v)), "bfloat16", mask=m)


def test_numpy_arrays_and_strided_tensors(rng):
    q, k, v = (rng.standard_normal((2, 3, n, 32)).astype(np.float32) for n in (50, 70, 70))
    want = qkv.attention(q, k, v, qkv.causal(), backend="reference")
    got = qkv.attention(q, k, v, qkv.causal(), backend="native")
    assert isinstance(got, np.ndarray) and got.dtype == np.float32
    assert_within_rule(got, qkv.attention(*(x.astype(np.float64) for x in (q, k, v)), qkv.causal(),
                                          backend="reference"), want, "float32")
    # (B, L, H, D) storage viewed as (B, H, L, D): strided, not copied
    tq, tk, tv = (torch.from_numpy(np.ascontiguousarray(x.transpose(0, 2, 1, 3))).transpose(1, 2) for x in (q, k, v))
    assert not tq.is_contiguous()
    np.testing.assert_array_equal(qkv.attention(tq, tk, tv, qkv.causal(), backend="native").numpy(), got)


def test_read_only_arrays(rng):
    """Read-only inputs (broadcast views, frozen arrays, a bias broadcast over batch rows) are read in place."""
    q, k, v = (rng.standard_normal((2, 3, n, 16)).astype(np.float32) for n in (20, 30, 30))
    bias = rng.standard_normal((2, 3, 20, 30)).astype(np.float32)
    shared_query = np.broadcast_to(q[:, :, :1], q.shape)  # stride 0 along Lq, read-only
    for x in (k, v, bias):
        x.flags.writeable = False
    got = qkv.attention(shared_query, k, v, bias, backend="native")
    want = qkv.attention(shared_query, k, v, bias, backend="reference")
    want64 = qkv.attention(*(x.astype(np.float64) for x in (shared_query, k, v, bias)), backend="reference")
    assert_within_rule(got, want64, want, "float32")


def test_strides_that_are_not_whole_elements_go_elsewhere(rng):
    """A float field of a structured array (6-byte strides) is refused by name, and the
    automatic choice runs it on a backend that reads it."""
    fields = np.zeros((1, 2, 9, 16), dtype=[("tag", np.int16), ("x", np.float32)])
    fields["x"] = rng.standard_normal(fields.shape)
    k = fields["x"]  # (1, 2, 9, 16) float32 view, last stride 6 bytes
    q = rng.standard_normal((1, 2, 5, 16)).astype(np.float32)
    with pytest.raises(qkv.BackendError, match="strides that are not whole elements"):
        qkv.attention(q, k, k, backend="native")
    assert qkv.explain(q, k, k).backend != "native"
    want = qkv.attention(*(x.astype(np.float64) for x in (q, k, k)), backend="reference")
    assert_within_rule(qkv.attention(q, k, k), want, qkv.attention(q, k, k, backend="reference"), "float32")


def test_the_amx_switch_takes_a_bool_only():
    """A truthy int or string used to reach the binding, failing every native call after it."""
    native = dispatch.REGISTRY["native"]
    for value in (1, "yes", None):
        with pytest.raises(TypeError, match="float32_on_amx must be a bool"):
            native.float32_on_amx = value
    assert native.float32_on_amx is False
    native.float32_on_amx = np.False_
    assert native.float32_on_amx is False


def test_a_bias_whose_strides_are_not_whole_elements_goes_elsewhere(rng):
    """The same for a float mask (an additive bias) taken from a structured array: it used to
    reach the binding, which refused it with its own signature dump."""
    fields = np.zeros((1, 2, 5, 9), dtype=[("bias", np.float32), ("tag", np.int8)])
    fields["bias"] = rng.standard_normal(fields.shape)
    bias = fields["bias"]  # 5-byte strides
    q, k = (rng.standard_normal((1, 2, n, 16)).astype(np.float32) for n in (5, 9))
    with pytest.raises(qkv.BackendError, match="strides that are not whole elements"):
        qkv.attention(q, k, k, bias, backend="native")
    assert qkv.explain(q, k, k, bias).backend != "native"
    want = qkv.attention(*(x.astype(np.float64) for x in (q, k, k, bias)), backend="reference")
    assert_within_rule(qkv.attention(q, k, k, bias), want, qkv.attention(q, k, k, bias, backend="reference"),
                       "float32")


SCRIPT = """
import itertools, numpy as np, torch, qkv
from qkv.backends import native
rng = np.random.default_rng(0)
q, k, v = (rng.standard_normal((1, 2, n, 48)).astype(np.float32) for n in (37, 300, 300))
got = qkv.attention(q, k, v, qkv.window(20), backend="native")
want = qkv.attention(*(x.astype(np.float64) for x in (q, k, v)), qkv.window(20), backend="reference")
errors = [np.abs(got - want).max()]
# decoding steps (6 and 2 stacked queries over one KV head), float32 and bfloat16
for hq in (6, 2):
    q, k, v = (rng.standard_normal(s) for s in ((1, hq, 1, 48), (1, 1, 300, 48), (1, 1, 300, 80)))
    for dtype, tolerance in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
        q_, k_, v_ = (torch.from_numpy(x).to(dtype) for x in (q, k, v))
        got = qkv.attention(q_, k_, v_, backend="native").double()
        want = qkv.attention(*(x.double() for x in (q_, k_, v_)), backend="reference")
        errors.append((got - want).abs().max().item() / tolerance * 1e-5)
# bfloat16 on the tiles (its products on AMX or VDPBF16PS where the path has them), unmasked
# and windowed: the output, and the float32 lse
q, k, v = (torch.from_numpy(rng.standard_normal((1, 4, n, 64))).to(torch.bfloat16) for n in (100, 300, 300))
for mask in (None, qkv.window(20)):
    got, lse = qkv.attention(q, k, v, mask, backend="native", return_lse=True)
    want, want_lse = qkv.attention(*(x.double() for x in (q, k, v)), mask, backend="reference", return_lse=True)
    errors.append((got.double() - want).abs().max().item() / 1e-2 * 1e-5)
    errors.append((lse.double() - want_lse).abs().max().item())
# a NaN query row gives NaN out and lse on the decoding path and on the tiles, and only there
torch.manual_seed(0)
nan_propagates = True
cases = ((1, 300, None), (40, 300, None), (3, 3, qkv.causal()))  # causal: row 0 sees one key
for (lq, lk, mask), dtype in itertools.product(cases, (torch.float32, torch.bfloat16)):
    q, k, v = (torch.randn(1, 2, n, 48).to(dtype) for n in (lq, lk, lk))
    q[0, 1, 0, 0] = float("nan")
    out, lse = qkv.attention(q, k, v, mask, backend="native", return_lse=True)
    nan_propagates &= bool(out[0, 1, 0].isnan().all() and lse[0, 1, 0].isnan() and not out[0, 0].isnan().any())
print(native._native.isa(), float(max(errors)), nan_propagates)
"""


def _run_script(code, env=None):
    """stdout of `python -c code`, which must succeed."""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


ISA_ORDER = ["generic", "avx2", "avx512", "avx512bf16", "amx"]


@pytest.mark.parametrize("isa", ["generic", "avx2", "avx512", "avx512bf16"])
def test_every_instruction_set_variant(isa):
    """A masked forward, bfloat16 on the tiles, decoding steps (both dtypes) and NaN propagation on
    each instruction set's kernel.

    QKV_ISA never raises the kernel above what the CPU has: on a CPU without AVX-512, asking for it
    runs (and so checks) the best path the CPU has."""
    unforced = {name: value for name, value in os.environ.items() if name != "QKV_ISA"}
    best = _run_script("from qkv import _native; print(_native.isa())", env=unforced).strip()
    chosen, err, nan_propagates = _run_script(SCRIPT, env={**unforced, "QKV_ISA": isa}).split()
    assert chosen == min(isa, best, key=ISA_ORDER.index)
    assert float(err) < 1e-5  # bfloat16 errors scaled to the float32 tolerance
    assert nan_propagates == "True"


# The kernel's numerical tests, run again on each instruction set below the best one here (the
# suite's own run checks that one). Left out: tests of the process (forks, threads, peak memory,
# imports, the instruction-set choice itself, this test), which do not depend on the variant.
KERNEL_TEST_FILES = ["test_native.py", "test_gradients.py", "test_tiles.py", "test_many_tiles.py",
                     "test_correctness.py", "test_masks.py", "test_properties.py"]
PROCESS_TESTS = ("forked", "peak_memory", "instruction_set", "isa_request", "without_the_native", "torch_threads")


@pytest.mark.parametrize("isa", ["generic", "avx2", "avx512"])
def test_the_kernel_tests_pass_on_each_lower_instruction_set(isa):
    """Gradients, tiles, masks, strides and the randomized differential test on each variant's
    own code (vector width, FMA or bfloat16 products): the smoke test above covers only a few."""
    unforced = {name: value for name, value in os.environ.items() if name != "QKV_ISA"}
    best = _run_script("from qkv import _native; print(_native.isa())", env=unforced).strip()
    if ISA_ORDER.index(isa) >= ISA_ORDER.index(best):
        pytest.skip(f"{isa} is not below this CPU's best kernel ({best}), which the suite runs")
    selection = f"native and not ({' or '.join(PROCESS_TESTS)})"
    tests = os.path.dirname(__file__)
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", selection,
                           *KERNEL_TEST_FILES], cwd=tests, capture_output=True, text=True, timeout=600,
                          env={**unforced, "QKV_ISA": isa})
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    summary = done.stdout.strip().splitlines()[-1]
    assert int(summary.split(" passed")[0].split()[-1]) >= 400, summary  # the selection is what it was


@pytest.mark.parametrize("asked, runs, warning", [
    (" Generic", "generic", None),  # any case, spaces ignored
    ("gen eric", "generic", None),  # inside the name too, as the kernel reads it (Python used to warn)
    ("garbage", None, "QKV_ISA='garbage' is not one of generic, avx2, avx512, avx512bf16; the native kernel runs"),
])
def test_an_isa_request_is_read_loosely_and_a_bad_one_is_named(asked, runs, warning):
    code = "import warnings; warnings.simplefilter('always'); import qkv; from qkv import _native; print(_native.isa())"
    unforced = {name: value for name, value in os.environ.items() if name != "QKV_ISA"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**unforced, "QKV_ISA": asked})
    assert done.returncode == 0, done.stderr
    if runs:
        assert done.stdout.strip() == runs and "QKV_ISA" not in done.stderr
    else:
        assert warning in done.stderr


@pytest.mark.parametrize("threads", ["0", "-3", "99999999999"])
def test_thread_counts_out_of_range_are_named_and_ignored(threads):
    code = "import warnings; warnings.simplefilter('always'); from qkv import dispatch; " \
           "print(dispatch.REGISTRY['native'].num_threads)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "QKV_NUM_THREADS": threads})
    assert done.returncode == 0, done.stderr
    assert f"QKV_NUM_THREADS='{threads}' is not an integer from 1 to 1024" in done.stderr
    assert int(done.stdout) == available_cpus()


def test_info_says_how_the_kernel_runs(capsys):
    from qkv import _native, cli

    assert cli.main(["info"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.split()[:1] == ["native"])
    assert line.split(None, 1)[1] == f"available: {_native.isa()} instructions, {native.num_threads} threads " \
                                     f"({_native.threading()})"
    assert _native.threading() in ("openmp", "own pool")


THREADS_OF = """
import os, numpy as np
from qkv import dispatch
native = dispatch.REGISTRY["native"]
native.num_threads = 2
x = np.random.default_rng(0).standard_normal((1, 8, 512, 64)).astype(np.float32)  # 2^28 multiply-adds
threads = lambda: len(os.listdir("/proc/self/task"))
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
@pytest.mark.parametrize("first", ["torch", "qkv"])
def test_kernel_runs_on_torch_threads(first):
    """Built with OpenMP, the kernel runs on the threads torch's own operations run on (one
    libgomp per process, whichever imports first), not on a pool of its own that would compete
    with them for the CPUs: a call adds no thread."""
    from qkv import _native

    if _native.threading() != "openmp":
        pytest.skip("the kernel is built without OpenMP")
    imports = "import torch, qkv" if first == "torch" else "import qkv, torch"
    out = _run_script(f"{imports}\n{THREADS_OF}\ntorch.set_num_threads(2)\n"
                      "torch.randn(512, 512) @ torch.randn(512, 512)\nbefore = threads()\n"
                      "qkv.attention(x, x, x, backend='native')\n"
                      "print(before, threads(), qkv._native.threading())")
    before, after, threading = out.split()
    assert int(before) >= 2 and after == before and threading == "openmp"


def test_forked_child_runs_the_kernel():
    """A child forked after the parent ran the kernel on two threads gets the same bits (an
    OpenMP child would wait on the parent's threads, which it does not have)."""
    out = _run_script(f"""import qkv, signal\n{THREADS_OF}
want = qkv.attention(x, x, x, backend="native")
pid = os.fork()
if pid == 0:
    signal.alarm(60)  # a hung child ends, failing the test
    got = qkv.attention(x, x, x, backend="native")
    os._exit(0 if np.array_equal(got, want) and qkv._native.threading() == "own pool" else 3)
print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
""")
    assert out.split() == ["0"]


def test_a_child_forked_while_another_thread_holds_the_kept_block_runs_the_backward():
    """fork() while a backward on another thread holds the kept scratch block: in the child the
    block stays held by a thread it lacks, so the child's backward takes memory from malloc,
    and gets the parent's bits. (fork() also takes the block's lock first, so a child is never
    forked holding it; that window is too short for a test to hit.)"""
    out = _run_script("""import os, signal, threading, time, torch, qkv
from qkv.backends.native import release_kept_memory
def grads(L):
    q, k, v = (torch.randn(1, 8, L, 64, generator=torch.Generator().manual_seed(i), requires_grad=True) for i in range(3))
    qkv.attention(q, k, v, backend="native").sum().backward()
    return torch.cat([q.grad, k.grad, v.grad])
want = grads(256)
busy = threading.Thread(target=grads, args=(4096,))
busy.start()
while release_kept_memory() and busy.is_alive():  # True: nobody holds the block yet
    time.sleep(0.002)
held = busy.is_alive()
pid = os.fork()
if pid == 0:
    signal.alarm(60)  # a hung child ends, failing the test
    torch.set_num_threads(1)  # torch's own operations would wait on OpenMP threads the child lacks
    os._exit(0 if torch.equal(grads(256), want) else 3)
busy.join()
print(held, os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
""")
    assert out.split() == ["True", "0"]


class _ThreadsAroundACall:
    """A dataset of one item: the threads of the process before and after a native call, and its output."""

    def __init__(self, x):
        self.x = x

    def __len__(self):
        return 1

    def __getitem__(self, i):
        threads = lambda: len(os.listdir("/proc/self/task"))  # noqa: E731
        before = threads()
        out = qkv.attention(self.x, self.x, self.x, backend="native")
        return before, threads(), out


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
def test_data_loader_workers_keep_to_torch_threads(monkeypatch):
    """torch gives each DataLoader worker one thread, so that workers do not fight over the
    CPUs: the kernel keeps to it there (it used to start num_threads in each), with the bits
    it gives in the parent."""
    torch = pytest.importorskip("torch")
    from torch.utils.data import DataLoader

    monkeypatch.setattr(dispatch.REGISTRY["native"], "num_threads", 2)
    x = torch.randn(1, 8, 512, 64)  # 2^28 multiply-adds: two threads where they may run
    (before, after, out), = DataLoader(_ThreadsAroundACall(x), num_workers=1, batch_size=None)
    assert after == before
    assert torch.equal(out, qkv.attention(x, x, x, backend="native"))


def test_qkv_works_and_says_why_without_the_native_module():
    code = ("import sys; sys.modules['qkv._native'] = None\n"
            "import numpy as np, qkv\nfrom qkv import cli\n"
            "q = np.ones((1, 4, 8), np.float32)\n"
            "print(qkv.explain(q, q, q).backend)\ncli.main(['info'])")
    out = _run_script(code)
    assert out.splitlines()[0] == "numpy"
    assert "native     unavailable: the native kernel is not built: no C++17 compiler or no Python headers were found" in out


@st.composite
def problems(draw):
    B, Hkv, G = draw(st.integers(1, 2)), draw(st.integers(1, 2)), draw(st.sampled_from([1, 2, 3]))
    Lq, Lk = draw(st.integers(0, 150)), draw(st.integers(0, 300))
    D, Dv = draw(st.sampled_from([1, 5, 16, 33, 64, 96, 128, 256])), draw(st.sampled_from([1, 8, 17, 64, 130]))
    dtype = draw(st.sampled_from(["float32", "bfloat16"]))
    layout = draw(st.sampled_from(["contiguous", "transposed", "sliced"]))
    mask = draw(st.sampled_from([None, "causal", "top_left", "window", "padding", "document", "mask_fn", "dense"]))
    mod = draw(st.sampled_from([None, "alibi", "softcap", "bias"]))
    unit = draw(st.sampled_from(["amx", "fma"]))  # of float32 products
    scale = draw(st.sampled_from([None, 0.3, -0.7, 1e-3]))
    return B, Hkv, G, Lq, Lk, D, Dv, dtype, layout, mask, mod, unit, scale, draw(st.integers(0, 2**31))


def _strided(x, layout):
    if layout == "transposed":  # stored (B, L, H, D)
        return x.transpose(1, 2).contiguous().transpose(1, 2)
    if layout == "sliced":  # every other element of a wider last dim
        wide = torch.zeros(*x.shape[:-1], 2 * x.shape[-1], dtype=x.dtype)
        wide[..., ::2] = x
        return wide[..., ::2]
    return x


@settings(max_examples=60)
@given(problems())
@pytest.mark.filterwarnings("ignore:grad and param do not obey the gradient layout contract")  # empty inputs
def test_randomized_differential(problem):
    B, Hkv, G, Lq, Lk, D, Dv, dtype, layout, mask, mod, unit, scale, seed = problem
    rng = np.random.default_rng(seed)
    Hq = Hkv * G
    arrays64 = [rng.standard_normal(s) for s in ((B, Hq, Lq, D), (B, Hkv, Lk, D), (B, Hkv, Lk, Dv))]
    tensors = [_strided(torch.tensor(a).to(getattr(torch, dtype)), layout) for a in arrays64]
    arrays64 = [to64(t) for t in tensors]  # the values the kernel sees
    masks = {None: None, "causal": qkv.causal(), "top_left": qkv.causal(align="top_left"),
             "window": qkv.window(int(rng.integers(0, 20)), int(rng.integers(0, 5))),
             "padding": qkv.padding(rng.integers(0, Lk + 1, B), q_lengths=rng.integers(0, Lq + 1, B)),
             "document": qkv.document(np.sort(rng.integers(0, 3, (B, Lq))), np.sort(rng.integers(0, 3, (B, Lk)))),
             "mask_fn": qkv.mask_fn(lambda b, h, i, j: (i * 7 + j * 3 + h) % 5 != 0),
             "dense": qkv.dense_mask(rng.random((B, 1, Lq, Lk)) < 0.6)}
    kwargs = {"mask": masks[mask], "scale": scale}
    if mod == "alibi":
        kwargs["score_mod"] = qkv.alibi(rng.random(Hq))
    elif mod == "softcap":
        kwargs["score_mod"] = qkv.softcap(float(rng.uniform(0.5, 5)))
    elif mod == "bias" and mask is None:
        bias = rng.standard_normal((1, Hq, Lq, Lk))
        kwargs["mask"] = torch.tensor(bias).to(getattr(torch, dtype))
    with float32_products(unit, skip_repeat=False):
        got, lse = qkv.attention(*tensors, backend="native", return_lse=True, **kwargs)
    kw64 = dict(kwargs)
    if torch.is_tensor(kwargs["mask"]):
        kw64["mask"] = to64(kwargs["mask"])
    want, want_lse = qkv.attention(*arrays64, backend="reference", return_lse=True, **kw64)
    ref, ref_lse = qkv.attention(*tensors, backend="reference", return_lse=True, **kwargs)
    assert_within_rule(got, want, ref, dtype)
    assert_within_rule(lse, want_lse, ref_lse, "float32", "lse")
    # the backward too, from the same strided layout (the views keep their gradients)
    views = [_strided(t.detach().contiguous().requires_grad_(True), layout) for t in tensors]
    for view in views:
        view.retain_grad()
    check_gradients("native", views, kwargs, rng)


@pytest.mark.parametrize("mask", [None, qkv.causal()])
def test_key_splits_merge_into_their_own_query_tile(rng, mask):
    """Few rows, many keys and several query tiles: every tile's key splits merge into it."""
    q64, k64, v64 = (rng.standard_normal(s) for s in ((1, 2, 200, 32), (1, 1, 3000, 32), (1, 1, 3000, 32)))
    arrays = [x.astype(np.float32) for x in (q64, k64, v64)]
    got = qkv.attention(*arrays, mask, backend="native")
    oracle = qkv.attention(*(to64(x) for x in arrays), mask, backend="reference")  # of the rounded inputs
    assert_within_rule(got, oracle, qkv.attention(*arrays, mask, backend="reference"), "float32")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("mask", [None, "padding", "window", "alibi"])
@pytest.mark.parametrize("lq,hq,hkv", [(1, 32, 8), (2, 4, 1), (1, 3, 3), (3, 2, 1), (3, 1, 1), (5, 2, 1), (4, 8, 1)])
# with vectors of 16: 48 = a pair block of 32 and a last 16; 80 = four vectors and one; 32: two
@pytest.mark.parametrize("d,dv", [(64, 128), (48, 80), (96, 32)])
def test_decoding_path(rng, mask, lq, hq, hkv, dtype, d, dv):
    """Few stacked queries (the decoding path, key splits merged by lse, bfloat16 rows widened
    as they are read; bfloat16 up to 32 stacked queries, float32 up to 8, more on the tiles)
    against the reference; float32 as NumPy arrays, bfloat16 as tensors."""
    q64, k64, v64 = (rng.standard_normal(s) for s in ((2, hq, lq, d), (2, hkv, 3000, d), (2, hkv, 3000, dv)))
    kwargs = {"padding": {"mask": qkv.padding([3000, 1234])}, "window": {"mask": qkv.window(700)},
              "alibi": {"score_mod": qkv.alibi(rng.random(hq) * 0.01)}, None: {}}[mask]
    if dtype == "float32":
        arrays = [x.astype(np.float32) for x in (q64, k64, v64)]
    else:
        arrays = [torch.from_numpy(x).to(torch.bfloat16) for x in (q64, k64, v64)]
    assert not native.on_bf16_products(inputs.prepare(*arrays, **kwargs))  # the FMA units' decoding path
    got = qkv.attention(*arrays, backend="native", **kwargs)
    want = qkv.attention(*(to64(x) for x in arrays), backend="reference", **kwargs)  # of the rounded inputs
    assert_within_rule(got, want, qkv.attention(*arrays, backend="reference", **kwargs), dtype)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("lk", [1027, 1030, 2049, 600])
@pytest.mark.parametrize("hq,dv", [(4, 128), (1, 64), (3, 32), (2, 16)])
def test_decoding_reads_key_tiles_in_streams(rng, dtype, lk, hq, dv):
    """Up to four stacked queries and value rows the values pass takes whole: the decoding path
    reads a key tile as four runs side by side, the keys past four whole runs in order (last
    tiles of 3, 6, 1 and 88 keys), in the scores and the values pass."""
    from qkv.backends.native import DECODING_BLOCK_K

    q64, k64, v64 = (rng.standard_normal(s) for s in ((1, hq, 1, 64), (1, 1, lk, 64), (1, 1, lk, dv)))
    if dtype == "float32":
        arrays = [x.astype(np.float32) for x in (q64, k64, v64)]
    else:
        arrays = [torch.from_numpy(x).to(torch.bfloat16) for x in (q64, k64, v64)]
    assert native.block_sizes(inputs.prepare(*arrays)) == (1, DECODING_BLOCK_K)
    got = qkv.attention(*arrays, backend="native")
    want = qkv.attention(*(to64(x) for x in arrays), backend="reference")  # of the rounded inputs
    assert_within_rule(got, want, qkv.attention(*arrays, backend="reference"), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nan_propagates_on_the_decoding_path(dtype):
    """A NaN query, or a NaN in any one key, makes the output and lse NaN on the few-queries
    path (a NaN tile maximum failed a comparison there, and the tile was left out as masked)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, n, 64, generator=g).to(dtype) for n in (1, 3000, 3000))
    assert not native.on_bf16_products(inputs.prepare(q, k, v))  # the decoding path, on the vector units
    with_nan = q.clone()
    with_nan[0, 0, 0, 3] = float("nan")
    out, lse = qkv.attention(with_nan, k, v, backend="native", return_lse=True)
    assert torch.isnan(out).all() and torch.isnan(lse).all()
    # one allowed key: the NaN lane is followed by -inf (masked and padding keys) in the max
    out, lse = qkv.attention(with_nan, k, v, qkv.padding([1]), backend="native", return_lse=True)
    assert torch.isnan(out).all() and torch.isnan(lse).all()
    lost = []
    for key in range(k.shape[2]):  # the lane where NaN survived the max depends on the position
        with_nan = k.clone()
        with_nan[0, 0, key, 5] = float("nan")
        out, lse = qkv.attention(q, with_nan, v, backend="native", return_lse=True)
        if not (torch.isnan(out).all() and torch.isnan(lse).all()):
            lost.append(key)
    assert lost == []


@pytest.mark.parametrize("q_dtype, grads", [(torch.float32, (torch.bfloat16,) * 3),
                                            (torch.bfloat16, (torch.float32, torch.bfloat16, torch.float32))])
def test_the_backward_writes_gradients_only_in_qs_dtype_or_float32(q_dtype, grads):
    from qkv.backends.native import _native

    q = torch.randn(1, 1, 8, 4).to(q_dtype)
    rows = torch.zeros(1, 1, 8)
    with pytest.raises(ValueError, match="dq, dk and dv must have one dtype: q's, or float32"):
        _native.backward(q, q, q, q, rows, rows, *(torch.empty(1, 1, 8, 4, dtype=g) for g in grads), 0.5,
                         64, 128, 1, None, None, None, None, None, None, 0.0, None)


def test_sizes_beyond_the_kernels_int_range_are_refused():
    """Keys of stride 0 (no memory) past 2^31 - 1024: the kernel counts sizes in int, so the
    backend refuses them by name and the binding refuses them too (both wrapped before)."""
    from qkv.backends.native import MAX_SIZE, _native

    q = np.ones((1, 1, 1, 8), np.float32)
    k = np.broadcast_to(np.ones(8, np.float32), (1, 1, MAX_SIZE + 1, 8))
    with pytest.raises(dispatch.BackendError, match=r"a size above 2147482624 \(the kernel counts in 32-bit ints\)"):
        qkv.attention(q, k, k, backend="native")
    assert native.unsupported(inputs.prepare(q, k[:, :, :MAX_SIZE], k[:, :, :MAX_SIZE])) == []
    with pytest.raises(ValueError, match=r"a size above 2\^31 - 1024"):
        _native.forward(q, k, k, np.empty((1, 1, 1, 8), np.float32), None, 1.0, 64, 128, 1,
                        None, None, None, None, None, None, 0.0, None)


def test_the_output_is_written_in_q_dtype_or_float32():
    from qkv.backends.native import _native

    q = np.zeros((1, 1, 4, 8), np.float32)
    with pytest.raises(ValueError, match="out must have a dtype: q's, or float32"):
        _native.forward(q, q, q, np.empty((1, 1, 4, 8), np.float64), None, 1.0, 64, 128, 1,
                        None, None, None, None, None, None, 0.0, None)


def test_a_lazily_negated_view_is_read_with_its_sign():
    """torch's negative bit (a lazy negation) does not travel through DLPack: it is applied first."""
    q, k, v = _inputs(SHAPES["odd"])
    negated = torch._neg_view(q)
    assert negated.is_neg()
    want = qkv.attention(-q, k, v, backend="native")
    assert torch.equal(qkv.attention(negated, k, v, backend="native"), want)
    assert torch.equal(qkv.attention(q, torch._neg_view(k), v, backend="native"),
                       qkv.attention(q, -k, v, backend="native"))


@pytest.mark.parametrize("backend", ["native", "reference"])
def test_a_lazily_negated_bias_is_read_with_its_sign(backend):
    q, k, v = _inputs(SHAPES["odd"])
    bias = torch.randn(q.shape[-2], k.shape[-2], generator=torch.Generator().manual_seed(2))
    negated = torch._neg_view(bias)
    assert negated.is_neg()
    assert torch.equal(qkv.attention(q, k, v, negated, backend=backend), qkv.attention(q, k, v, -bias, backend=backend))


@pytest.mark.parametrize("lq,d,dv,seed,scale", [(4, 256, 3, 1, None), (1, 256, 1, 10, None),
                                                (9, 64, 8, 8, 0.3), (9, 64, 8, 11, 0.3)])
def test_head_dims_sum_in_chains(lq, d, dv, seed, scale):
    """The scores' products are summed in chains of 32, each from zero. In one chain along the
    head dim the lse was off by 1.3e-5 where the rule allows 5.4e-6 (D = 256, 4 queries), by
    7.7e-6 against 2.1e-6 (one query), and the output of 9 queries of D = 64 by 1.1e-5 against
    6.7e-6 (seed 8) and 1.4e-5 against 9.5e-6 (seed 11)."""
    rng = np.random.default_rng(seed)
    shapes = (1, 1, lq, d), (1, 1, 122 if d == 256 else 300, d)
    q, k = ((rng.standard_normal(s) * 3).astype(np.float32) for s in shapes)
    v = (rng.standard_normal((1, 1, k.shape[2], dv)) * (3 if d == 256 else 1)).astype(np.float32)
    check_backend("native", [q, k, v], [to64(x) for x in (q, k, v)], "float32", scale=scale)


@pytest.mark.parametrize("left", range(6))
@pytest.mark.parametrize("one_vector_of_queries", [True, False])  # 16 queries: a last column block of one vector
def test_chains_in_registers_cover_every_last_block(one_vector_of_queries, left):
    """On AVX-512 a product's chains keep their total in registers, in blocks of 6 rows x 2
    vectors. Keys 12 + left make the forward's last block of scores `left` rows, queries 18 +
    left the backward's; D = 72 sums chains of 32, 32 and 8. Output, lse and gradients against
    float64 (leaving out the last one-row block passed every other test in the suite)."""
    rng = np.random.default_rng(left)
    lq = 16 if one_vector_of_queries else 18 + left
    q, k, v = (torch.tensor(rng.standard_normal(s), dtype=torch.float32, requires_grad=True)
               for s in ((1, 2, lq, 72), (1, 2, 12 + left, 72), (1, 2, 12 + left, 72)))
    with torch.no_grad():
        check_backend("native", [q, k, v], [to64(x) for x in (q, k, v)], "float32")
    check_gradients("native", (q, k, v), {}, rng)


@pytest.mark.parametrize("lq,lk,d,seed,scale", [(1, 2, 256, 0, -0.7), (4, 122, 256, 1, None), (1, 122, 256, 10, None)])
def test_bfloat16_products_sum_in_chains(lq, lk, d, seed, scale):
    """bfloat16 scores from bfloat16 products (AMX or VDPBF16PS where they run) are summed in
    chains of 32 too: VDPBF16PS in one chain along a head dim of 256 put the float32 lse 2.5e-6
    off where the rule allows 2.3e-6 (the first case, found by test_randomized_differential)."""
    rng = np.random.default_rng(seed)
    shapes = (1, 1, lq, d), (1, 1, lk, d), (1, 1, lk, 1)
    q, k, v = (torch.tensor(rng.standard_normal(s) * (1 if scale else 3)).to(torch.bfloat16) for s in shapes)
    check_backend("native", (q, k, v), tuple(to64(x) for x in (q, k, v)), "bfloat16", scale=scale)


@pytest.mark.parametrize("scale", [0.125, -0.125])
def test_one_allowed_key_gives_its_score_as_lse_without_bias(scale):
    """With one key, lse is that key's score. The degree-5 exp of the bfloat16 products' path
    took 2^0 as 0.99999988, which moved every lse by -1.2e-7; averaged over 512 rows of
    scores below 0.25 the rounding cancels out, and that bias would not."""
    rng = np.random.default_rng(0)
    q, k = (torch.tensor(rng.standard_normal(s) / 4).to(torch.bfloat16) for s in ((1, 1, 512, 64), (1, 1, 1, 64)))
    _, lse = qkv.attention(q, k, k, backend="native", return_lse=True, scale=scale)
    scores = (to64(q) @ to64(k).swapaxes(-1, -2))[..., 0] * scale
    assert abs(np.mean(to64(lse) - scores)) < 3e-8


@pytest.mark.parametrize("seed", [13, 29])
def test_large_bfloat16_scores_keep_the_lse(seed):
    """ALiBi takes these scores to about -120, where a float32 ulp is 7.6e-6. The bfloat16
    products' softmax took exp(s - m) as 2^(s·log2(e) - m·log2(e)), rounding m·log2(e) on its
    own, which put the lse past the rule (in a drawn case 1.2e-5 off where it allows 8.4e-6);
    the difference is now taken first, as the float32 path takes it."""
    rng = np.random.default_rng(seed)
    shapes = (1, 2, 2, 16), (1, 2, 137, 16), (1, 2, 137, 1)
    q, k, v = (torch.tensor(rng.standard_normal(s)).to(torch.bfloat16) for s in shapes)
    check_backend("native", (q, k, v), tuple(to64(x) for x in (q, k, v)), "bfloat16",
                  mask=qkv.causal(align="top_left"), score_mod=qkv.alibi(rng.random(2)))


@pytest.mark.parametrize("scale", [0.0, -0.3])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_scale_of_zero_or_below_with_a_mask(scale, dtype):
    """Masked keys stay out and the largest scaled score leads for any scale. 64 queries a KV
    head: bfloat16 takes the AMX tiles where they run, whose softmax folds the scale in."""
    q, k, v = _inputs((1, 2, 1, 64, 300, 64, 64), getattr(torch, dtype))
    check_backend("native", (q, k, v), tuple(to64(x) for x in (q, k, v)), dtype, mask=qkv.causal(), scale=scale)


def test_many_equal_weights_sum_within_the_rule():
    """ALiBi then softcap(2) saturate most scores of a row at about -2: some hundred equal
    weights, whose sum over a tile's keys drifted in one running float32 sum per query (lse
    off by 3.1e-6 against a bound of 2.7e-6); four interleaved sums keep it within the rule."""
    torch = pytest.importorskip("torch")
    torch.manual_seed(39)
    arrays = [torch.randn(2, 2, 129, 8), torch.randn(2, 2, 129, 8), torch.randn(2, 2, 129, 16)]
    mods = [qkv.alibi(torch.rand(2).numpy()), qkv.softcap(2.0)]
    check_backend("native", arrays, [to64(a) for a in arrays], "float32", score_mod=mods)


def test_explain_counts_the_threads_a_data_loader_worker_runs(monkeypatch):
    """In a DataLoader worker the kernel keeps to torch's one thread, and explain's estimate
    holds one thread's tiles, not num_threads'."""
    torch = pytest.importorskip("torch")
    from qkv.backends import native as native_module

    monkeypatch.setattr(dispatch.REGISTRY["native"], "num_threads", 4)
    q = torch.randn(1, 8, 512, 64)
    everywhere = qkv.explain(q, q, q, backend="native").workspace_bytes
    monkeypatch.setattr(native_module, "in_data_loader_worker", lambda: True)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert dispatch.REGISTRY["native"].call_threads() == 1
    assert qkv.explain(q, q, q, backend="native").workspace_bytes < everywhere


def test_fake_tensors_are_left_to_the_torch_backend():
    """A FakeTensor (torch.compile's tracing, shape inference) holds no memory: the native kernel
    read its data pointer and crashed the process. It is refused there, and the torch backend,
    which works on fake tensors, runs instead."""
    torch = pytest.importorskip("torch")
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.randn(1, 2, 8, 4)
        report = qkv.explain(x, x, x, qkv.causal())
        out = qkv.attention(x, x, x, qkv.causal())
    assert report.backend == "torch"
    assert "a tensor subclass (FakeTensor) whose memory the kernel cannot read" in str(report)
    assert tuple(out.shape) == (1, 2, 8, 4)
