"""Values and gradients against the float64 oracle where every tiled backend runs many tiles
each way: the online softmax's rescaling, mask and dropout positions past the first tile,
EMPTY / PARTIAL / FULL tiles side by side, and gradients summed over key tiles. numpy and
torch run on small tiles (their defaults would take one tile at these sizes); native runs
on its own tiles (64 x 128 masked, 64 x 256 unmasked), with sizes that cross them."""
import numpy as np
import pytest

import qkv
from helpers import check_backend, check_gradients, to64, use_small_tiles
from qkv import dispatch
from qkv.backends import torch as torch_backend

torch = pytest.importorskip("torch")

SMALL_Q, SMALL_K = 16, 32  # numpy and torch tiles here
B, HQ, HKV, LQ, LK, D, DV = 2, 4, 2, 150, 600, 16, 24  # native: 3 x 5 or 3 x 3 tiles, crossing both edges


def _masks():
    lengths = np.array([LK, 170])  # the second row's keys end inside a tile
    ids = np.repeat(np.arange(10), 60)[None].repeat(B, 0)  # documents that cut tiles
    return {
        "none": None,
        "causal": qkv.causal(),
        "window": qkv.window(left=40, right=7),
        "padding": qkv.padding(lengths),
        "document": qkv.document(ids[:, :LQ], ids),
        "mask_fn": qkv.mask_fn(lambda b, h, i, j: (i * 7 + j * 3 + h) % 5 != 0),
        "causal & padding": qkv.causal() & qkv.padding(lengths),
    }


MASKS = list(_masks())


@pytest.fixture
def small_tiles(monkeypatch):
    use_small_tiles(monkeypatch, SMALL_Q, SMALL_K)


def _inputs(seed, grad=False, dtype=torch.float32):
    rng = np.random.default_rng(seed)
    shapes = ((B, HQ, LQ, D), (B, HKV, LK, D), (B, HKV, LK, DV))
    return [torch.tensor(rng.standard_normal(s), dtype=dtype, requires_grad=grad) for s in shapes]


def _runs(backend):
    return dispatch.REGISTRY[backend].missing() is None


@pytest.mark.parametrize("backend", ["numpy", "torch", "native"])
@pytest.mark.parametrize("mask_name", MASKS)
def test_forward_on_many_tiles(backend, mask_name, small_tiles):
    if not _runs(backend):
        pytest.skip(dispatch.REGISTRY[backend].missing())
    q, k, v = _inputs(1)
    if backend == "numpy":
        q, k, v = (x.numpy() for x in (q, k, v))
    check_backend(backend, (q, k, v), tuple(to64(x) for x in (q, k, v)), "float32", mask=_masks()[mask_name])


@pytest.mark.parametrize("backend", ["numpy", "torch"])
@pytest.mark.parametrize("mask_name", ["none", "causal & padding"])
def test_dropout_on_many_tiles_drops_what_the_reference_drops(backend, mask_name, small_tiles):
    """The hash takes the whole call's (query, key) positions, not a tile's: the reference,
    one tile of everything, must agree to the tolerance rule."""
    q, k, v = _inputs(2)
    if backend == "numpy":
        q, k, v = (x.numpy() for x in (q, k, v))
    check_backend(backend, (q, k, v), tuple(to64(x) for x in (q, k, v)), "float32", mask=_masks()[mask_name],
                  dropout_p=0.3, seed=11)


@pytest.mark.parametrize("backend,dtype", [("torch", "float32"), ("native", "float32"), ("native", "bfloat16")])
@pytest.mark.parametrize("mask_name", ["none", "causal", "window", "padding", "mask_fn"])
def test_gradients_on_many_tiles(backend, dtype, mask_name, small_tiles):
    """dq, dk and dv summed over every key and query tile, against the oracle's (bfloat16 on
    native: its products on bfloat16 pairs where the CPU has VDPBF16PS)."""
    if not _runs(backend):
        pytest.skip(dispatch.REGISTRY[backend].missing())
    check_gradients(backend, _inputs(3, grad=True, dtype=getattr(torch, dtype)), dict(mask=_masks()[mask_name]),
                    np.random.default_rng(4))


def test_dropout_gradients_on_many_tiles(small_tiles):
    check_gradients("torch", _inputs(5, grad=True), dict(mask=qkv.causal(), dropout_p=0.2, seed=3),
                    np.random.default_rng(6))


def test_the_sizes_do_cross_tiles(small_tiles):
    """What the tests above rely on: several tiles each way on every backend."""
    q, k, v = _inputs(7)
    inp = qkv.inputs.prepare(q, k, v)
    assert dispatch.REGISTRY["numpy"].block_q * 2 < LQ and dispatch.REGISTRY["numpy"].block_k * 2 < LK
    assert all(2 * block < L for block, L in zip(torch_backend.choose_blocks(B * HKV, HQ // HKV, LQ, LK), (LQ, LK)))
    if _runs("native"):
        assert all(2 * block < L for block, L in zip(dispatch.REGISTRY["native"].block_sizes(inp), (LQ, LK)))
