"""The torch backend equals torch.nn.functional.scaled_dot_product_attention where both apply."""
import pytest

import qkv
from helpers import ATOL, max_err

torch = pytest.importorskip("torch")
F = torch.nn.functional


@pytest.mark.parametrize("dtype", ["float64", "float32", "bfloat16"])
@pytest.mark.parametrize("case", ["plain", "causal", "bool_mask", "float_mask", "gqa", "scale", "cross"])
def test_equals_torch_sdpa(dtype, case):
    g = torch.Generator().manual_seed(0)
    dt = getattr(torch, dtype)
    Lq, Lk = (37, 53) if case == "cross" else (64, 64)
    hkv = 2 if case == "gqa" else 4
    q = torch.randn(2, 4, Lq, 32, generator=g).to(dt)
    k = torch.randn(2, hkv, Lk, 32, generator=g).to(dt)
    v = torch.randn(2, hkv, Lk, 16, generator=g).to(dt)
    ours, theirs = {}, {}
    if case == "causal":  # torch's is_causal is top-left aligned
        ours, theirs = {"mask": qkv.causal(align="top_left")}, {"is_causal": True}
    elif case == "bool_mask":  # both: True = attend
        m = torch.rand(2, 1, Lq, Lk, generator=g) < 0.8
        ours, theirs = {"mask": m}, {"attn_mask": m}
    elif case == "float_mask":
        m = torch.randn(1, 4, Lq, Lk, generator=g).to(dt)
        ours, theirs = {"mask": m}, {"attn_mask": m}
    elif case == "gqa":
        theirs = {"enable_gqa": True}
    elif case == "scale":
        ours, theirs = {"scale": 0.05}, {"scale": 0.05}
    got = qkv.attention(q, k, v, backend="torch", **ours)
    want = F.scaled_dot_product_attention(q, k, v, **theirs)
    exact = F.scaled_dot_product_attention(q.double(), k.double(), v.double(),
                                           **{n: (x.double() if torch.is_tensor(x) and x.is_floating_point() else x)
                                              for n, x in theirs.items()})
    # both are approximations of the float64 answer: ours within the rule of theirs
    assert max_err(got, exact) <= 2 * max_err(want, exact) + ATOL[dtype]
    assert got.dtype == want.dtype and got.shape == want.shape
