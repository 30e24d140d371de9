"""One validation and normalisation pass at the edge; every user-facing error message lives here.

``prepare`` turns what the user passed to ``qkv.attention`` into an ``AttentionInputs``:
q, k, v reshaped to 4-D ``(B, H, L, D)`` (B = the flattened leading dims), a mask object
(or None), a tuple of score modifiers, a float scale. Backends trust what it returns.
"""
from __future__ import annotations

import math
import sys
import numbers
from dataclasses import dataclass, field

import numpy as np

from . import _arrays

FLOAT_DTYPES = ("float64", "float32", "bfloat16", "float16")


# --------------------------------------------------------------------------------------
# Small checks (also used by the mask constructors)
# --------------------------------------------------------------------------------------
def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _is_finite_real(x) -> bool:
    """A real number that a float holds finitely (an int past float's range is not)."""
    try:
        return _is_real(x) and math.isfinite(x)
    except OverflowError:
        return False


def check_bool(name, value) -> bool:
    """A flag: True or False (NumPy's too), never a truthy string or array taken as one."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")
    return bool(value)


def check_positive_int(name, value):
    if not _is_int(value) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def check_nonnegative_int(name, value):
    if not _is_int(value) or value < 0:
        raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
    return int(value)


def check_positive_float(name, value):
    if not _is_finite_real(value) or value <= 0:
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")
    return float(value)


def check_choice(name, value, choices):
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}; got {value!r}")
    return value


def check_window_side(name, value):
    if value is None:
        return None
    if not _is_int(value) or value < 0:
        raise ValueError(f"window {name} must be a non-negative integer or None (no limit), got {value!r}")
    return int(value)


def check_callable(name, fn):
    if not callable(fn):
        raise TypeError(f"{name} must be callable, got {type(fn).__name__}")
    return fn


def _refuse_numpy_subclasses(name, values):
    """A mask's parameters (lengths, ids, slopes) as plain arrays: a masked array's mask would
    be ignored, a matrix would stay 2-D. (Their byte order converts safely.)"""
    if isinstance(values, (np.matrix, np.ma.MaskedArray)):
        check_plain_numpy(name, values)


def _int_array(name, values, ndim_ok):
    _refuse_numpy_subclasses(name, values)
    arr = _arrays.to_numpy(values) if _arrays.kind_of(values) == "torch" else np.asarray(values)
    if arr.dtype == bool or not (np.issubdtype(arr.dtype, np.integer) or arr.size == 0):
        raise TypeError(f"{name} must hold integers, got dtype {arr.dtype}")
    if arr.ndim not in ndim_ok:
        raise ValueError(f"{name} must have {' or '.join(map(str, ndim_ok))} dims, got shape {arr.shape}")
    if arr.dtype.kind == "u" and arr.size and arr.max() > np.iinfo(np.int64).max:  # would wrap negative
        raise ValueError(f"{name} must fit in int64, got {arr.max()}")
    return arr.astype(np.int64)


def check_lengths(name, lengths):
    arr = _int_array(name, lengths, (0, 1)).reshape(-1)
    if (arr < 0).any():
        raise ValueError(f"{name} must be non-negative, got {arr.tolist()}")
    return arr


class SizeMismatch(ValueError):
    """A mask's data sized for other batch rows or heads than it is evaluated for (materialize
    and to_string then say how to give theirs). dims: which of "batch" and "heads" differ."""

    def __init__(self, message, dims=("batch",)):
        super().__init__(message)
        self.dims = frozenset(dims)


def check_lengths_fit(name, lengths, batch, limit, limit_name):
    if lengths.shape[0] != batch:
        raise SizeMismatch(f"{name} needs one entry per batch row ({batch}), got {lengths.shape[0]}")
    if batch and lengths.max() > limit:
        raise ValueError(f"{name} must be at most {limit_name} = {limit}, got {lengths.max()}")


def check_ids(name, ids):
    arr = _int_array(name, ids, (1, 2))
    return arr.reshape(1, -1) if arr.ndim == 1 else arr


def check_ids_fit(name, ids, batch, length, length_name):
    if ids.shape != (batch, length) and ids.shape != (1, length):
        error = SizeMismatch if ids.shape[1] == length else ValueError  # only the batch rows differ
        raise error(f"{name} must have shape (B, {length_name}) = ({batch}, {length}), got {ids.shape}")


def check_slopes(name, slopes):
    _refuse_numpy_subclasses(name, slopes)
    arr = np.asarray(_arrays.to_numpy(slopes), dtype=None)
    if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.floating) and not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"{name} must be a 1-D array of numbers (one per query head), got {arr.dtype} {arr.shape}")
    if not np.isfinite(arr).all():
        raise ValueError(f"{name} must be finite, got {arr.tolist()}")
    return arr.astype(np.float64)


def check_size(name, arr, expected, what):
    if arr.shape[0] != expected:
        raise ValueError(f"{name} must have {what} ({expected}) entries, got {arr.shape[0]}")


def broadcasts_to(shape, target) -> bool:
    """Whether an array of `shape` broadcasts to exactly `target` (tuples)."""
    try:
        return np.broadcast_shapes(shape, target) == target
    except ValueError:
        return False


def check_rule_result(name, result, *indices):
    """A rule's answer at broadcast index arrays: boolean, of a shape that broadcasts to theirs
    (returned as an array of their kind)."""
    if _arrays.kind_of(result) is None or str(result.dtype) not in ("bool", "torch.bool"):
        got = type(result).__name__ if _arrays.kind_of(result) is None else f"dtype {result.dtype}"
        raise TypeError(f"{name}: the rule must return a boolean array, got {got}")
    expected = np.broadcast_shapes(*(tuple(i.shape) for i in indices))
    if not broadcasts_to(tuple(result.shape), expected):
        raise ValueError(f"{name}: the rule returned shape {tuple(result.shape)}, which does not broadcast to "
                         f"{expected}, the shape of its (b, h, qi, ki) arguments broadcast together")
    return _arrays.like(result, indices[0])  # a NumPy answer for torch indices, or the other way round


def check_score_result(name, result, scores):
    """A score rule's answer for `scores`: a floating array that broadcasts to their shape,
    returned as an array of their kind, dtype and shape."""
    kind = _arrays.kind_of(result)
    if kind is None or dtype_name(result) not in FLOAT_DTYPES:
        got = type(result).__name__ if kind is None else f"dtype {result.dtype}"
        raise TypeError(f"{name}: the rule must return an array of floating scores, got {got}")
    if not broadcasts_to(tuple(result.shape), tuple(scores.shape)):
        raise ValueError(f"{name}: the rule returned shape {tuple(result.shape)}, which does not broadcast to "
                         f"{tuple(scores.shape)}, the shape of the scores it was given")
    result = _arrays.cast_like(_arrays.like(result, scores), scores)
    if tuple(result.shape) != tuple(scores.shape):  # a writable array of the scores' shape: backends update it
        result = result + _arrays.namespace(scores).zeros_like(scores)
    return result


def check_strided(name, x):
    """A torch tensor of another layout (sparse, mkldnn) has no strides to read, and one on the
    meta device no values; NumPy subclasses and byte orders as check_plain_numpy: named here,
    not deep inside a backend."""
    torch = sys.modules.get("torch")
    if isinstance(x, np.ndarray):
        check_plain_numpy(name, x)
    if _arrays.is_torch(x) and x.device.type == "meta":
        raise ValueError(f"{name} is on the meta device, which holds no values to attend over; "
                         f"pass tensors with data")
    if _arrays.is_torch(x) and x.layout is not torch.strided:
        hint = f"pad it ({name}.to_padded_tensor) and mask the padding" if x.layout is torch.jagged else \
            f"pass {name}.to_dense()"
        raise TypeError(f"{name} must be a dense (strided) tensor, got layout {x.layout}; {hint}")


def check_dense_mask(name, array):
    if _arrays.kind_of(array) is None:
        raise TypeError(f"{name} must be a numpy.ndarray or torch.Tensor, got {type(array).__name__}")
    check_strided(name, array)
    if dtype_name(array) != "bool":
        raise TypeError(f"{name} must be boolean (True = attend), got dtype {array.dtype}")
    return array


def fit_dense(name, array, geom):
    """View a mask/bias array broadcastable to (..., Hq, Lq, Lk) as 4-D (B|1, H|1, Lq|1, Lk|1)."""
    shape, batch_shape = tuple(array.shape), geom.batch_shape
    expected = f"(..., Hq, Lq, Lk) = {batch_shape + (geom.heads, geom.Lq, geom.Lk)}"
    tail = (1,) * (3 - len(shape)) + shape[-3:]  # (H|1, Lq|1, Lk|1): a (Lk,) mask is one row for all
    lead = shape[:-3]
    fits_tail = all(s in (1, t) for s, t in zip(tail, (geom.heads, geom.Lq, geom.Lk)))
    fits_lead = len(lead) <= len(batch_shape) and all(
        s in (1, t) for s, t in zip(lead[::-1], batch_shape[::-1]))
    if not (fits_tail and fits_lead):
        message = f"{name} of shape {shape} does not broadcast to {expected}"
        if not all(s in (1, t) for s, t in zip(tail[1:], (geom.Lq, geom.Lk))):
            raise ValueError(message)
        differ = (("batch", not fits_lead), ("heads", tail[0] not in (1, geom.heads)))  # only these
        raise SizeMismatch(message, [dim for dim, differs in differ if differs])
    if math.prod(lead) == 1:
        return array.reshape((1,) + tail)
    full_lead = np.broadcast_shapes(lead, batch_shape) if len(lead) else batch_shape
    return _arrays.broadcast_to(array.reshape((1,) * (len(batch_shape) - len(lead)) + lead + tail),
                                full_lead + tail).reshape((geom.batch,) + tail)


_DTYPE_NAMES: dict = {}  # dtype object -> "float32", ...: str() of a dtype costs ~0.5 µs a call


def dtype_name(x) -> str:
    """The name of an array's dtype without the "torch." prefix: "float32", "bfloat16", "bool"..."""
    name = _DTYPE_NAMES.get(x.dtype)
    if name is None:
        name = _DTYPE_NAMES[x.dtype] = str(x.dtype).replace("torch.", "")
    return name


# --------------------------------------------------------------------------------------
# The normalised call
# --------------------------------------------------------------------------------------
@dataclass
class AttentionInputs:
    """A validated attention call. q (B, Hq, Lq, D), k (B, Hkv, Lk, D), v (B, Hkv, Lk, Dv)."""

    q: object
    k: object
    v: object
    kind: str  # "numpy" or "torch"
    dtype: str  # "float32", ...
    device: str  # "cpu", "cuda:0", ...
    batch_shape: tuple  # the leading dims of the caller's q, flattened into B
    head_shape: tuple  # () for 2-D inputs, (Hq,) otherwise
    scale: float
    mask: object = None  # a qkv Mask or None
    score_mods: tuple = ()
    dropout_p: float = 0.0
    seed: int | None = None
    needs_grad: bool = False
    needs_lse: bool = True  # False: the caller drops lse, so a backend may return None for it
    dropped_mask: object = None  # a mask given but not applied: it forbids nothing at these sizes
    _geom: object = field(default=None, init=False, repr=False)
    tile_classes: dict = field(default_factory=dict, init=False, repr=False)  # (block_q, block_k) -> classes

    def __post_init__(self):
        # The sizes, read once: a torch tensor's .shape costs about 0.3 µs a read, and the
        # dispatch and the backends read them a dozen times a call.
        self.B, self.Hq, self.Lq, self.D = self.q.shape
        _, self.Hkv, self.Lk, _ = self.k.shape
        self.Dv = self.v.shape[3]
        self.group = self.Hq // self.Hkv if self.Hkv else 1

    @property
    def geom(self):
        """The sizes masks and score modifiers are evaluated for (built when first asked for:
        most calls have neither)."""
        if self._geom is None:
            self._geom = masks.Geometry(self.B, self.Hq, self.Lq, self.Lk, self.batch_shape, self.kind)
        return self._geom

    def output_shape(self, last: int) -> tuple:
        """The caller's shape for a result whose last dim is `last` (Dv, or Lk for weights)."""
        return self.batch_shape + self.head_shape + (self.Lq, last)

    def lse_shape(self) -> tuple:
        return self.batch_shape + self.head_shape + (self.Lq,)

    def _read_by_rules(self) -> tuple[list, list]:
        """(the arrays of dense masks and biases, the torch tensors the user's rules read
        directly) in the mask and score modifiers."""
        rules = ([self.mask] if self.mask is not None else []) + list(self.score_mods)
        return ([a for rule in rules for a in masks.held_arrays(rule)],
                [t for rule in rules for t in masks.tensors_rules_read(rule)])

    def held_tensors(self) -> tuple:
        """The torch tensors of the mask and score modifiers, which a backward reads again (and
        checks for changes in place): dense masks, biases, and the tensors the user's rules read
        directly. A NumPy dense mask or bias is refused: its changes would go unseen."""
        dense, read = self._read_by_rules()
        if not all(_arrays.is_torch(a) for a in dense):
            raise TypeError("a dense mask or bias holds a NumPy array, and torch inputs record gradients: the "
                            "backward reads it again and could not tell if it changed in place; pass it as a "
                            "torch tensor (torch.from_numpy(array))")
        return tuple(dense) + tuple(read)

    def carries_tangents(self) -> bool:
        """Whether forward-mode AD gave a tangent to q, k, v or a torch tensor the mask and
        score modifiers read (torch inputs)."""
        if not _arrays.forward_ad_active():  # the common case, answered without walking the rules
            return False
        dense, read = self._read_by_rules()
        return _arrays.has_tangents(self.q, self.k, self.v, *(a for a in dense if _arrays.is_torch(a)), *read)

    def to_caller(self, out, lse):
        """A backend's (out, lse), (B, Hq, Lq, Dv) and (B, Hq, Lq) or None, in the caller's shapes."""
        if len(self.batch_shape) == 1 and self.head_shape:  # 4-D in: the shapes already are the caller's
            return out, lse
        shapes = self.output_shape(self.Dv), self.lse_shape()
        return tuple(x if x is None or tuple(x.shape) == shape else x.reshape(shape)
                     for x, shape in zip((out, lse), shapes))


def _listed(names) -> str:
    """("q", "k", "v") -> "q, k and v"; ("q", "k") -> "q and k"."""
    return f"{', '.join(names[:-1])} and {names[-1]}"


def _check_tensor(name, x, kind, names=("q", "k", "v")):
    got = _arrays.kind_of(x)
    if got is None:
        raise TypeError(f"{name} must be a numpy.ndarray or torch.Tensor, got {type(x).__name__}")
    if kind is not None and got != kind:
        raise TypeError(f"{_listed(names)} must all be NumPy arrays or all torch tensors; "
                        f"{names[0]} is {kind}, {name} is {got}")
    check_strided(name, x)  # NumPy subclasses and byte orders too
    dtype = dtype_name(x)
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must have a floating dtype ({', '.join(FLOAT_DTYPES)}), got {dtype}")
    if x.ndim < 2:
        raise ValueError(f"{name} must have at least 2 dims (..., L, D), got shape {tuple(x.shape)}")
    return got, dtype


def check_plain_numpy(name, x):
    """NumPy subclasses whose arithmetic differs (a matrix stays 2-D, a masked array's mask
    would be ignored by some backends) and byte orders the kernels do not read."""
    if isinstance(x, np.matrix):
        raise TypeError(f"{name} is a numpy.matrix, which stays 2-D whatever is done to it; "
                        f"pass np.asarray({name})")
    if isinstance(x, np.ma.MaskedArray):
        raise TypeError(f"{name} is a masked array: its mask would not be applied. Pass the data "
                        f"({name}.data) and express the masked entries as a qkv mask")
    if not x.dtype.isnative:
        raise TypeError(f"{name} has non-native byte order ({x.dtype.str}); convert it with "
                        f"{name}.astype({name}.dtype.newbyteorder('='))")


def check_qkv(q, k, v, names=("q", "k", "v"), heads=True):
    """Validate q, k, v and return their kind (`names` are the caller's argument names).

    heads: the inputs are (..., H, L, D); without, (..., L, D) with every leading dim a batch dim.
    Two names: a call without values (as attention_stats makes), v being k, named alone.
    """
    nq, nk, nv = names if len(names) == 3 else (*names, names[1])
    listed = _listed(names)
    kind, q_dtype = _check_tensor(nq, q, None, names)
    # the common case in one test: k and v then pass every check q passed
    if not (type(q) is type(k) is type(v) and q.dtype == k.dtype == v.dtype and q.ndim == k.ndim == v.ndim):
        k_dtype, v_dtype = _check_tensor(nk, k, kind, names)[1], _check_tensor(nv, v, kind, names)[1]
        if not q_dtype == k_dtype == v_dtype:
            dtypes = {nq: q_dtype, nk: k_dtype, nv: v_dtype}
            raise TypeError(f"{listed} must share one dtype (no silent casts); got {dtypes}")
    if kind == "torch" and not q.layout == k.layout == v.layout:  # q's was checked
        for name, x in ((nk, k), (nv, v)):
            check_strided(name, x)
    if kind == "torch" and not (q.is_cpu and k.is_cpu and v.is_cpu) and not q.device == k.device == v.device:
        devices = ", ".join(str(x.device) for x in (q, k, v)[:len(names)])
        raise ValueError(f"{listed} must be on one device; got {devices}")
    qs, ks, vs = tuple(q.shape), tuple(k.shape), tuple(v.shape)
    if not (q.ndim == k.ndim == v.ndim):
        shapes = ", ".join(f"{n} {s}" for n, s in dict(zip((nq, nk, nv), (qs, ks, vs))).items())
        raise ValueError(f"{listed} must have the same number of dims; got shapes {shapes}")
    if ks[-1] != qs[-1]:
        raise ValueError(f"{nk}'s last dim (head dim D) must equal {nq}'s: {nq} {qs}, {nk} {ks}")
    if qs[-1] == 0:
        raise ValueError(f"the head dim D (last dim of {nq}) must be at least 1, got {nq} {qs}")
    if vs[:-1] != ks[:-1]:
        raise ValueError(f"{nv} must match {nk} in every dim but the last: {nk} {ks}, {nv} {vs}")
    batch_dims = -3 if heads else -2
    if qs[:batch_dims] != ks[:batch_dims]:
        raise ValueError(f"leading (batch) dims of {nq} and {nk} must match exactly (no broadcasting): "
                         f"{nq} {qs}, {nk} {ks}")
    if heads and q.ndim >= 3:
        hq, hkv = qs[-3], ks[-3]
        if q.ndim == 3 and hq != hkv:
            raise ValueError(f"3-D inputs are (H, L, D) and need equal head counts; got {nq} {qs}, {nk} {ks}. "
                             "Grouped-query attention needs 4-D inputs (B, H, L, D)")
        if hkv == 0 and hq != 0 or hkv and hq % hkv:
            raise ValueError(f"{nq}'s heads ({hq}) must be a multiple of {nk}'s heads ({hkv}) "
                             f"(grouped-query attention): {nq} {qs}, {nk} {ks}")
    return kind


def check_seed_mask(mask, query, key):
    """The seed door's mask: any array broadcastable to (batch, seq_q, seq_k), 0 = masked."""
    if _arrays.kind_of(mask) is None:
        raise TypeError(f"mask must be a numpy.ndarray or torch.Tensor (0 = masked), got {type(mask).__name__}")
    check_strided("mask", mask)
    target = tuple(query.shape[:-1]) + (key.shape[-2],)
    if not broadcasts_to(tuple(mask.shape), target):
        raise ValueError(f"mask of shape {tuple(mask.shape)} does not broadcast to (batch, seq_q, seq_k) = {target}")


def check_scale(scale, head_dim, dtype="float64"):
    """The scale as a float; past float32's range it would be inf in the float32 that lower
    precisions compute in, and every score NaN."""
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if not _is_finite_real(scale):
        raise ValueError(f"scale must be a finite real number or None (1/sqrt(D)), got {scale!r}")
    check_float32_range("scale", abs(scale), dtype, scale)
    return float(scale)


def check_float32_range(name, largest_magnitude, dtype, shown):
    """Lower precisions compute in float32: a number past its range would be inf there, and
    the scores it touches NaN (inf · 0)."""
    largest = float(np.finfo(np.float32).max)
    if dtype != "float64" and largest_magnitude > largest:
        raise ValueError(f"{name} must lie within float32's range (±{largest:.3g}) for {dtype} inputs, "
                         f"which compute in float32; got {shown!r}")


#: Dropout keeps a score with probability 1 - p drawn in steps of 2**-32 (a 32-bit hash
#: against a threshold): up to this p, the step is within 1e-6 of 1 - p, so scaling what is
#: kept by 1/(1 - p) stays unbiased to that much. Beyond it, refused rather than biased.
DROPOUT_P_MAX = 1.0 - 2.0**-13


def check_dropout_p(dropout_p, name="dropout_p") -> float:
    if not _is_real(dropout_p) or not (0.0 <= dropout_p < 1.0):
        raise ValueError(f"{name} must be a number in [0, 1), got {dropout_p!r}")
    if dropout_p > DROPOUT_P_MAX:
        raise ValueError(f"{name} must be at most 1 - 2**-13 (keeping at least one score in 8192): its keep "
                         f"probability is drawn in steps of 2**-32, which would bias the output; got {dropout_p!r}")
    return float(dropout_p)


def check_dropout(dropout_p, seed):
    if type(dropout_p) is float and dropout_p == 0.0 and seed is None:
        return 0.0, None  # the default, without the numbers.Real ABC checks (~1 µs)
    dropout_p = check_dropout_p(dropout_p)
    if seed is not None and (not _is_int(seed) or not 0 <= seed < 2**64):
        raise ValueError(f"seed must be an integer in [0, 2**64) or None, got {seed!r}")
    return float(dropout_p), None if seed is None else int(seed)  # int: NumPy integers would overflow the hash


def as_mask(mask, kind, dtype, records_graph=False):
    """Turn the `mask` argument into (Mask or None, extra score modifiers)."""
    if mask is None:
        return None, ()
    if isinstance(mask, masks.Mask):
        return mask, ()
    if isinstance(mask, masks.ScoreMod):
        raise TypeError(f"mask got a score modifier ({mask!r}); pass it as score_mod=")
    got = _arrays.kind_of(mask)
    if got is None:
        raise TypeError(f"mask must be a qkv mask, a boolean array (True = attend) or a float array "
                        f"(additive bias); got {type(mask).__name__}")
    if got != kind:
        raise TypeError(f"mask must be of the same kind as q ({kind}), got {got}")
    check_strided("mask", mask)
    mdtype = dtype_name(mask)
    if mdtype == "bool":
        return masks.DenseMask(mask), ()
    if mdtype in FLOAT_DTYPES:
        if mdtype != dtype:
            raise TypeError(f"a float mask (additive bias) must have q's dtype {dtype}, got {mdtype}")
        if got == "torch" and mask.requires_grad and _arrays.grad_enabled() and not records_graph:
            raise ValueError("a float mask that requires grad is not supported: qkv gives no gradient "
                             "for the bias; pass mask.detach(), or differentiate through "
                             "qkv.attention_weights(q, k, mask) @ v, which records the formula")
        return None, (masks.Bias(mask),)
    raise TypeError(f"mask must be boolean (True = attend) or float (additive bias), got dtype {mdtype}; "
                    "for a 0/1 mask use mask != 0")


def as_score_mods(score_mod):
    if score_mod is None:
        return ()
    mods = tuple(score_mod) if isinstance(score_mod, (list, tuple)) else (score_mod,)
    for m in mods:
        if not isinstance(m, masks.ScoreMod):
            raise TypeError(f"score_mod must be a qkv score modifier (alibi, softcap, score_fn) or a list "
                            f"of them, got {type(m).__name__}")
    return mods


def _to4d(x):
    """(..., H, L, D) -> (B, H, L, D); 2-D (L, D) -> (1, 1, L, D)."""
    if x.ndim == 4:
        return x  # no reshape call: several µs on a torch tensor, on every attention call
    shape = tuple(x.shape)
    if x.ndim == 2:
        return x.reshape((1, 1) + shape)
    return x.reshape((math.prod(shape[:-3]),) + shape[-3:])


def prepare(q, k, v, mask=None, *, score_mod=None, scale=None, dropout_p=0.0, seed=None,
            records_graph=False) -> AttentionInputs:
    """Validate one attention call and normalise it (see AttentionInputs).

    records_graph: the caller computes the plain formula on torch's own operations (attention
    weights, the seed's door), which torch differentiates and transforms itself: a bias that
    requires grad and torch.func transforms are then accepted."""
    kind = check_qkv(q, k, v)
    if kind == "torch" and not records_graph:
        _refuse_function_transforms()
    dtype = dtype_name(q)
    scale = check_scale(scale, q.shape[-1], dtype)
    dropout_p, seed = check_dropout(dropout_p, seed)
    mask_obj, bias_mods = as_mask(mask, kind, dtype, records_graph)
    mods = bias_mods + as_score_mods(score_mod)
    batch_shape = tuple(q.shape[:-3])
    head_shape = tuple(q.shape[-3:-2]) if q.ndim >= 3 else ()
    needs_grad = kind == "torch" and (q.requires_grad or k.requires_grad or v.requires_grad) and _arrays.grad_enabled()
    device = "cpu" if kind == "numpy" or q.is_cpu else str(q.device)
    inp = AttentionInputs(_to4d(q), _to4d(k), _to4d(v), kind, dtype, device, batch_shape, head_shape, scale,
                          mask_obj, mods, dropout_p, seed, needs_grad)
    if mask_obj is not None:
        mask_obj.check(inp.geom)
        if mask_obj.allows_every_pair(inp.geom):  # causal over a decoding step's one query per row
            inp.mask, inp.dropped_mask = None, mask_obj
    for m in mods:
        m.check(inp.geom)
        if isinstance(m, masks.Alibi):  # its largest term: a slope times the farthest key
            farthest = masks.farthest_key(inp.Lq, inp.Lk)
            check_float32_range(f"slopes times the largest distance ({farthest})", m.largest * farthest, dtype,
                                m.slopes.tolist())
    return inp


def _refuse_function_transforms():
    """torch.func's vmap and grad hand over wrapped tensors without storage, which the kernels
    cannot read (and the tiled torch code updates in place, which vmap forbids). torch.jit.trace
    records only torch's operations: not the native kernel's writes through DLPack, and the
    mask sizes become tensors."""
    torch = sys.modules["torch"]
    if torch.compiler.is_compiling():  # traced by torch.compile: real tensors come at run time
        return
    if torch.jit.is_tracing():
        raise TypeError("qkv.attention does not run under torch.jit.trace (the trace would not record its "
                        "kernels): call it eagerly, or compile with torch.compile")
    if torch._C._functorch.peek_interpreter_stack() is not None:  # a transform is running (0.1 µs to ask)
        raise TypeError("qkv.attention does not run inside torch.func transforms (vmap, grad, jacrev, jvp, "
                        "vjp): call it on plain tensors, looping over the batch for vmap, or use "
                        "torch.autograd.grad for gradients")


def refuse_trainable_rules(inp: AttentionInputs):
    """A score_fn that reads tensors which require grad (a learned relative bias, say), or alibi
    slopes that require grad or carry a tangent, would get no derivative from qkv's kernels:
    refuse them, as a float mask that requires grad is refused. The rule is tried once at
    position (0, 0, 0, 0), which every non-empty call evaluates too."""
    if inp.kind != "torch":  # nothing is recorded for NumPy inputs: what rules read are constants
        return
    slopes = [m.trainable for m in inp.score_mods if isinstance(m, masks.Alibi) and m.trainable is not None]
    if any(t.requires_grad and _arrays.grad_enabled() or _arrays.has_tangents(t) for t in slopes):
        raise ValueError("alibi slopes that require grad or carry a forward-mode tangent: qkv gives no "
                         "derivative for them. Pass slopes.detach(), or differentiate through "
                         "qkv.attention_weights(q, k, mask, score_mod=...) @ v, which records the formula "
                         "(O(Lq·Lk) memory)")
    if not _arrays.grad_enabled():
        return
    rules = [m for m in inp.score_mods if isinstance(m, masks.ScoreFn)]
    if not rules:
        return
    torch, like = sys.modules["torch"], inp.q
    score = torch.zeros((1, 1, 1, 1), dtype=like.dtype, device=like.device)
    index = torch.zeros((1, 1, 1, 1), dtype=torch.int64, device=like.device)
    for rule in rules:
        result = rule.fn(score, index, index, index + rule.first_query, index)
        if _arrays.is_torch(result) and result.requires_grad:
            raise ValueError("score_fn reads tensors that require grad: qkv gives no gradient for them. "
                             "Detach them, or differentiate through qkv.attention_weights(q, k, mask, "
                             "score_mod=...) @ v, which records the formula (O(Lq·Lk) memory)")


# masks imports this module; importing it last hands it a complete one (an import inside the
# functions above cost 0.5-1.3 µs on every attention call)
from . import masks  # noqa: E402
