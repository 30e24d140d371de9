"""The mask language: each rule against its definition, the algebra, tiles, pictures,
and every backend against the oracle for every mask kind."""
import numpy as np
import pytest

import qkv
from qkv import masks
from helpers import (backend_params, check_backend, convert, dtypes_of_backend, kind_of_backend, precise_dtype,
                     random_qkv, to64)

B, H = 2, 2


def brute(rule, Lq, Lk, batch=B):
    """The definition, one (b, i, j) at a time."""
    return np.array([[[rule(b, i, j) for j in range(Lk)] for i in range(Lq)] for b in range(batch)])


@pytest.mark.parametrize("Lq,Lk", [(4, 6), (6, 4), (5, 5), (1, 9)])
def test_causal_alignments(Lq, Lk):
    br = brute(lambda b, i, j: j <= i + Lk - Lq, Lq, Lk, 1)[0]
    tl = brute(lambda b, i, j: j <= i, Lq, Lk, 1)[0]
    np.testing.assert_array_equal(qkv.causal().materialize(Lq, Lk), br)
    np.testing.assert_array_equal(qkv.causal(align="top_left").materialize(Lq, Lk), tl)


@pytest.mark.parametrize("left,right,align", [(2, 0, "bottom_right"), (0, 3, "top_left"), (None, 1, "top_left"),
                                              (3, None, "bottom_right"), (1, 1, "bottom_right")])
def test_window(left, right, align):
    Lq, Lk = 5, 8
    off = Lk - Lq if align == "bottom_right" else 0
    lo = 10**9 if left is None else left
    hi = 10**9 if right is None else right
    want = brute(lambda b, i, j: i + off - lo <= j <= i + off + hi, Lq, Lk, 1)[0]
    np.testing.assert_array_equal(qkv.window(left, right, align).materialize(Lq, Lk), want)


@pytest.mark.parametrize("side", [2**63 - 1, 2**64, 10**30])
@pytest.mark.parametrize("backend", backend_params("numpy", "native", "torch"))
def test_window_sides_past_int64_mean_no_limit(side, backend):
    for Lq, Lk in [(3, 3), (5, 3)]:  # queries past the keys: bottom-right shifts them back
        right_open, left_open = qkv.window(0, side), qkv.window(side, 0)
        np.testing.assert_array_equal(right_open.materialize(Lq, Lk), qkv.window(0, None).materialize(Lq, Lk))
        np.testing.assert_array_equal(left_open.materialize(Lq, Lk), qkv.causal().materialize(Lq, Lk))
    shapes = (1, 2, 5, 8), (1, 2, 3, 8), (1, 2, 3, 8)
    (q, k, v), _ = random_qkv(np.random.default_rng(0), *shapes, kind_of_backend(backend), "float32")
    want = qkv.attention(q, k, v, qkv.window(None, 0), backend=backend)
    np.testing.assert_array_equal(qkv.attention(q, k, v, qkv.window(side, 0), backend=backend), want)


def test_a_mask_that_forbids_nothing_is_not_applied(rng):
    from qkv.masks import Geometry
    window_sides = (None, 0, 1, 3)
    masks = [qkv.causal(align) for align in ("bottom_right", "top_left")] + [
        qkv.window(left, right, align) for left in window_sides for right in window_sides
        for align in ("bottom_right", "top_left")]
    for Lq, Lk in [(1, 1), (1, 7), (2, 7), (3, 3), (4, 2), (7, 1)]:
        geom = Geometry(1, 1, Lq, Lk)
        for mask in masks:  # exact for causal and windows: True if and only if every pair is allowed
            assert mask.allows_every_pair(geom) == mask.materialize(Lq, Lk).all(), (mask, Lq, Lk)
        for mask in (masks[0] & masks[-1], masks[1] | masks[2], qkv.causal() & qkv.padding([Lk])):
            assert not mask.allows_every_pair(geom) or mask.materialize(Lq, Lk).all(), (mask, Lq, Lk)
    q, k, v = (rng.standard_normal(s).astype(np.float32) for s in ((2, 4, 1, 16), (2, 4, 9, 16), (2, 4, 9, 16)))
    np.testing.assert_array_equal(qkv.attention(q, k, v, qkv.causal()), qkv.attention(q, k, v))  # a decoding step
    assert "causal(align='bottom_right') (allows every pair at these sizes: not applied)" in str(
        qkv.explain(q, k, v, qkv.causal()))


@pytest.mark.parametrize("make", [
    lambda: qkv.causal(), lambda: qkv.causal(align="top_left"), lambda: qkv.window(2, 1, align="top_left"),
    lambda: qkv.window(1, 0), lambda: qkv.padding([6, 4], q_lengths=[5, 7]), lambda: qkv.prefix_lm([3, 1]),
    lambda: qkv.document(np.array([[0, 0, 1, 1, 1, 2, 2], [0, 1, 1, 2, 2, 2, 2]])),
    lambda: qkv.mask_fn(lambda b, h, i, j: (i + j + h) % 3 != 0),
    lambda: ~qkv.window(1, 1, align="top_left") | (qkv.causal() & qkv.mask_fn(lambda b, h, i, j: i != 2 * j)),
])
@pytest.mark.parametrize("offset", [0, 1, 4])
def test_from_query_gives_the_rows_of_the_whole_pass(make, offset):
    L = 7
    mask = make()
    whole = mask.materialize(L, L, batch=2, heads=3)  # (2, 3, L, L)
    later = mask.from_query(offset)
    np.testing.assert_array_equal(later.materialize(L - offset, L, batch=2, heads=3), whole[:, :, offset:])
    blocks = later.blocks(L - offset, L, 2, 3, batch=2, heads=3)  # exact classes of the later rows' tiles
    np.testing.assert_array_equal(blocks, qkv.dense_mask(whole[:, :, offset:]).blocks(L - offset, L, 2, 3, batch=2,
                                                                                           heads=3))
    assert isinstance(later, type(mask)) or isinstance(mask, masks.IntervalMask) == isinstance(later, masks.IntervalMask)


def test_drawing_and_materializing_check_their_sizes():
    with pytest.raises(ValueError, match="Lq must be a non-negative integer, got -1"):
        qkv.causal().materialize(-1, 5)
    with pytest.raises(ValueError, match="head must be a non-negative integer, got -1"):
        qkv.causal().to_string(3, 5, head=-1)
    with pytest.raises(ValueError, match=r"batch \(2\) must be less than batch_size \(2\)"):
        qkv.causal().to_string(3, 5, batch=2, batch_size=2)
    with pytest.raises(ValueError, match="Lk must be a non-negative integer, got 2.5"):
        qkv.causal().blocks(4, 2.5, 2, 2)


def test_padding():
    kv, ql = [3, 6], [2, 5]
    want = brute(lambda b, i, j: j < kv[b] and i < ql[b], 5, 6)
    np.testing.assert_array_equal(qkv.padding(kv, ql).materialize(5, 6, batch=2), want)
    want_kv = brute(lambda b, i, j: j < kv[b], 5, 6)
    np.testing.assert_array_equal(qkv.padding(kv).materialize(5, 6, batch=2), want_kv)


def test_document_and_prefix_lm():
    ids = np.array([[0, 0, 1, 1, 1, 2], [5, 5, 5, 5, 7, 7]])
    want = brute(lambda b, i, j: ids[b, i] == ids[b, j], 6, 6)
    np.testing.assert_array_equal(qkv.document(ids).materialize(6, 6, batch=2), want)
    kv_ids = np.array([[0, 1, 1, 2], [5, 7, 7, 7]])
    want = brute(lambda b, i, j: ids[b, i] == kv_ids[b, j], 6, 4)
    np.testing.assert_array_equal(qkv.document(ids, kv_ids).materialize(6, 4, batch=2), want)
    lengths = [2, 4]
    want = brute(lambda b, i, j: j < lengths[b] or j <= i, 6, 6)
    np.testing.assert_array_equal(qkv.prefix_lm(lengths).materialize(6, 6, batch=2), want)


def test_mask_fn_dense_and_algebra():
    Lq, Lk = 6, 7
    parity = qkv.mask_fn(lambda b, h, i, j: (i - j) % 2 == 0)
    want_parity = brute(lambda b, i, j: (i - j) % 2 == 0, Lq, Lk, 1)[0]
    np.testing.assert_array_equal(parity.materialize(Lq, Lk), want_parity)
    causal = qkv.causal().materialize(Lq, Lk)
    win = qkv.window(2).materialize(Lq, Lk)
    prefix = qkv.prefix_lm([2]).materialize(Lq, Lk, batch=1)[0]
    combined = qkv.causal() & qkv.window(left=2) | qkv.prefix_lm([2])
    np.testing.assert_array_equal(combined.materialize(Lq, Lk, batch=1)[0], causal & win | prefix)
    np.testing.assert_array_equal((~qkv.causal()).materialize(Lq, Lk), ~causal)
    np.testing.assert_array_equal((parity & qkv.causal()).materialize(Lq, Lk), want_parity & causal)
    dense = qkv.dense_mask(want_parity)
    np.testing.assert_array_equal(dense.materialize(Lq, Lk), want_parity)


@pytest.mark.parametrize("backend", [None, "torch", "native", "reference"])
def test_a_rule_written_with_torch_functions_runs_on_torch_inputs(backend):
    """qkv evaluates a rule itself (tile classes, the native kernel's tile bitmaps, the
    reference's upcast inputs) on index arrays of the inputs' kind: a rule of torch functions
    for torch inputs used to fail there with torch's TypeError on NumPy arrays."""
    torch = pytest.importorskip("torch")
    if backend is not None and qkv.dispatch.REGISTRY[backend].missing():
        pytest.skip(qkv.dispatch.REGISTRY[backend].missing())
    rng = np.random.default_rng(0)
    q, k, v = (torch.tensor(rng.standard_normal((1, 2, n, 8)), dtype=torch.float32) for n in (200, 300, 300))
    torch_rule = qkv.mask_fn(lambda b, h, i, j: torch.remainder(i - j + h, 3) != 0)
    same_rule = qkv.mask_fn(lambda b, h, i, j: (i - j + h) % 3 != 0)
    got = qkv.attention(q, k, v, torch_rule, backend=backend)
    want = qkv.attention(q, k, v, same_rule, backend="reference")
    torch.testing.assert_close(got, want, rtol=0, atol=2e-6)
    stats = qkv.attention_stats(q, k, torch_rule)
    torch.testing.assert_close(stats.entropy, qkv.attention_stats(q, k, same_rule).entropy)


def test_a_rule_for_the_other_kind_of_array_is_named_in_the_error():
    """A rule written with NumPy methods gets torch tensors for torch inputs: the error says
    which rule failed on what, not only torch's AttributeError."""
    torch = pytest.importorskip("torch")
    q = torch.randn(1, 2, 40, 16)
    with pytest.raises(TypeError, match=r"mask_fn's rule failed on the index arrays it was given, torch tensors "
                                        r"\(they are of the inputs' kind\): AttributeError: .*astype"):
        qkv.attention(q, q, q, qkv.mask_fn(lambda b, h, qi, ki: (qi >= ki).astype(bool)))


def test_head_dependent_rule():
    rule = qkv.mask_fn(lambda b, h, i, j: j <= i + h)
    grid = rule.materialize(4, 4, heads=3)
    for h in range(3):
        np.testing.assert_array_equal(grid[h], brute(lambda b, i, j: j <= i + h, 4, 4, 1)[0])


def test_to_string_draws_the_mask():
    text = qkv.causal().to_string(3, 5)
    rows = text.splitlines()[1:]
    assert [r.split(" ")[1] for r in rows] == ["███··", "████·", "█████"]
    assert "causal" in text.splitlines()[0]



def test_to_string_of_a_mask_with_more_batch_rows_says_to_pass_batch_size():
    mask = qkv.padding([3, 5])
    with pytest.raises(ValueError, match=r"drawn for 1 batch row and 1 head: if the mask's data holds more, pass batch_size=\)"):
        mask.to_string(3, 5)
    assert mask.to_string(3, 5, batch=1, batch_size=2).splitlines()[1:] == ["0 █████", "1 █████", "2 █████"]
    with pytest.raises(ValueError) as error:  # batch_size given: the mask's own error, no advice
        mask.to_string(3, 5, batch_size=3)
    assert "needs one entry per batch row (3), got 2" in str(error.value) and "pass batch_size" not in str(error.value)


def test_materialize_of_a_mask_with_more_batch_rows_says_to_pass_batch():
    mask = qkv.padding([3, 5])
    with pytest.raises(ValueError, match=r"needs one entry per batch row \(1\), got 2 \(materialized for one batch "
                                         r"row: if the mask's data holds more, pass batch=\)"):
        mask.materialize(3, 5)
    allowed = mask.materialize(3, 5, batch=2)
    assert allowed.shape == (2, 3, 5) and allowed[0, :, 3:].sum() == 0 and allowed[1].all()
    with pytest.raises(ValueError) as error:  # batch given: the mask's own error, no advice
        mask.materialize(3, 5, batch=3)
    assert "pass batch=" not in str(error.value)


@pytest.mark.parametrize("mask, size", [(qkv.prefix_lm([2]), 1), (qkv.document(np.zeros((1, 5), int)), 4),
                                        (qkv.dense_mask(np.ones((4, 5), bool)), 4)])
def test_errors_that_batch_or_heads_cannot_mend_carry_no_advice_to_pass_them(mask, size):
    """A length or a sequence length that does not fit is the mask's own error: materialize
    and to_string used to advise passing batch= or heads= for it too."""
    for draw in (mask.materialize, mask.to_string):
        with pytest.raises(ValueError) as error:
            draw(size, size)
        assert "pass batch" not in str(error.value) and "heads=" not in str(error.value)


@pytest.mark.parametrize("draw, advice", [
    (lambda: qkv.padding([3, 4]).materialize(3, 5, heads=1), "pass batch=)"),
    (lambda: qkv.padding([3, 4]).materialize(3, 5, batch=1), None),  # the batch it was given differs
    (lambda: qkv.padding([3, 4]).to_string(3, 5, batch_size=1), None),
    (lambda: qkv.dense_mask(np.ones((4, 3, 5), bool)).materialize(3, 5, heads=2), None),
    (lambda: qkv.dense_mask(np.ones((4, 3, 5), bool)).materialize(3, 5, batch=1), "pass heads=)"),
    (lambda: qkv.dense_mask(np.ones((2, 4, 3, 5), bool)).materialize(3, 5), "pass batch= and heads=)"),
    (lambda: qkv.dense_mask(np.ones((2, 4, 3, 5), bool)).to_string(3, 5, heads=4), "pass batch_size=)"),
])
def test_the_advice_names_only_the_sizes_that_differ(draw, advice):
    """Advice to pass a size it was given, or one that fits, does not mend the error."""
    with pytest.raises(ValueError) as error:
        draw()
    message = str(error.value)
    if advice is None:
        assert "if the mask's data holds more" not in message, message
    else:
        assert message.endswith(advice), message


@pytest.mark.parametrize("batch", ["2", -1, 2.0, (2, -1), True])
def test_blocks_and_materialize_check_batch(batch):
    """batch used to fail deep inside (a TypeError from a product, NumPy's broadcasting) or,
    as a string, to be taken as a sequence of characters."""
    for draw in (lambda: qkv.causal().blocks(4, 5, 2, 2, batch=batch), lambda: qkv.causal().materialize(4, 5, batch=batch)):
        with pytest.raises(ValueError, match=r"batch must be a non-negative integer, got"):
            draw()
    with pytest.raises(ValueError, match=r"batch must be a non-negative integer, got None"):
        qkv.causal().blocks(4, 5, 2, 2, batch=None)


def test_to_string_draws_any_head_of_a_per_head_mask():
    mask = qkv.dense_mask(np.stack([np.eye(3, dtype=bool), np.ones((3, 3), bool)]))  # (H=2, Lq, Lk)
    assert mask.to_string(3, 3, head=0, heads=2).splitlines()[1:] == ["0 █··", "1 ·█·", "2 ··█"]
    assert mask.to_string(3, 3, head=1).splitlines()[1:] == ["0 ███", "1 ███", "2 ███"]
    with pytest.raises(ValueError, match=r"drawn for 1 batch row and 1 head: .* pass heads=\)"):
        mask.to_string(3, 3)
    with pytest.raises(ValueError, match=r"materialized for one head: if the mask's data holds more, pass heads="):
        mask.materialize(3, 3, batch=1)
    with pytest.raises(ValueError, match=r"head \(2\) must be less than heads \(2\)"):
        mask.to_string(3, 3, head=2, heads=2)


@pytest.mark.parametrize("kind", ["numpy", "torch"])
@pytest.mark.parametrize("shape", [(1, 1, 4, 5), (2, 1, 1, 4, 5)])  # the second is copied to fit (2, 3) batch dims
def test_a_dense_mask_changed_in_place_is_read_as_it_is_now(kind, shape):
    if kind == "torch":
        pytest.importorskip("torch")
    rng = np.random.default_rng(3)
    (q, k, v), (_, _, v64) = random_qkv(rng, (2, 3, 1, 4, 8), (2, 3, 1, 5, 8), (2, 3, 1, 5, 8), kind, "float64")
    array = convert(np.ones(shape), kind, "float64") > 0
    mask = qkv.dense_mask(array)
    qkv.attention(q, k, v, mask)
    array[...] = False
    array[..., 0] = True  # only key 0 now: every output row is v's first
    out = to64(qkv.attention(q, k, v, mask))
    np.testing.assert_allclose(out, np.broadcast_to(v64[..., :1, :], out.shape), rtol=1e-12, atol=1e-12)


MASKS = {
    "causal": lambda: qkv.causal(),
    "causal_top_left": lambda: qkv.causal(align="top_left"),
    "window": lambda: qkv.window(left=7, right=2),
    "padding": lambda: qkv.padding([30, 0], q_lengths=[25, 33]),
    "document": lambda Lq, Lk: qkv.document(np.sort(np.random.default_rng(0).integers(0, 4, (2, Lq))),
                                            np.sort(np.random.default_rng(1).integers(0, 4, (2, Lk)))),
    "document_unsorted": lambda Lq, Lk: qkv.document(np.random.default_rng(0).integers(0, 3, (2, Lq)),
                                                     np.random.default_rng(1).integers(0, 3, (2, Lk))),
    "document_shared": lambda Lq, Lk: qkv.document(np.sort(np.random.default_rng(0).integers(0, 4, Lq)),
                                                   np.sort(np.random.default_rng(1).integers(0, 4, (1, Lk)))),
    "prefix_lm": lambda: qkv.prefix_lm([5, 30]),
    "mask_fn": lambda: qkv.mask_fn(lambda b, h, i, j: (i + j + h) % 3 != 0),
    "dense": lambda Lq, Lk: qkv.dense_mask(np.random.default_rng(2).random((2, 1, Lq, Lk)) < 0.3),
    "composed": lambda: (qkv.causal() & qkv.window(4)) | qkv.prefix_lm([3, 9]),
    "not": lambda: ~qkv.window(3, 3),
    "empty_rows": lambda: qkv.causal(align="top_left") & qkv.window(left=0, right=None, align="top_left")
    & qkv.mask_fn(lambda b, h, i, j: i % 4 != 0),
}


def test_document_ids_of_one_row_serve_every_batch_row():
    ids, kv_ids = np.array([0, 0, 1, 1, 1, 2]), np.array([[0, 1, 1, 2]])
    want = qkv.document(np.tile(ids, (3, 1)), np.tile(kv_ids, (3, 1))).materialize(6, 4, batch=3, heads=2)
    np.testing.assert_array_equal(qkv.document(ids, kv_ids).materialize(6, 4, batch=3, heads=2), want)


@pytest.mark.parametrize("name", MASKS)
@pytest.mark.parametrize("Lq,Lk", [(33, 57), (57, 33)])
def test_backends_on_every_mask(backend, rng, name, Lq, Lk):
    make = MASKS[name]
    mask = make(Lq, Lk) if make.__code__.co_argcount == 2 else make()
    kind = kind_of_backend(backend)
    for dtype in dtypes_of_backend(backend, ("float64", "float32")):
        arrays, arrays64 = random_qkv(rng, (2, 4, Lq, 8), (2, 2, Lk, 8), (2, 2, Lk, 8), kind, dtype)
        out, lse = check_backend(backend, arrays, arrays64, dtype, mask=mask)
        allowed = mask.materialize(Lq, Lk, batch=2, heads=4)
        no_key = ~allowed.any(-1)  # (B, H, Lq)
        assert (np.asarray(out.tolist())[no_key] == 0).all()
        assert np.isneginf(np.asarray(lse.tolist())[no_key]).all()


def test_boolean_and_float_arrays(backend, rng):
    kind, dtype = kind_of_backend(backend), precise_dtype(backend)
    arrays, arrays64 = random_qkv(rng, (2, 3, 20, 8), (2, 3, 30, 8), (2, 3, 30, 8), kind, dtype)
    allowed = rng.random((2, 1, 20, 30)) < 0.5
    bias = rng.standard_normal((3, 20, 30))
    from helpers import convert
    bool_mask = convert(allowed.astype(np.float64), kind, dtype) > 0.5
    check_backend(backend, arrays, arrays64, dtype, mask=bool_mask)
    check_backend(backend, arrays, arrays64, dtype, mask=convert(bias, kind, dtype))
    # a float mask is an additive bias: -inf where a boolean mask says False gives the same answer
    q, k, v = arrays64
    as_bias = np.where(allowed, 0.0, -np.inf)
    np.testing.assert_allclose(qkv.attention(q, k, v, as_bias, backend="reference"),
                               qkv.attention(q, k, v, allowed, backend="reference"), atol=1e-14)


def test_one_dimensional_masks_broadcast_over_rows(backend, rng):
    """A (Lk,) boolean mask or bias applies to every query row, as NumPy broadcasting says."""
    kind, dtype = kind_of_backend(backend), precise_dtype(backend)
    arrays, arrays64 = random_qkv(rng, (2, 3, 20, 8), (2, 3, 30, 8), (2, 3, 30, 8), kind, dtype)
    from helpers import convert
    allowed = rng.random(30) < 0.5
    check_backend(backend, arrays, arrays64, dtype, mask=convert(allowed.astype(np.float64), kind, dtype) > 0.5)
    check_backend(backend, arrays, arrays64, dtype, mask=convert(rng.standard_normal(30), kind, dtype))
    np.testing.assert_array_equal(qkv.attention(*arrays64, allowed, backend="reference"),
                                  qkv.attention(*arrays64, np.broadcast_to(allowed, (20, 30)), backend="reference"))


def test_softcap_keeps_a_minus_inf_bias_masked(backend, rng):
    """softcap maps scores into (-cap, cap) but leaves -inf (a float mask's "masked") at -inf."""
    kind, dtype = kind_of_backend(backend), precise_dtype(backend)
    arrays, arrays64 = random_qkv(rng, (2, 2, 20, 8), (2, 2, 30, 8), (2, 2, 30, 8), kind, dtype)
    allowed = rng.random((2, 1, 20, 30)) < 0.5
    allowed[0, 0, 3] = False  # a row with no key at all
    from helpers import convert
    as_bias = np.where(allowed, 0.0, -np.inf)
    check_backend(backend, arrays, arrays64, dtype, mask=convert(as_bias, kind, dtype), score_mod=qkv.softcap(2.0))
    q, k, v = arrays64  # the meaning: the same as the boolean mask
    np.testing.assert_allclose(qkv.attention(q, k, v, as_bias, score_mod=qkv.softcap(2.0), backend="reference"),
                               qkv.attention(q, k, v, allowed, score_mod=qkv.softcap(2.0), backend="reference"),
                               atol=1e-14)


@pytest.mark.parametrize("mod", [
    lambda: qkv.alibi(np.array([0.5, 0.25, 0.125, 0.0625])),
    lambda: qkv.softcap(2.0),
    lambda: qkv.score_fn(lambda s, b, h, i, j: s - abs(i - j) * 0.125),  # exact in any float dtype
    lambda: qkv.score_fn(lambda s, b, h, i, j: -abs(i - j) * 0.125),  # of the positions only: (Lq, Lk), broadcast
    lambda: [qkv.alibi(np.array([0.5, 0.25, 0.125, 0.0625])), qkv.softcap(3.0)],
])
def test_score_modifiers(backend, rng, mod):
    kind, dtype = kind_of_backend(backend), precise_dtype(backend)
    arrays, arrays64 = random_qkv(rng, (2, 4, 19, 8), (2, 2, 23, 8), (2, 2, 23, 8), kind, dtype)
    mods = mod()
    if backend == "native" and any(isinstance(m, type(qkv.score_fn(abs))) for m in np.atleast_1d(mods)):
        with pytest.raises(qkv.BackendError, match="score_fn"):
            qkv.attention(*arrays, qkv.causal(), score_mod=mods, backend=backend)
        return
    check_backend(backend, arrays, arrays64, dtype, mask=qkv.causal(), score_mod=mods)


@pytest.mark.parametrize("backend", backend_params("torch", "native", "reference"))
def test_a_rule_may_answer_in_numpy_for_torch_inputs(backend, rng):
    torch = pytest.importorskip("torch")
    q, k, v = (torch.from_numpy(rng.standard_normal((1, 2, n, 8)).astype(np.float32)) for n in (9, 9, 9))
    as_numpy = qkv.mask_fn(lambda b, h, i, j: np.asarray(i >= j))  # the indices' kind varies: np.asarray takes both
    np.testing.assert_array_equal(qkv.attention(q, k, v, as_numpy, backend=backend),
                                  qkv.attention(q, k, v, qkv.causal(align="top_left"), backend=backend))


def test_modifier_definitions(rng):
    q, k, v = (rng.standard_normal((1, 2, n, 4)) for n in (5, 6, 6))
    s = q @ k.swapaxes(-1, -2) / 2.0
    i, j = np.arange(5)[:, None] + 1, np.arange(6)[None]
    slopes = np.array([0.5, 0.25])
    np.testing.assert_allclose(qkv.attention_weights(q, k, score_mod=qkv.alibi(slopes)),
                               _softmax(s - slopes[:, None, None] * np.abs(i - j)), atol=1e-14)
    np.testing.assert_allclose(qkv.attention_weights(q, k, score_mod=qkv.softcap(1.5)),
                               _softmax(1.5 * np.tanh(s / 1.5)), atol=1e-14)


def _softmax(s):
    e = np.exp(s - s.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def test_nan_in_unmasked_input_propagates(backend, rng):
    kind = kind_of_backend(backend)
    (q, k, v), _ = random_qkv(rng, (1, 1, 4, 8), (1, 1, 6, 8), (1, 1, 6, 8), kind, "float32")
    v[0, 0, 2, 0] = float("nan")
    out = np.asarray(qkv.attention(q, k, v, backend=backend).tolist())
    assert np.isnan(out[0, 0, :, 0]).all()


@pytest.mark.parametrize("where", ["q", "k"])
def test_nan_scores_propagate_to_output_and_lse(backend, rng, where):
    """A NaN in q (one row's scores) or in an allowed key (every row's) is NaN out, never 0 and -inf."""
    kind = kind_of_backend(backend)
    (q, k, v), _ = random_qkv(rng, (1, 1, 4, 8), (1, 1, 6, 8), (1, 1, 6, 8), kind, "float32")
    (q if where == "q" else k)[0, 0, 1, 0] = float("nan")
    out, lse = qkv.attention(q, k, v, backend=backend, return_lse=True)
    out, lse = np.asarray(out.tolist()), np.asarray(lse.tolist())
    nan_rows = [1] if where == "q" else [0, 1, 2, 3]
    assert np.isnan(out[0, 0, nan_rows]).all() and np.isnan(lse[0, 0, nan_rows]).all()
    assert np.isfinite(np.delete(out[0, 0], nan_rows, axis=0)).all()


def test_dense_mask_with_several_batch_dims(backend, rng):
    """A mask (B1, B2, H, Lq, Lk) lines up with q's own leading dims on every backend."""
    kind, dtype = kind_of_backend(backend), precise_dtype(backend)
    arrays, arrays64 = random_qkv(rng, (2, 3, 2, 9, 8), (2, 3, 2, 11, 8), (2, 3, 2, 11, 8), kind, dtype)
    from helpers import convert
    allowed = rng.random((2, 3, 1, 9, 11)) < 0.5
    check_backend(backend, arrays, arrays64, dtype, mask=convert(allowed.astype(float), kind, dtype) > 0.5)


def test_a_dense_mask_checked_for_other_sizes_in_between_still_answers_for_its_own(rng):
    """One mask object serving calls of two sizes at once (threads): a call's evaluation never
    reads the view fitted for the other call's sizes."""
    from qkv.masks import Geometry
    allowed = rng.random((2, 1, 1, 1, 6)) < 0.5  # batch dims (2, 1|n), one row per batch row
    bias = rng.standard_normal((2, 1, 1, 1, 6))
    mask, score_mod = qkv.dense_mask(allowed), qkv.inputs.as_mask(bias, "numpy", "float64")[1][0]
    small, large = Geometry(2, 1, 3, 6, batch_shape=(2, 1)), Geometry(6, 1, 3, 6, batch_shape=(2, 3))
    b, h, qi, ki = np.ogrid[:2, :1, :3, :6]
    for obj in (mask, score_mod):
        obj.check(small)
        obj.check(large)  # another call, at other sizes, checks the same object
    np.testing.assert_array_equal(mask.allowed(b, h, qi, ki, small), np.broadcast_to(allowed[:, 0], (2, 1, 3, 6)))
    np.testing.assert_array_equal(score_mod.apply(np.zeros((2, 1, 3, 6)), b, h, qi, ki, small),
                                  np.broadcast_to(bias[:, 0], (2, 1, 3, 6)))


def test_materialize_takes_numpy_integers():
    want = qkv.causal().materialize(3, 4, batch=2, heads=1)
    np.testing.assert_array_equal(qkv.causal().materialize(3, 4, batch=np.int64(2), heads=np.int64(1)), want)


@pytest.mark.parametrize("backend", ["reference", "numpy", "torch", "native"])
def test_an_empty_batch_with_a_rule_or_dense_mask_gives_an_empty_output(backend):
    """Tiles settled by evaluating the rule: batch 0 has none to evaluate."""
    from qkv import dispatch

    if dispatch.REGISTRY[backend].missing():
        pytest.skip(dispatch.REGISTRY[backend].missing())
    q, k = np.zeros((0, 2, 5, 8), np.float32), np.zeros((0, 1, 7, 8), np.float32)
    if backend == "torch":
        torch = pytest.importorskip("torch")
        q, k = torch.from_numpy(q), torch.from_numpy(k)
    allowed = np.ones((0, 2, 5, 7), bool)
    allowed = torch.from_numpy(allowed) if backend == "torch" else allowed
    for mask in (qkv.mask_fn(lambda b, h, i, j: i >= j), qkv.dense_mask(allowed)):
        assert tuple(qkv.attention(q, k, k, mask, backend=backend).shape) == (0, 2, 5, 8)
        assert mask.blocks(5, 7, 64, 64, batch=0, heads=2).shape == (0, 1, 1, 1)
