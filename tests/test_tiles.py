"""Tile classification is exact, and tiled backends never compute an EMPTY tile nor mask a FULL one."""
import numpy as np
import pytest

import qkv
from helpers import kind_of_backend, random_qkv
from qkv import dispatch, inputs
from qkv.backends import base
from test_masks import MASKS

TILE_MASKS = dict(MASKS, sliding=lambda: qkv.window(left=40), head_rule=lambda: qkv.mask_fn(lambda b, h, i, j: j <= i * (h + 1)),
                  # an | whose sides are EMPTY and PARTIAL (or FULL) in the same tiles
                  band_or_padding=lambda: qkv.window(2, 2, align="top_left") | qkv.padding([5, 40]))


def make(name, Lq, Lk):
    f = TILE_MASKS[name]
    return f(Lq, Lk) if f.__code__.co_argcount == 2 else f()


def brute_classes(allowed, bq, bk):
    """EMPTY/PARTIAL/FULL of each tile of a materialised (B, H, Lq, Lk) mask."""
    B, H, Lq, Lk = allowed.shape
    nq, nk = -(-Lq // bq), -(-Lk // bk)
    out = np.empty((B, H, nq, nk), dtype=np.int8)
    for t in range(nq):
        for j in range(nk):
            tile = allowed[:, :, t * bq:(t + 1) * bq, j * bk:(j + 1) * bk]
            out[:, :, t, j] = np.where(tile.all((2, 3)), qkv.FULL, np.where(tile.any((2, 3)), qkv.PARTIAL, qkv.EMPTY))
    return out


@pytest.mark.parametrize("name", TILE_MASKS)
@pytest.mark.parametrize("bq,bk", [(8, 16), (16, 8), (5, 7)])
def test_blocks_are_exact(name, bq, bk):
    Lq, Lk = 33, 57
    mask = make(name, Lq, Lk)
    got = mask.blocks(Lq, Lk, bq, bk, batch=2, heads=4)
    want = brute_classes(mask.materialize(Lq, Lk, batch=2, heads=4), bq, bk)
    np.testing.assert_array_equal(np.broadcast_to(got, want.shape), want)


def test_causal_blocks_picture():
    # 4 x 4 tiles of 2: diagonal tiles partial, below full, above empty
    np.testing.assert_array_equal(qkv.causal().blocks(8, 8, 2, 2)[0, 0],
                                  [[1, 0, 0, 0], [2, 1, 0, 0], [2, 2, 1, 0], [2, 2, 2, 1]])


@pytest.mark.parametrize("name", ["causal", "sliding", "padding", "document", "composed", "head_rule", "dense"])
def test_kernels_skip_empty_and_never_mask_full(backend, rng, name):
    impl = dispatch.REGISTRY[backend]
    kind = kind_of_backend(backend)
    Lq = Lk = 1100 if name != "head_rule" else 700
    (q, k, v), _ = random_qkv(rng, (2, 4, Lq, 8), (2, 2, Lk, 8), (2, 2, Lk, 8), kind, "float32")
    mask = make(name, Lq, Lk)
    inp = inputs.prepare(q, k, v, mask)
    bq, bk = impl.block_sizes(inp)
    # expected counts from an independent, materialised classification, per (batch, kv head) row
    per_head = brute_classes(mask.materialize(Lq, Lk, batch=2, heads=4), bq, bk).reshape(2, 2, 2, -1)
    empty = (per_head == qkv.EMPTY).all(2)
    full = (per_head == qkv.FULL).all(2)
    counter = base.TileCounter()
    base.tile_counter = counter
    try:
        qkv.attention(q, k, v, mask, backend=backend)
    finally:
        base.tile_counter = None
    assert counter.computed == (~empty).sum()
    assert counter.masked == (~empty & ~full).sum()
    if name in ("causal", "sliding", "document"):
        assert empty.any(), "the test should exercise skipping"


def test_classifying_the_tiles_of_a_rule_holds_a_bounded_band():
    """A rule's tiles are settled by evaluating it a few key tiles at a time: the temporaries
    stay a few MiB however long the keys run (a whole band of 16384 keys took 68 MiB)."""
    import tracemalloc

    L = 16384
    rule = qkv.mask_fn(lambda b, h, i, j: (i - j) % 2 == 0)  # every tile PARTIAL: every one evaluated
    tracemalloc.start()
    try:
        classes = rule.blocks(L, L, 256, 1024)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert (classes == qkv.PARTIAL).all() and classes.shape == (1, 1, L // 256, L // 1024)
    assert peak < 32 * 2**20, f"{peak / 2**20:.1f} MiB"
