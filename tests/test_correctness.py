"""Every backend against the float64 oracle, under the tolerance rule, over odd sizes."""
import numpy as np
import pytest

import qkv
from helpers import check_backend, convert, dtypes_of_backend, kind_of_backend, precise_dtype, random_qkv, to64

SIZES = [(1, 1), (3, 17), (17, 3), (113, 129), (128, 128), (129, 513), (513, 129)]
HEAD_DIMS = [(1, 1), (8, 8), (40, 40), (64, 64), (80, 80), (128, 128), (256, 256), (64, 24), (16, 100)]


@pytest.mark.parametrize("Lq,Lk", SIZES)
def test_sizes(backend, rng, Lq, Lk):
    kind = kind_of_backend(backend)
    for dtype in dtypes_of_backend(backend):
        arrays, arrays64 = random_qkv(rng, (2, 3, Lq, 16), (2, 3, Lk, 16), (2, 3, Lk, 16), kind, dtype)
        check_backend(backend, arrays, arrays64, dtype)


@pytest.mark.parametrize("D,Dv", HEAD_DIMS)
def test_head_dims(backend, rng, D, Dv):
    kind = kind_of_backend(backend)
    for dtype in dtypes_of_backend(backend, ("float64", "float32")):
        arrays, arrays64 = random_qkv(rng, (1, 2, 37, D), (1, 2, 53, D), (1, 2, 53, Dv), kind, dtype)
        check_backend(backend, arrays, arrays64, dtype)


@pytest.mark.parametrize("hq,hkv", [(4, 1), (4, 2), (6, 3), (8, 8)])
def test_grouped_query(backend, rng, hq, hkv):
    kind = kind_of_backend(backend)
    arrays, arrays64 = random_qkv(rng, (2, hq, 29, 8), (2, hkv, 41, 8), (2, hkv, 41, 8), kind, "float32")
    check_backend(backend, arrays, arrays64, "float32", mask=qkv.causal())
    # each query head h uses kv head h // (hq // hkv): equal to repeating K/V explicitly
    q, k, v = arrays64
    group = hq // hkv
    repeated = qkv.attention(q, np.repeat(k, group, 1), np.repeat(v, group, 1), backend="reference")
    np.testing.assert_allclose(qkv.attention(q, k, v, backend="reference"), repeated, atol=1e-14)


@pytest.mark.parametrize("shape", [(7, 5), (3, 7, 5), (2, 3, 2, 7, 5)])
def test_ranks(backend, rng, shape):
    """2-D is one head, 3-D is (H, L, D), more dims are batch dims, kept in the output."""
    kind = kind_of_backend(backend)
    dtype = precise_dtype(backend)
    arrays, arrays64 = random_qkv(rng, shape, shape, shape, kind, dtype)
    out, _ = check_backend(backend, arrays, arrays64, dtype)
    assert tuple(out.shape) == shape


def test_scale(backend, rng):
    kind = kind_of_backend(backend)
    dtype = precise_dtype(backend)
    arrays, arrays64 = random_qkv(rng, (1, 2, 9, 4), (1, 2, 11, 4), (1, 2, 11, 4), kind, dtype)
    check_backend(backend, arrays, arrays64, dtype, scale=0.3)
    # scale=s equals the default on q pre-multiplied by s * sqrt(D)
    q, k, v = arrays64
    np.testing.assert_allclose(qkv.attention(q, k, v, scale=0.3, backend="reference"),
                               qkv.attention(q * 0.3 * 2.0, k, v, backend="reference"), atol=1e-14)


def test_oracle_is_the_formula(rng):
    """The oracle itself against softmax(q kᵀ / sqrt(D)) v written out directly."""
    q, k, v = (rng.standard_normal((2, 3, n, 6)) for n in (5, 7, 7))
    s = q @ k.swapaxes(-1, -2) / np.sqrt(6)
    w = np.exp(s - s.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    np.testing.assert_allclose(qkv.attention(q, k, v, backend="reference"), w @ v, atol=1e-14)
    np.testing.assert_allclose(qkv.attention_weights(q, k), w, atol=1e-14)


def test_large_logits_are_stable(backend, rng):
    """Scores of ±1e4 must not overflow: the row max is subtracted before exp."""
    kind = kind_of_backend(backend)
    arrays, arrays64 = random_qkv(rng, (1, 1, 33, 8), (1, 1, 700, 8), (1, 1, 700, 8), kind, "float32")
    out, lse = check_backend(backend, arrays, arrays64, "float32", scale=1e3)
    assert np.isfinite(np.asarray(out.tolist())).all()


@pytest.mark.parametrize("q_shape,Dv,seed", [((1, 2, 33, 16), 8, 0), ((1, 2, 33, 16), 8, 5),
                                            ((1, 4, 1, 16), 16, 13), ((1, 4, 1, 16), 16, 30)],
                         ids=["tiles-0", "tiles-5", "decoding-13", "decoding-30"])
def test_large_scores_are_scaled_after_the_product(backend, q_shape, Dv, seed):
    """Scores are scale·(q·kᵀ), rounded as the plain formula rounds them. Integer q and k make
    q·kᵀ exact in any order; with the scale 0.3 folded into q first (q·0.3 rounded per element)
    the float32 output was off by 2.4e-5 where the rule allows 1.7e-5 (tiles-0), the lse by
    1.1e-4 where it allows 1.0e-4 (tiles-5), on the native, torch and NumPy backends; with one
    query of four heads (the native decoding path), the output by 1.1e-5 against 5.8e-6 and
    the lse by 4.9e-5 against 3.9e-5 on native, and the output on NumPy too (decoding-13)."""
    if "float32" not in dtypes_of_backend(backend):
        pytest.skip("no float32")
    rng = np.random.default_rng(seed)
    kind = kind_of_backend(backend)
    q64, k64 = (rng.integers(-20, 21, s).astype(np.float64) for s in (q_shape, (1, 1, 300, 16)))
    v64 = rng.standard_normal((1, 1, 300, Dv)).astype(np.float32).astype(np.float64)
    arrays = [convert(x, kind, "float32") for x in (q64, k64, v64)]
    check_backend(backend, arrays, (q64, k64, v64), "float32", scale=0.3)


@pytest.mark.parametrize("D", [2, 16], ids=["tiles", "decoding"])
def test_a_huge_scale_multiplies_the_scores_not_q(backend, D):
    """q·kᵀ = 0 and 0.1 times 1e38 are finite scores; q·1e38 is not in float32, and folded
    into q first, the scale gave inf - inf = NaN where the answer is the second value. (D
    and Dv of 16: the native decoding path.)"""
    if "float32" not in dtypes_of_backend(backend):
        pytest.skip("no float32")
    q, k = np.zeros((1, 1, 1, D)), np.zeros((1, 1, 2, D))
    q[..., :2], k[..., 0, :2], k[..., 1, 0] = [10.0, -10.0], [1.0, 1.0], 0.01
    v = np.repeat([[[[1.0], [2.0]]]], D, axis=-1)  # (1, 1, 2, D)
    q, k, v = (convert(x, kind_of_backend(backend), "float32") for x in (q, k, v))
    out = qkv.attention(q, k, v, scale=1e38, backend=backend)
    np.testing.assert_array_equal(to64(out), np.full((1, 1, 1, D), 2.0))


@pytest.mark.parametrize("dtype", ["float64", "float32", "float16", "bfloat16"])
def test_every_backend_returns_the_inputs_dtype(rng, dtype):
    from helpers import convert, torch
    from qkv import dispatch

    for name, impl in dispatch.REGISTRY.items():
        if impl.missing() or dtype not in impl.caps.dtypes or not impl.runs_on_cpu:
            continue
        kind = "torch" if dtype == "bfloat16" or "numpy" not in impl.caps.kinds else "numpy"
        if kind == "torch" and torch is None:
            continue
        q = convert(rng.standard_normal((1, 2, 5, 4)), kind, dtype)
        out = qkv.attention(q, q, q, backend=name)
        assert str(out.dtype).replace("torch.", "") == dtype, name


def test_the_last_thread_out_restores_blas_whichever_set_the_limit():
    """threadpoolctl (3.8 on) lets only the thread that set OpenBLAS's limit change it: the first
    thread in sets it, a second leaves last, and BLAS gets its threads back all the same; a
    later call from yet another thread limits it again."""
    threadpoolctl = pytest.importorskip("threadpoolctl")
    import threading

    from qkv._threads import one_blas_thread

    def blas_threads():
        return [pool["num_threads"] for pool in threadpoolctl.threadpool_info() if pool["user_api"] == "blas"]

    before = blas_threads()
    if not before or max(before) < 2:
        pytest.skip("BLAS runs one thread here: there is no limit to see")
    entered, first_left, limited_elsewhere = threading.Event(), threading.Event(), []

    def second():
        with one_blas_thread():
            entered.set()
            first_left.wait()

    def third():
        with one_blas_thread():
            limited_elsewhere.append(blas_threads())

    other = threading.Thread(target=second)
    with one_blas_thread():  # this thread sets the limit
        other.start()
        entered.wait()
        assert blas_threads() == [1] * len(before)
    first_left.set()
    other.join()  # the second thread leaves last and restores
    assert blas_threads() == before
    late = threading.Thread(target=third)
    late.start()
    late.join()
    assert limited_elsewhere == [[1] * len(before)] and blas_threads() == before


def test_a_forked_child_runs_the_numpy_backend(rng):
    """The child inherits the thread pool object but not its threads: it makes its own."""
    import multiprocessing

    q = rng.standard_normal((1, 4, 256, 32)).astype(np.float32)
    want = qkv.attention(q, q, q, backend="numpy")  # the parent's pool runs
    with multiprocessing.get_context("fork").Pool(1) as pool:
        got = pool.apply_async(qkv.attention, (q, q, q), {"backend": "numpy"}).get(timeout=60)
    np.testing.assert_array_equal(got, want)


def test_concurrent_numpy_calls_leave_blas_as_they_found_it(rng):
    """The NumPy backend limits BLAS to one thread while it runs (process-wide): calls from
    several threads at once share that limit, and the last one out restores BLAS's threads."""
    threadpoolctl = pytest.importorskip("threadpoolctl")
    import threading

    def blas_threads():
        return [pool["num_threads"] for pool in threadpoolctl.threadpool_info() if pool["user_api"] == "blas"]

    q = rng.standard_normal((1, 4, 300, 32)).astype(np.float32)
    want, before, results = qkv.attention(q, q, q, backend="numpy"), blas_threads(), []

    def calls():
        results.extend(qkv.attention(q, q, q, backend="numpy") for _ in range(10))
    workers = [threading.Thread(target=calls) for _ in range(4)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert blas_threads() == before and len(results) == 40
    for got in results:  # BLAS may split a product otherwise while other threads call it: a few ulps
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
