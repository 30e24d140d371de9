"""O(N) memory: one head, Lq = Lk = 65536, D = 64, float32, through the automatic backend.

The plain formula would hold a 65536 x 65536 float32 matrix (16 GiB). Each run happens in a
fresh subprocess that reports how much its peak resident memory grew during the call,
beyond the output it returns.
"""
import sys
import textwrap

import pytest
from helpers import run_measured

LIMIT = 64 * 2**20

SCRIPT = textwrap.dedent("""
    import json, sys
    import numpy as np
    import qkv
    kind, L, mask = sys.argv[1], int(sys.argv[2]), qkv.causal() if sys.argv[3] == "causal" else None
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, L, 64), dtype=np.float32) for _ in range(3))
    if kind == "torch":
        import torch
        q, k, v = (torch.from_numpy(x) for x in (q, k, v))
    qkv.attention(q[:, :300], k[:, :300], v[:, :300], mask)  # warm up thread pools and libraries
    def peak():  # bytes; VmHWM is this process's own (ru_maxrss carries the parent's over exec)
        status = open("/proc/self/status").read()
        return int(status.split("VmHWM:")[1].split()[0]) * 1024
    before = peak()
    out = qkv.attention(q, k, v, mask)
    grown = peak() - before - L * 64 * 4  # minus the output itself
    chosen = qkv.explain(q, k, v, mask).backend  # after: what it works out must not raise the peak first
    finite = bool(np.isfinite(np.asarray(out)).all())
    print(json.dumps({"grown": grown, "backend": chosen, "finite": finite, "shape": list(out.shape)}))
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the peak from /proc/self/status")
@pytest.mark.parametrize("kind,mask", [("numpy", "none"), ("torch", "none"), ("numpy", "causal")])
def test_long_sequence_stays_linear_in_memory(kind, mask):
    """With a mask too: its tile classes take O(B·Lq + tiles) to work out, not a byte per tile row."""
    if kind == "torch":
        pytest.importorskip("torch")
    L = 65536
    report = run_measured(SCRIPT, kind, str(L), mask, timeout=600)
    assert report["shape"] == [1, L, 64] and report["finite"]
    assert report["backend"] != "reference"
    assert report["grown"] < LIMIT, f"{kind} via {report['backend']}: peak grew by {report['grown'] / 2**20:.1f} MiB"


def test_explain_counts_the_plain_formula_as_the_oracle_holds_it_and_a_masks_bitmaps(monkeypatch):
    import numpy as np

    import qkv
    from qkv import dispatch
    from qkv.backends import native

    # the masked calls' tiles for the unmasked one too, so that only the masks' bytes differ
    monkeypatch.setattr(native, "UNMASKED_BLOCK_K", native.BLOCK_K)

    q = np.zeros((1, 8, 1024, 64), np.float32)
    plain = qkv.explain(q, q, q)
    assert plain.formula_bytes == qkv.explain(q, q, q, backend="reference").workspace_bytes == 3 * 8 * 1024**2 * 4
    if plain.backend != "native":
        pytest.skip(f"the native kernel is not here ({dispatch.REGISTRY['native'].missing()})")
    rule = qkv.explain(q, q, q, qkv.mask_fn(lambda b, h, i, j: (i + j) % 3 != 0))
    interval = qkv.explain(q, q, q, qkv.causal())
    assert rule.workspace_bytes - plain.workspace_bytes >= 8 * 1024**2  # up to a byte a score, in bitmaps
    assert 0 < interval.workspace_bytes - plain.workspace_bytes < 2**16  # a byte a tile


def test_native_is_chosen_only_while_a_masks_bitmaps_stay_within_the_inputs_size():
    """A mask that is not key intervals costs the native kernel a byte per score of its PARTIAL
    tiles: exact in explain, and the automatic choice goes elsewhere once that passes O(N)."""
    import numpy as np

    import qkv
    from qkv import dispatch

    if dispatch.REGISTRY["native"].missing():
        pytest.skip(f"the native kernel is not here ({dispatch.REGISTRY['native'].missing()})")
    L = 16384
    q = np.zeros((1, 1, L, 64), np.float32)
    ids = np.repeat(np.arange(4), L // 4)[None]  # packed documents: partial tiles only where they meet
    packed = qkv.explain(q, q, q, qkv.document(ids))
    assert packed.backend == "native" and packed.workspace_bytes < 8 * 2**20
    every_tile = qkv.explain(q, q, q, qkv.mask_fn(lambda b, h, i, j: (i - j) % 2 == 0))
    assert every_tile.backend != "native"
    assert "a byte per score of its partial tiles, 256 MiB, more than the inputs" in every_tile.refused["native"][0]
    assert qkv.explain(q[..., :512, :], q[..., :512, :], q[..., :512, :],  # small: a quarter MiB, still native
                       qkv.mask_fn(lambda b, h, i, j: (i - j) % 2 == 0)).backend == "native"


def test_the_native_kernels_rule_evaluation_is_chunked_and_counted():
    """The bitmaps of a rule's PARTIAL tiles were filled from a whole band of keys at a time
    (24 MiB of temporaries here, 80 at 32768 keys and 16 heads) that explain did not count."""
    import tracemalloc

    import numpy as np

    import qkv
    from qkv import dispatch

    if dispatch.REGISTRY["native"].missing():
        pytest.skip(f"the native kernel is not here ({dispatch.REGISTRY['native'].missing()})")
    H, Lq, Lk = 8, 128, 16384
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, H, Lq, 16), dtype=np.float32)
    k = rng.standard_normal((1, H, Lk, 16), dtype=np.float32)
    window = qkv.mask_fn(lambda b, h, qi, ki: abs(qi + (Lk - Lq) - ki) < 64 * (h + 1))  # per head, bottom-right
    said = qkv.explain(q, k, k, window)
    assert said.backend == "native"
    qkv.attention(q[:, :, :8], k[:, :, :300], k[:, :, :300], window)  # warm up
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        out = qkv.attention(q, k, k, window)
        held = tracemalloc.get_traced_memory()[1] - before - out.nbytes
    finally:
        tracemalloc.stop()
    assert held < 8 * 2**20, f"held {held / 2**20:.1f} MiB"
    assert held <= said.workspace_bytes, (held, said.workspace_bytes)


def _mask_for_the_numpy_estimate(name, L, ids):
    import numpy as np

    import qkv

    rule = qkv.mask_fn(lambda b, h, i, j: (i - j) % 3 != 0)
    return {"none": None, "causal": qkv.causal(), "document": qkv.document(ids),
            "dense": qkv.dense_mask(np.random.default_rng(1).random((L, L)) < 0.5),
            "mask_fn": rule, "~mask_fn | causal": ~rule | qkv.causal()}[name]


@pytest.mark.parametrize("shape,dtype", [((1, 2, 2, 3000), "float32"), ((2, 4, 2, 1500), "float64")])
@pytest.mark.parametrize("mask_name,dropout_p", [(name, 0.0) for name in ("none", "causal", "document", "dense",
                                                                          "mask_fn", "~mask_fn | causal")]
                         + [("none", 0.2), ("causal", 0.2)])
def test_explain_bounds_the_numpy_backends_extra_memory_with_every_kind_of_mask(shape, dtype, mask_name, dropout_p):
    """What explain says the numpy backend holds is at least what it holds (traced allocations
    beyond the output), and not more than 2.5 times that: masked tiles, a user's rule and
    dropout's hash too."""
    import numpy as np

    B, Hq, Hkv, L = shape
    rng = np.random.default_rng(0)
    q = rng.standard_normal((B, Hq, L, 64)).astype(dtype)
    k, v = (rng.standard_normal((B, Hkv, L, 64)).astype(dtype) for _ in range(2))
    ids = np.repeat(np.arange(4), L // 4 + 1)[:L][None].repeat(B, 0)
    mask = _mask_for_the_numpy_estimate(mask_name, L, ids)
    _check_numpy_estimate(q, k, v, mask, dropout_p)


@pytest.mark.parametrize("reads_heads", [False, True])
def test_explain_bounds_a_rule_that_reads_the_head_under_grouped_heads(reads_heads):
    """A rule reading h holds its temporaries for each head of the group: explain counted one
    head's (37 MiB said, 51 held with 8 query heads over 2)."""
    import numpy as np

    import qkv
    from qkv.masks import rules_read_heads

    rule = (lambda b, h, i, j: (i + j + h) % 3 != 0) if reads_heads else (lambda b, h, i, j: (i - j) % 3 != 0)
    assert rules_read_heads(qkv.mask_fn(rule)) == reads_heads
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 8, 3000, 64)).astype(np.float32)
    k, v = (rng.standard_normal((1, 2, 3000, 64)).astype(np.float32) for _ in range(2))
    _check_numpy_estimate(q, k, v, qkv.mask_fn(rule), 0.0)


def test_a_rule_is_taken_to_read_the_head_unless_its_code_shows_otherwise():
    import numpy as np

    import qkv
    from qkv.masks import mask_fn, rules_read_heads

    def two_args(*args):
        return args[2] > 0

    assert rules_read_heads(mask_fn(lambda b, h, i, j: (lambda: h)() > 0))  # read in an inner function
    assert rules_read_heads(mask_fn(two_args)) and rules_read_heads(mask_fn(np.greater_equal))
    assert not rules_read_heads(~mask_fn(lambda b, h, i, j: i >= j) | qkv.causal())


@pytest.mark.parametrize("rule", [False, True], ids=["no mask", "mask_fn"])
@pytest.mark.parametrize("hq,lq,lk", [(4, 33, 45), (8, 4096, 64), (8, 64, 4096)])
def test_explain_bounds_the_numpy_backends_extra_memory_below_a_tile(hq, lq, lk, rule):
    """Lengths below a tile's: the tiles are cut to them, and so is the estimate (it counted
    whole 256 x 1024 tiles, 90x what a 33 x 45 call holds). A user's rule is evaluated on
    the real keys only when the tiles are classified (it was on whole 1024-key tiles)."""
    import numpy as np

    import qkv

    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, hq, lq, 64)).astype(np.float32)
    k, v = (rng.standard_normal((1, hq // 2, lk, 64)).astype(np.float32) for _ in range(2))
    mask = qkv.mask_fn(lambda b, h, i, j: (i - j) % 3 != 0) if rule else None
    qkv.attention(q, k, v, mask, backend="numpy")  # warm up: first calls set up thread pools
    _check_numpy_estimate(q, k, v, mask, 0.0)


def _check_numpy_estimate(q, k, v, mask, dropout_p):
    """explain's numpy workspace is at least what the call holds beyond its output (traced
    allocations), and at most 2.5 times that."""
    import tracemalloc

    import qkv

    said = qkv.explain(q, k, v, mask, backend="numpy", dropout_p=dropout_p).workspace_bytes
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        out = qkv.attention(q, k, v, mask, backend="numpy", dropout_p=dropout_p, seed=1)
        held = tracemalloc.get_traced_memory()[1] - before - out.nbytes
    finally:
        tracemalloc.stop()
    assert held <= said <= 2.5 * held, f"explain {said / 2**20:.2f} MiB, held {held / 2**20:.2f} MiB"


TORCH_MASK_SCRIPT = textwrap.dedent("""
    import json
    import torch
    import qkv
    from qkv._memory import peak_growth
    q = k = v = torch.randn(1, 8, 2048, 64)
    mask = qkv.mask_fn(lambda b, h, i, j: (i + j + h) % 3 != 0)
    qkv.attention(q[:, :, :300], k[:, :, :300], v[:, :, :300], mask, backend="torch")  # warm up
    _, grown, how = peak_growth(lambda: qkv.attention(q, k, v, mask, backend="torch"))
    said = qkv.explain(q, k, v, mask, backend="torch").workspace_bytes
    print(json.dumps({"grown": grown - q.nbytes, "said": said, "how": how}))
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the peak from /proc/self/status")
def test_explain_counts_the_torch_backends_mask_temporaries():
    """A user's rule on every tile: explain counted no mask at all for the torch backend (26 MiB
    said, 74 MiB grown); it must now say most of what the call holds."""
    pytest.importorskip("torch")
    report = run_measured(TORCH_MASK_SCRIPT, timeout=300)
    if report["how"] != "peak resident set":
        pytest.skip("needs Linux's peak counters (torch's allocations are not traced)")
    assert report["said"] >= 0.8 * report["grown"], report


BIAS_SCRIPT = textwrap.dedent("""
    import json
    import torch
    import qkv
    L = 4096
    q = k = v = torch.randn(1, 2, L, 64).bfloat16()
    bias = torch.randn(L).bfloat16().expand(1, 2, L, L)  # a per-key bias, broadcast: 8 KiB of data
    qkv.attention(q[:, :, :300], k[:, :, :300], v[:, :, :300], bias[..., :300, :300], backend="native")
    def peak():
        status = open("/proc/self/status").read()
        return int(status.split("VmHWM:")[1].split()[0]) * 1024
    before = peak()
    qkv.attention(q, k, v, bias, backend="native")
    print(json.dumps({"grown": peak() - before - q.nbytes}))
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the peak from /proc/self/status")
def test_a_broadcast_bfloat16_bias_is_read_in_place():
    """The kernel reads a bfloat16 bias as it is: widened to float32 first, a broadcast one
    became a dense (B, H, Lq, Lk) copy (128 MiB here)."""
    pytest.importorskip("torch")
    from qkv import dispatch

    if dispatch.REGISTRY["native"].missing():
        pytest.skip(dispatch.REGISTRY["native"].missing())
    grown = run_measured(BIAS_SCRIPT, timeout=600)["grown"]
    assert grown < 16 * 2**20, f"peak grew by {grown / 2**20:.1f} MiB"


NO_COPY_SCRIPT = textwrap.dedent("""
    import json, sys
    import numpy as np
    import qkv
    from qkv._memory import peak_growth
    kind, dtype, layout, path = sys.argv[1:5]
    # decoding: 32 query heads over 8 KV heads; tiles: 256 queries, too many for the decoding path
    hq, hkv, lq, lk, d = (32, 8, 1, 65536, 128) if path == "decoding" else (4, 4, 256, 262144, 64)
    rng = np.random.default_rng(0)
    def make(heads, length):  # (B, H, L, D): contiguous, or a view of a (B, L, H, D) array
        shape = (1, length, heads, d) if layout == "blhd" else (1, heads, length, d)
        x = rng.standard_normal(shape, dtype=np.float32)
        if kind == "torch":
            import torch
            x = torch.from_numpy(x).to(getattr(torch, dtype))
        return x.transpose(1, 2) if kind == "torch" and layout == "blhd" else \\
            x.transpose(0, 2, 1, 3) if layout == "blhd" else x
    q, k, v = make(hq, lq), make(hkv, lk), make(hkv, lk)
    qkv.attention(q[:, :, :8], k[:, :, :300], v[:, :, :300], backend="native")  # warm up
    out, grown, how = peak_growth(lambda: qkv.attention(q, k, v, backend="native"))
    out_bytes = out.nbytes if kind == "numpy" else out.numel() * out.element_size()
    kv_bytes = k.nbytes if kind == "numpy" else k.numel() * k.element_size()
    said = qkv.explain(q, k, v, backend="native").workspace_bytes
    print(json.dumps({"grown": grown - out_bytes, "kv": kv_bytes, "said": said, "how": how}))
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the peak from /proc/self/status")
@pytest.mark.parametrize("kind,dtype,layout,path", [
    ("numpy", "float32", "bhld", "decoding"), ("torch", "float32", "blhd", "decoding"),
    ("torch", "bfloat16", "bhld", "tiles"), ("numpy", "float32", "blhd", "tiles")])
def test_the_native_kernel_reads_its_inputs_in_place(kind, dtype, layout, path):
    """No copy of K or V (128 or 256 MiB here) on either path: NumPy arrays and torch tensors,
    contiguous or a (B, L, H, D) layout's strided view, grouped heads read from their KV head.
    The peak grows by the kernel's own workspace only, as explain counts it."""
    if kind == "torch":
        pytest.importorskip("torch")
    from qkv import dispatch

    if dispatch.REGISTRY["native"].missing():
        pytest.skip(dispatch.REGISTRY["native"].missing())
    report = run_measured(NO_COPY_SCRIPT, kind, dtype, layout, path, timeout=300)
    assert report["kv"] >= 128 * 2**20
    assert report["grown"] <= report["said"], report  # explain counts all it holds
    # bfloat16 products on the tiles read Vᵀ packed once into bfloat16 pairs: that one copy, no other
    packed_values = report["kv"] if (dtype, path) == ("bfloat16", "tiles") else 0
    assert report["grown"] - packed_values < 16 * 2**20, f"peak grew by {report['grown'] / 2**20:.1f} MiB"


BACKWARD_SCRIPT = textwrap.dedent("""
    import json
    import torch
    import qkv
    from qkv._memory import peak_growth
    L = 32768
    q, k, v = (torch.randn(1, 1, L, 64, requires_grad=True) for _ in range(3))
    dout = torch.randn(1, 1, L, 64)
    def step(n):  # forward and backward, then the gradients' own bytes
        out = qkv.attention(q[:, :, :n], k[:, :, :n], v[:, :, :n], qkv.causal())
        chosen = qkv.explain(q[:, :, :n], k[:, :, :n], v[:, :, :n], qkv.causal()).backend
        out.backward(dout[:, :, :n])
        return chosen, 4 * out.nbytes  # out, dq, dk and dv
    step(300)  # warm up thread pools and libraries
    for x in (q, k, v):
        x.grad = None
    (chosen, held), grown, how = peak_growth(lambda: step(L))
    finite = all(bool(x.grad.isfinite().all()) for x in (q, k, v))
    print(json.dumps({"grown": grown - held, "backend": chosen, "finite": finite, "how": how}))
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the peak from /proc/self/status")
def test_the_backward_stays_linear_in_memory():
    """Causal forward and backward over 32768 tokens through the automatic backend: the plain
    formula's backward would hold 4 GiB of probabilities and as much again of their gradient."""
    pytest.importorskip("torch")
    report = run_measured(BACKWARD_SCRIPT, timeout=600)
    assert report["finite"] and report["backend"] != "reference"
    assert report["grown"] < LIMIT, f"{report['backend']}: peak grew by {report['grown'] / 2**20:.1f} MiB"
