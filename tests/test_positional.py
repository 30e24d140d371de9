"""Tests for qkv.positional: sinusoidal tables, RoPE and ALiBi slopes.

References are written independently of the implementation: plain float64 loops
over positions and features, plus the literal published formulas
(HF ``rotate_half``, GPT-J ``rotate_every_two``, complex multiplication).
"""
import math
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from qkv import positional
from qkv.positional import alibi_slopes, rope, sinusoidal

RNG = np.random.default_rng(1234)


# ---- independent references --------------------------------------------------------------


def sinusoidal_loop(length, d_model, base=10000.0):
    pe = np.zeros((length, d_model))
    for pos in range(length):
        for j in range(d_model):
            i2 = j - (j % 2)  # the "2i" of the feature pair j belongs to
            angle = pos / base ** (i2 / d_model)
            pe[pos, j] = math.sin(angle) if j % 2 == 0 else math.cos(angle)
    return pe


def rope_loop(x, positions=None, base=10000.0, interleaved=False):
    """Rotate every feature pair of every token with explicit loops, in float64."""
    x = np.asarray(x, dtype=np.float64)
    L, D = x.shape[-2:]
    pos = np.arange(L) if positions is None else np.asarray(positions)
    pos = np.broadcast_to(pos, x.shape[:-1])
    out = np.empty_like(x)
    for idx in np.ndindex(*x.shape[:-1]):
        p = float(pos[idx])
        for i in range(D // 2):
            theta = p * base ** (-2.0 * i / D)
            a, b = (2 * i, 2 * i + 1) if interleaved else (i, i + D // 2)
            xa, xb = x[idx + (a,)], x[idx + (b,)]
            out[idx + (a,)] = xa * math.cos(theta) - xb * math.sin(theta)
            out[idx + (b,)] = xb * math.cos(theta) + xa * math.sin(theta)
    return out


def angles_f64(positions, D, base=10000.0):
    inv = np.array([base ** (-2.0 * i / D) for i in range(D // 2)])
    return np.asarray(positions, dtype=np.float64)[..., None] * inv


def rope_hf_formula(x, positions, base=10000.0):
    """HF transformers: x * cos + rotate_half(x) * sin with cos/sin concatenated twice."""
    D = x.shape[-1]
    emb = np.concatenate([angles_f64(positions, D, base)] * 2, axis=-1)
    rotate_half = np.concatenate([-x[..., D // 2 :], x[..., : D // 2]], axis=-1)
    return x * np.cos(emb) + rotate_half * np.sin(emb)


def rope_gptj_formula(x, positions, base=10000.0):
    """GPT-J: x * cos + rotate_every_two(x) * sin with cos/sin repeat-interleaved."""
    D = x.shape[-1]
    emb = np.repeat(angles_f64(positions, D, base), 2, axis=-1)
    rot = np.stack([-x[..., 1::2], x[..., 0::2]], axis=-1).reshape(x.shape)
    return x * np.cos(emb) + rot * np.sin(emb)


def rope_complex(x, positions, base=10000.0):
    """RoFormer / Meta Llama: pairs (x[2i], x[2i+1]) as complex numbers times e^{i theta}."""
    z = (x[..., 0::2] + 1j * x[..., 1::2]) * np.exp(1j * angles_f64(positions, x.shape[-1], base))
    return np.stack([z.real, z.imag], axis=-1).reshape(x.shape)


def alibi_reference(n):
    """ALiBi reference code (Press et al.), transcribed with floats and recursion."""

    def pow2(m):
        start = 2 ** (-(2 ** -(math.log2(m) - 3)))
        return [start * start**i for i in range(m)]

    if math.log2(n).is_integer():
        return pow2(n)
    c = 2 ** math.floor(math.log2(n))
    return pow2(c) + alibi_reference(2 * c)[0::2][: n - c]


# ---- sinusoidal ---------------------------------------------------------------------------


@pytest.mark.parametrize("length,d_model", [(1, 1), (7, 4), (13, 9), (50, 16), (5, 33)])
def test_sinusoidal_matches_loop(length, d_model):
    pe = sinusoidal(length, d_model)
    assert pe.shape == (length, d_model)
    assert pe.dtype == np.float64
    np.testing.assert_allclose(pe, sinusoidal_loop(length, d_model), rtol=0, atol=1e-12)


def test_sinusoidal_custom_base_and_dtype():
    pe = sinusoidal(11, 6, base=500.0, dtype=np.float32)
    assert pe.dtype == np.float32
    np.testing.assert_allclose(pe, sinusoidal_loop(11, 6, base=500.0), rtol=0, atol=1e-6)


def test_sinusoidal_known_values():
    pe = sinusoidal(3, 5)
    # position 0: sin(0)=0 on even features, cos(0)=1 on odd ones; odd D ends with a sine.
    np.testing.assert_array_equal(pe[0], [0.0, 1.0, 0.0, 1.0, 0.0])
    # feature pair 0 has frequency 1: plain sin(pos), cos(pos).
    np.testing.assert_allclose(pe[:, 0], np.sin([0, 1, 2]), atol=1e-15)
    np.testing.assert_allclose(pe[:, 1], np.cos([0, 1, 2]), atol=1e-15)
    # last column (feature 4 = 2i with i=2): sin(pos / 10000^(4/5)).
    np.testing.assert_allclose(pe[2, 4], math.sin(2 / 10000 ** 0.8), atol=1e-15)


def test_sinusoidal_empty_and_numpy_ints():
    assert sinusoidal(0, 8).shape == (0, 8)
    assert sinusoidal(np.int64(3), np.int32(4)).shape == (3, 4)


@pytest.mark.parametrize(
    "kwargs,exc,needle",
    [
        ({"length": -1, "d_model": 4}, ValueError, "length"),
        ({"length": 2.0, "d_model": 4}, TypeError, "length"),
        ({"length": "3", "d_model": 4}, TypeError, "length"),
        ({"length": True, "d_model": 4}, TypeError, "length"),
        ({"length": 3, "d_model": -2}, ValueError, "d_model"),
        ({"length": 3, "d_model": 4.5}, TypeError, "d_model"),
        ({"length": 3, "d_model": 4, "base": 0}, ValueError, "base"),
        ({"length": 3, "d_model": 4, "base": -10.0}, ValueError, "base"),
        ({"length": 3, "d_model": 4, "base": float("nan")}, ValueError, "base"),
        ({"length": 3, "d_model": 4, "base": 10**400}, ValueError, "base"),
        ({"length": 3, "d_model": 4, "base": "1e4"}, TypeError, "base"),
        ({"length": 3, "d_model": 4, "dtype": np.int32}, TypeError, "dtype"),
    ],
)
def test_sinusoidal_errors(kwargs, exc, needle):
    with pytest.raises(exc, match=needle):
        sinusoidal(**kwargs)


def test_sinusoidal_error_reports_value_got():
    with pytest.raises(ValueError, match=r"length must be >= 0, got -5"):
        sinusoidal(-5, 4)


# ---- rope: numpy against references -------------------------------------------------------


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("shape", [(5, 2), (6, 8), (2, 3, 7, 10)])
def test_rope_matches_loop(shape, interleaved):
    x = RNG.standard_normal(shape)
    out = rope(x, interleaved=interleaved)
    assert isinstance(out, np.ndarray) and out.shape == x.shape and out.dtype == np.float64
    np.testing.assert_allclose(out, rope_loop(x, interleaved=interleaved), rtol=0, atol=1e-12)


def test_rope_matches_published_formulas():
    x = RNG.standard_normal((2, 3, 9, 12))
    pos = np.array([0, 1, 2, 5, 17, 100, 1000, 4095, 70000])
    np.testing.assert_allclose(rope(x, pos), rope_hf_formula(x, pos), atol=1e-10)
    np.testing.assert_allclose(rope(x, pos, interleaved=True), rope_gptj_formula(x, pos), atol=1e-10)
    np.testing.assert_allclose(rope(x, pos, interleaved=True), rope_complex(x, pos), atol=1e-10)


def test_rope_custom_base_and_explicit_positions():
    x = RNG.standard_normal((4, 6))
    pos = [3, 9, 0, 42]
    for interleaved in (False, True):
        np.testing.assert_allclose(
            rope(x, pos, base=500000.0, interleaved=interleaved),
            rope_loop(x, pos, base=500000.0, interleaved=interleaved),
            atol=1e-12,
        )


def test_rope_none_equals_arange_and_zero_is_identity():
    x = RNG.standard_normal((3, 5, 8))
    np.testing.assert_array_equal(rope(x), rope(x, np.arange(5)))
    np.testing.assert_array_equal(rope(x, np.zeros(5, dtype=np.int64)), x)
    # The input is not modified in place.
    x_copy = x.copy()
    rope(x, interleaved=True)
    np.testing.assert_array_equal(x, x_copy)


def test_rope_per_batch_positions_for_kv_cache_decoding():
    B, H, L, D = 3, 2, 4, 8
    x = RNG.standard_normal((B, H, L, D))
    offsets = np.array([0, 7, 30])
    pos = offsets[:, None, None] + np.arange(L)  # (B, 1, L)
    out = rope(x, pos)
    for b in range(B):
        np.testing.assert_allclose(out[b], rope_loop(x[b], offsets[b] + np.arange(L)), atol=1e-12)


def test_rope_decoding_one_token_matches_full_sequence():
    x = RNG.standard_normal((2, 10, 16))
    full = rope(x)
    for t in (0, 4, 9):
        step = rope(x[:, t : t + 1, :], positions=[t])
        np.testing.assert_allclose(step, full[:, t : t + 1, :], atol=1e-12)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64, np.longdouble])
def test_rope_keeps_numpy_dtype(dtype):
    x = RNG.standard_normal((6, 8)).astype(dtype)
    out = rope(x)
    assert out.dtype == dtype
    tol = {np.float16: 5e-3, np.float32: 1e-6, np.float64: 1e-12, np.longdouble: 1e-12}[dtype]  # wider: float64
    np.testing.assert_allclose(out.astype(np.float64), rope_loop(x), atol=tol)


def test_rope_empty_sequence():
    out = rope(np.zeros((2, 0, 4)))
    assert out.shape == (2, 0, 4)


# ---- rope: properties ---------------------------------------------------------------------


@pytest.mark.parametrize("interleaved", [False, True])
def test_rope_preserves_pair_and_vector_norms(interleaved):
    D = 16
    x = RNG.standard_normal((3, 11, D))
    pos = RNG.integers(0, 10_000, size=11)
    out = rope(x, pos, interleaved=interleaved)
    if interleaved:
        a, b = np.arange(0, D, 2), np.arange(1, D, 2)
    else:
        a, b = np.arange(D // 2), np.arange(D // 2, D)
    np.testing.assert_allclose(np.hypot(out[..., a], out[..., b]), np.hypot(x[..., a], x[..., b]), rtol=1e-12)
    np.testing.assert_allclose(np.linalg.norm(out, axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-12)
    # ...and it is not the identity, so the norm check is not vacuous.
    assert not np.allclose(out, x)


@pytest.mark.parametrize("interleaved", [False, True])
def test_rope_dot_product_depends_only_on_relative_position(interleaved):
    D = 32
    q = RNG.standard_normal((1, D))
    k = RNG.standard_normal((1, D))

    def score(m, n):
        return float(rope(q, [m], interleaved=interleaved)[0] @ rope(k, [n], interleaved=interleaved)[0])

    for delta in (0, 1, 5, -3, 250):
        ref = score(delta, 0) if delta >= 0 else score(0, -delta)
        for shift in (1, 17, 1000, 123456):
            m, n = max(delta, 0) + shift, max(-delta, 0) + shift
            assert m - n == delta
            assert score(m, n) == pytest.approx(ref, rel=1e-9, abs=1e-9)
    # Different offsets give different scores: the position information is really there.
    assert abs(score(5, 0) - score(6, 0)) > 1e-6


def test_rope_inverse_is_negative_positions():
    x = RNG.standard_normal((4, 9, 8))
    pos = np.arange(9) * 13
    for interleaved in (False, True):
        back = rope(rope(x, pos, interleaved=interleaved), -pos, interleaved=interleaved)
        np.testing.assert_allclose(back, x, atol=1e-12)


def test_rope_interleaved_equals_half_split_after_permutation():
    D = 12
    x = RNG.standard_normal((2, 7, D))
    pos = np.array([0, 3, 8, 21, 55, 144, 377])
    # Interleaved pair (2i, 2i+1) becomes half-split pair (i, i + D/2).
    perm = np.concatenate([np.arange(0, D, 2), np.arange(1, D, 2)])
    inter = rope(x, pos, interleaved=True)
    half = rope(x[..., perm], pos, interleaved=False)
    np.testing.assert_allclose(half, inter[..., perm], atol=1e-12)
    # Without the permutation the layouts really do differ.
    assert not np.allclose(rope(x, pos, interleaved=False), inter)


# ---- rope: errors -------------------------------------------------------------------------


def test_rope_odd_feature_dim_names_x_and_shape():
    with pytest.raises(ValueError, match=r"x .*even.*\(2, 5, 7\)"):
        rope(np.zeros((2, 5, 7)))


def test_rope_rank_too_small():
    with pytest.raises(ValueError, match=r"x must have shape \(\.\.\., L, D\).*\(8,\)"):
        rope(np.zeros(8))


def test_rope_integer_x():
    with pytest.raises(TypeError, match="x must be a floating"):
        rope(np.zeros((4, 8), dtype=np.int64))


@pytest.mark.parametrize(
    "positions,exc,needle",
    [
        (np.arange(4), ValueError, r"positions must have shape \(5,\).*got shape \(4,\)"),
        (np.arange(6), ValueError, r"positions.*got shape \(6,\)"),
        (np.zeros((2, 1, 1), dtype=int), ValueError, r"positions.*got shape \(2, 1, 1\)"),
        (np.zeros((3, 1, 5), dtype=int), ValueError, r"positions.*got shape \(3, 1, 5\)"),
        (np.zeros((1, 2, 3, 5), dtype=int), ValueError, r"positions.*got shape \(1, 2, 3, 5\)"),
        (np.int64(3), ValueError, r"positions.*got shape \(\)"),
        (np.arange(5.0), TypeError, r"positions must hold integers.*float64"),
        (np.ones(5, dtype=bool), TypeError, r"positions must hold integers.*bool"),
    ],
)
def test_rope_bad_positions(positions, exc, needle):
    x = np.zeros((2, 3, 5, 4))
    with pytest.raises(exc, match=needle):
        rope(x, positions)


def test_rope_bad_base_and_flag():
    with pytest.raises(ValueError, match="base"):
        rope(np.zeros((3, 4)), base=0.0)
    with pytest.raises(TypeError, match="interleaved"):
        rope(np.zeros((3, 4)), interleaved="yes")


# ---- rope: torch --------------------------------------------------------------------------


def test_import_does_not_import_torch():
    # Load the module file by itself so only positional.py's own imports count.
    code = textwrap.dedent(
        f"""
        import importlib.util, sys
        spec = importlib.util.spec_from_file_location("positional_alone", {positional.__file__!r})
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        import numpy as np
        mod.sinusoidal(4, 6); mod.rope(np.ones((3, 4))); mod.alibi_slopes(5)
        print("torch" in sys.modules)
        """
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert res.stdout.strip() == "False"


@pytest.mark.parametrize("interleaved", [False, True])
def test_rope_torch_matches_numpy_float64(interleaved):
    torch = pytest.importorskip("torch")
    x = RNG.standard_normal((2, 3, 6, 8))
    pos = np.array([[[0, 1, 2, 50, 51, 52]], [[9, 10, 11, 12, 13, 14]]])  # (2, 1, 6)
    out_t = rope(torch.from_numpy(x), torch.from_numpy(pos), interleaved=interleaved)
    assert isinstance(out_t, torch.Tensor) and out_t.dtype == torch.float64
    np.testing.assert_allclose(out_t.numpy(), rope(x, pos, interleaved=interleaved), atol=1e-12)
    np.testing.assert_allclose(out_t.numpy(), rope_loop(x, pos, interleaved=interleaved), atol=1e-12)


def test_rope_torch_float32_close_to_numpy_and_accepts_numpy_positions():
    torch = pytest.importorskip("torch")
    x = RNG.standard_normal((4, 20, 16)).astype(np.float32)
    pos = np.arange(20) + 100
    out_t = rope(torch.from_numpy(x), pos)  # NumPy positions with a torch x
    assert out_t.dtype == torch.float32
    # Torch uses float32 angles (as HF does), NumPy float64: small differences only.
    np.testing.assert_allclose(out_t.numpy(), rope(x, pos), atol=1e-4)
    np.testing.assert_allclose(out_t.numpy(), rope_hf_formula(x.astype(np.float64), pos), atol=1e-4)


@pytest.mark.parametrize("dtype_name", ["float16", "bfloat16", "float32", "float64"])
def test_rope_torch_keeps_dtype(dtype_name):
    torch = pytest.importorskip("torch")
    dtype = getattr(torch, dtype_name)
    x64 = torch.randn(2, 5, 8, dtype=torch.float64)
    out = rope(x64.to(dtype))
    assert out.dtype == dtype and out.shape == x64.shape and out.device == x64.device
    tol = {"float16": 1e-2, "bfloat16": 5e-2, "float32": 1e-5, "float64": 1e-12}[dtype_name]
    np.testing.assert_allclose(out.double().numpy(), rope_loop(x64.numpy()), atol=tol)


@pytest.mark.parametrize("dtype_name", ["float16", "bfloat16"])
def test_rope_torch_at_far_positions_rounds_only_its_result(dtype_name):
    """Angles in float32 for half-precision x (in x's dtype, position 70001's would be off by
    hundreds of radians): the result carries a few roundings of its own and the float32 angles'
    error (position * 2^-23 radians at most) only."""
    torch = pytest.importorskip("torch")
    dtype = getattr(torch, dtype_name)
    x = torch.from_numpy(np.random.default_rng(5).standard_normal((2, 8, 64))).to(dtype)  # the values rope sees
    pos = np.array([0, 3, 1000, 2047, 4095, 9999, 70000, 70001])
    want = rope_loop(x.double().numpy(), pos)
    rounding = np.abs(torch.from_numpy(want).to(dtype).double().numpy() - want).max()
    angles = pos.max() * 2.0**-23 * np.abs(want).max()
    assert np.abs(rope(x, pos).double().numpy() - want).max() <= 3 * rounding + angles


def test_rope_torch_gradients_flow():
    torch = pytest.importorskip("torch")
    x = torch.randn(2, 3, 7, 8, dtype=torch.float64, requires_grad=True)
    pos = torch.arange(7) * 5
    for interleaved in (False, True):
        x.grad = None
        upstream = torch.randn(2, 3, 7, 8, dtype=torch.float64)
        out = rope(x, pos, interleaved=interleaved)
        assert out.requires_grad
        (out * upstream).sum().backward()
        # RoPE is a rotation R, so dL/dx = R^T g = rotation by the negative angle.
        expected = rope(upstream, -pos, interleaved=interleaved)
        torch.testing.assert_close(x.grad, expected, atol=1e-12, rtol=0)
    assert torch.autograd.gradcheck(lambda t: rope(t, pos[:3]), (x[0, 0, :3].detach().clone().requires_grad_(),))


def test_rope_torch_errors():
    torch = pytest.importorskip("torch")
    with pytest.raises(ValueError, match=r"x .*even.*\(3, 5\)"):
        rope(torch.zeros(3, 5))
    with pytest.raises(TypeError, match="x must be a floating"):
        rope(torch.zeros(3, 4, dtype=torch.int64))
    with pytest.raises(TypeError, match="positions must hold integers"):
        rope(torch.zeros(3, 4), torch.arange(3.0))
    with pytest.raises(ValueError, match=r"positions.*got shape \(2,\)"):
        rope(torch.zeros(3, 4), torch.arange(2))


# ---- ALiBi --------------------------------------------------------------------------------


def test_alibi_8_heads():
    s = alibi_slopes(8)
    assert s.dtype == np.float64 and s.shape == (8,)
    np.testing.assert_array_equal(s, [1 / 2, 1 / 4, 1 / 8, 1 / 16, 1 / 32, 1 / 64, 1 / 128, 1 / 256])


def test_alibi_12_heads_written_out():
    # c = 8: 2^-1 .. 2^-8; then the 16-head sequence (start 2^-0.5) at odd powers:
    # 2^-0.5, 2^-1.5, 2^-2.5, 2^-3.5 (the first n - c = 4 of every other slope).
    expected = [
        0.5, 0.25, 0.125, 0.0625, 0.03125, 0.015625, 0.0078125, 0.00390625,
        0.7071067811865476, 0.3535533905932738, 0.1767766952966369, 0.08838834764831845,
    ]  # fmt: skip
    np.testing.assert_allclose(alibi_slopes(12), expected, rtol=1e-14)


def test_alibi_small_and_power_of_two_counts():
    np.testing.assert_allclose(alibi_slopes(1), [2.0**-8], rtol=1e-15)
    np.testing.assert_allclose(alibi_slopes(2), [2.0**-4, 2.0**-8], rtol=1e-15)
    np.testing.assert_allclose(alibi_slopes(3), [2.0**-4, 2.0**-8, 2.0**-2], rtol=1e-15)
    np.testing.assert_allclose(alibi_slopes(16), [2.0 ** (-k / 2) for k in range(1, 17)], rtol=1e-14)


@pytest.mark.parametrize("n", list(range(1, 70)) + [96, 100, 128])
def test_alibi_matches_reference_code(n):
    s = alibi_slopes(np.int64(n) if n % 2 else n)
    assert s.shape == (n,)
    np.testing.assert_allclose(s, alibi_reference(n), rtol=1e-13)
    assert np.all((s > 0) & (s < 1))


@pytest.mark.parametrize(
    "value,exc",
    [(0, ValueError), (-4, ValueError), (2.0, TypeError), ("8", TypeError), (True, TypeError), (None, TypeError)],
)
def test_alibi_errors(value, exc):
    with pytest.raises(exc, match="num_heads"):
        alibi_slopes(value)
