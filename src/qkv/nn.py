"""Multi-head attention as a module: the NumPy class, and the computation both modules share.

Shape legend:
    B        batch rows
    Lq, Lk   query and key/value sequence lengths (Lk = filled cache + new tokens when decoding)
    d_model  model width (last dim of query, key and value)
    Hq       num_heads, the query heads;  Hkv = num_kv_heads, the key/value heads
    depth    d_model // num_heads, the per-head feature size

The computation (written once, for NumPy arrays and torch tensors alike)::

    q = split_heads(query @ W_q + b_q)             # (B, Hq, Lq, depth)
    k = split_heads(key @ W_k + b_k)               # (B, Hkv, Lk, depth)
    v = split_heads(value @ W_v + b_v)             # (B, Hkv, Lk, depth)
    heads = softmax(q·kᵀ/√depth, masked)·v         # (B, Hq, Lq, depth)   qkv.attention
    output = combine_heads(heads) @ W_o + b_o      # (B, Lq, d_model)

With num_kv_heads < num_heads each key/value head serves num_heads // num_kv_heads query
heads (grouped-query attention; num_kv_heads=1 is multi-query attention).

Parameters (the state_dict keys, the same in the NumPy and torch modules, applied as x @ W):
    W_q (d_model, Hq*depth)   W_k, W_v (d_model, Hkv*depth)   W_o (Hq*depth, d_model)
    b_q (Hq*depth,)  b_k, b_v (Hkv*depth,)  b_o (d_model,)     -- only with bias=True
"""
from __future__ import annotations

import numpy as np

from . import _arrays, inputs
from .api import attention, attention_weights
from .kv_cache import KVCache
from .masks import causal


def check_config(d_model, num_heads, num_kv_heads):
    """Validate the sizes; return (num_kv_heads, depth)."""
    d_model = inputs.check_positive_int("d_model", d_model)
    num_heads = inputs.check_positive_int("num_heads", num_heads)
    num_kv_heads = num_heads if num_kv_heads is None else inputs.check_positive_int("num_kv_heads", num_kv_heads)
    if d_model % num_heads:
        raise ValueError(f"d_model ({d_model}) must be divisible by num_heads ({num_heads})")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    return num_kv_heads, d_model // num_heads


def parameter_shapes(d_model, num_heads, num_kv_heads=None, bias=False) -> dict:
    """{state_dict key: shape}, in the order the NumPy module draws them (W_q, W_k, W_v, W_o)."""
    num_kv_heads, depth = check_config(d_model, num_heads, num_kv_heads)
    q_width, kv_width = num_heads * depth, num_kv_heads * depth
    shapes = {"W_q": (d_model, q_width), "W_k": (d_model, kv_width),
              "W_v": (d_model, kv_width), "W_o": (q_width, d_model)}
    if bias:
        shapes.update(b_q=(q_width,), b_k=(kv_width,), b_v=(kv_width,), b_o=(d_model,))
    return shapes


def init_std(d_model: int) -> float:
    """The standard deviation the weights are drawn with: sqrt(2 / d_model), as in the seed."""
    return float(np.sqrt(2.0 / d_model))


def check_state_dict(state, shapes: dict) -> None:
    """Raise ValueError unless `state` has exactly the keys of `shapes`, each with that shape."""
    if not hasattr(state, "keys"):
        raise TypeError(f"state_dict must be a mapping of names to arrays, got {type(state).__name__}")
    missing = [k for k in shapes if k not in state]
    unexpected = [k for k in state if k not in shapes]
    if missing or unexpected:
        raise ValueError(f"state_dict does not fit this module: missing keys {missing}, unexpected keys "
                         f"{unexpected} (bias=True modules have b_q, b_k, b_v, b_o)")
    for name, shape in shapes.items():
        value = state[name]
        if _arrays.kind_of(value) is None:
            raise TypeError(f"state_dict[{name!r}] must be a numpy.ndarray or torch.Tensor, "
                            f"got {type(value).__name__}")
        if tuple(value.shape) != shape:
            raise ValueError(f"state_dict[{name!r}] must have shape {shape}, got {tuple(value.shape)}")


class AttentionCore:
    """Multi-head attention written once for NumPy arrays and torch tensors.

    A subclass holds the parameters as attributes named as in ``parameter_shapes`` and
    sets ``_kind`` ("numpy" or "torch"); it calls ``_configure`` in its constructor and
    ``_attend`` from its forward.
    """

    _kind = "numpy"

    def _configure(self, d_model, num_heads, num_kv_heads, bias):
        self.num_kv_heads, self.depth = check_config(d_model, num_heads, num_kv_heads)
        self.d_model, self.num_heads, self.bias = int(d_model), int(num_heads), inputs.check_bool("bias", bias)

    def _shapes(self) -> dict:
        return parameter_shapes(self.d_model, self.num_heads, self.num_kv_heads, self.bias)

    # ---- heads --------------------------------------------------------------------------------
    def split_heads(self, x, batch_size=None, *, heads=None):
        """(B, L, heads*depth) -> (B, heads, L, depth); heads defaults to num_heads.

        ``batch_size`` is read from x; it is accepted (and checked) for the seed's
        ``split_heads(x, batch_size)``.
        """
        heads = self.num_heads if heads is None else inputs.check_positive_int("heads", heads)
        width = heads * self.depth
        _check_heads_input("split_heads", x, 3, width,
                           f"(batch, length, {width}): {heads} heads of depth {self.depth} = d_model // num_heads "
                           f"(d_model={self.d_model}, num_heads={self.num_heads})")
        _check_batch_size(batch_size, x.shape[0])
        return self._split_heads(x, heads)

    def combine_heads(self, x, batch_size=None):
        """(B, H, L, depth) -> (B, L, H*depth): the heads side by side again."""
        _check_heads_input("combine_heads", x, 4, self.depth,
                           f"(batch, heads, length, depth={self.depth}), depth = d_model // num_heads "
                           f"(d_model={self.d_model}, num_heads={self.num_heads})")
        _check_batch_size(batch_size, x.shape[0])
        return self._combine_heads(x)

    # The unchecked forms, for the module's own arrays (whose shapes it made).
    def _split_heads(self, x, heads):
        B, L = x.shape[0], x.shape[1]
        return x.reshape(B, L, heads, self.depth).swapaxes(1, 2)  # (B, heads, L, depth)

    @staticmethod
    def _combine_heads(x):
        B, H, L, depth = x.shape
        return x.swapaxes(1, 2).reshape(B, L, H * depth)  # (B, L, H*depth)

    def _project(self, x, which: str):
        """x @ W_which (+ b_which); under torch's autocast, the bias in autocast's dtype too,
        as nn.Linear's (added in float32, it promoted the heads back to float32)."""
        y = x @ getattr(self, "W_" + which)
        return y + _arrays.autocast_cast(getattr(self, "b_" + which), y) if self.bias else y

    # ---- the computation --------------------------------------------------------------------
    def call(self, tensors):
        """The seed's entry point: ``call([Q, K, V])`` -> (output, attention_weights).

        Q (B, Lq, d_model), K and V (B, Lk, d_model); output (B, Lq, d_model),
        attention_weights (B, num_heads, Lq, Lk).
        """
        if not isinstance(tensors, (list, tuple)) or len(tensors) != 3:
            length = f" of length {len(tensors)}" if isinstance(tensors, (list, tuple)) else ""
            raise TypeError(f"call expects a list [Q, K, V], got {type(tensors).__name__}{length}")
        Q, K, V = tensors
        return self(Q, K, V, need_weights=True)

    def init_cache(self, batch_size, max_len) -> KVCache:
        """An empty KV cache for decoding: keys and values (batch_size, num_kv_heads, max_len, depth).

        Call the module on the prompt, then on one token (or a few) at a time, with
        ``cache=cache``; the outputs equal those of one causal pass over the whole sequence.
        """
        return KVCache.empty(batch_size, self.num_kv_heads, max_len, self.depth, like=self.W_k)

    def _attend(self, query, key, value, mask, need_weights, cache, dropout_p, score_mod):
        """(output (B, Lq, d_model), weights (B, Hq, Lq, Lk) or None)."""
        need_weights = inputs.check_bool("need_weights", need_weights)
        query, key, value = self._check_inputs(query, key, value, cache)
        _check_mask_array(mask)
        q = self._split_heads(self._project(query, "q"), self.num_heads)  # (B, Hq, Lq, depth)
        k = self._split_heads(self._project(key, "k"), self.num_kv_heads)  # (B, Hkv, Lk, depth)
        v = self._split_heads(self._project(value, "v"), self.num_kv_heads)  # (B, Hkv, Lk, depth)
        if cache is not None and k.dtype != cache.keys.dtype:  # torch's autocast changed the projections' dtype
            q, k, v = (x.to(cache.keys.dtype) for x in (q, k, v))  # to the cache's (_check_cache refuses it elsewhere)
        mask = _arrays.autocast_cast(mask, q)  # a float mask (bias) in the heads' dtype, under autocast
        mask = _widened_bias(mask, q)
        if cache is not None:
            mask, score_mod = _with_causal(mask, score_mod, q, cache.length)
            k, v = cache.stage(k, v, q)  # (B, Hkv, length + Lq, depth): cached and new positions
        heads = attention(q, k, v, mask, score_mod=score_mod, dropout_p=dropout_p)  # (B, Hq, Lq, depth)
        weights = attention_weights(q, k, mask, score_mod=score_mod) if need_weights else None
        if cache is not None:
            cache.commit(q.shape[2])
        output = self._project(self._combine_heads(heads), "o")  # (B, Lq, d_model)
        return output, weights

    def _check_inputs(self, query, key, value, cache):
        if cache is not None:
            if not isinstance(cache, KVCache):
                raise TypeError(f"cache must be a KVCache from module.init_cache(...), got {type(cache).__name__}")
            if key is not None or value is not None:
                raise ValueError("with cache=..., the module does self-attention on query: key and value must be "
                                 "None (the cache holds the keys and values of the earlier tokens)")
        key = query if key is None else key
        value = key if value is None else value
        self._check_input("query", query)
        if key is query and value is query:  # self-attention passes one array three times: checked once
            self._check_cache(query, cache)
            return query, key, value
        if key is not query:
            self._check_input("key", key)
        if value is not key:
            self._check_input("value", value)
        if key.shape[0] != query.shape[0]:
            raise ValueError(f"query and key must have the same batch size; got query {tuple(query.shape)}, "
                             f"key {tuple(key.shape)}")
        if tuple(value.shape[:2]) != tuple(key.shape[:2]):
            raise ValueError(f"key and value must have the same (batch, length); got key {tuple(key.shape)}, "
                             f"value {tuple(value.shape)}")
        # the projections would differ: never a silent cast (under autocast they all take its dtype)
        if not query.dtype == key.dtype == value.dtype and _arrays.autocast_dtype(query) is None:
            raise TypeError(f"query, key and value must share one dtype; got query {query.dtype}, key {key.dtype}, "
                            f"value {value.dtype}")
        self._check_cache(query, cache)
        return query, key, value

    def _check_cache(self, query, cache):
        if cache is None:
            return
        cache_kind = _arrays.kind_of(cache.keys)
        if cache_kind != self._kind:
            raise TypeError(f"the cache holds {_KIND_NAMES[cache_kind]}s but this module computes on "
                            f"{_KIND_NAMES[self._kind]}s; make the cache with this module's init_cache(batch_size, max_len)")
        if query.shape[0] != cache.batch_size:
            raise ValueError(f"query has batch size {query.shape[0]} but the cache was made for "
                             f"batch_size={cache.batch_size}")
        # An uncached call promotes (a float64 query through float32 weights gives float64), but
        # the cache was allocated up front and cannot widen: refuse rather than round the new keys
        # and values down to the cache's dtype.
        if cache.keys.dtype != self.W_k.dtype:  # the module was converted after init_cache
            raise TypeError(f"the cache holds {cache.keys.dtype} but the module's parameters are {self.W_k.dtype}; "
                            f"make a new cache with init_cache(batch_size, max_len) after converting the module")
        if _projected_dtype(query, self.W_k) != cache.keys.dtype and _arrays.autocast_dtype(query) is None:
            raise TypeError(f"query has dtype {query.dtype} but the cache holds {cache.keys.dtype} (init_cache "
                            f"makes it in the module's dtype); convert the query to {cache.keys.dtype}, or "
                            f"build the module and its cache in {query.dtype}")

    def _check_input(self, name, x):
        kind = _arrays.kind_of(x)
        if kind is None:
            raise TypeError(f"{name} must be a {_KIND_NAMES[self._kind]}, got {type(x).__name__}")
        if kind != self._kind:
            other = "qkv.torch.MultiHeadAttention" if kind == "torch" else "qkv.MultiHeadAttention"
            raise TypeError(f"{name} must be a {_KIND_NAMES[self._kind]}, got a {_KIND_NAMES[kind]}; "
                            f"for {kind} inputs use {other}")
        inputs.check_strided(name, x)  # NumPy subclasses and byte orders too
        if x.ndim != 3 or x.shape[-1] != self.d_model:
            raise ValueError(f"{name} must have shape (batch, length, d_model={self.d_model}), "
                             f"got {tuple(x.shape)}")
        self._check_dtype(name, x)

    def _check_dtype(self, name, x):
        if x.dtype.name not in inputs.FLOAT_DTYPES:  # NumPy has no bfloat16: float64, float32 or float16
            raise TypeError(f"{name} must have dtype float64, float32 or float16, got {x.dtype}")

    def _state_items(self):
        """(name, array) for every parameter, in state_dict order."""
        return [(name, getattr(self, name)) for name in self._shapes()]

    def _config_repr(self) -> str:
        kv = f", num_kv_heads={self.num_kv_heads}" if self.num_kv_heads != self.num_heads else ""
        return f"d_model={self.d_model}, num_heads={self.num_heads}{kv}, bias={self.bias}"


_KIND_NAMES = {"numpy": "numpy.ndarray", "torch": "torch.Tensor"}


def _check_heads_input(method, x, ndim, last, shape_text):
    if _arrays.kind_of(x) is None:
        raise TypeError(f"{method} expects x as a numpy.ndarray or torch.Tensor, got {type(x).__name__}")
    if x.ndim != ndim or x.shape[-1] != last:
        raise ValueError(f"{method} expects x of shape {shape_text}; got {tuple(x.shape)}")


def _projected_dtype(x, weight):
    """The dtype of x @ weight: NumPy promotes; the torch module has required x.dtype == weight.dtype
    (outside autocast, where alone _check_cache asks)."""
    return np.result_type(x.dtype, weight.dtype) if isinstance(x, np.ndarray) else x.dtype


def _check_batch_size(batch_size, actual):
    if batch_size is not None and batch_size != actual:
        raise ValueError(f"batch_size ({batch_size}) does not match the batch dim of x ({actual})")


def _widened_bias(mask, q):
    """A float NumPy mask (bias) widened to the heads' dtype, as NumPy's promotion widened the
    projections (float32 inputs to a float64 module): lossless, where narrowing would not be."""
    if (isinstance(mask, np.ndarray) and isinstance(q, np.ndarray) and mask.dtype.kind == "f"
            and mask.dtype != q.dtype and np.can_cast(mask.dtype, q.dtype, "safe")):
        return mask.astype(q.dtype)
    return mask


def _check_mask_array(mask):
    """A 3-D mask array (n, Lq, Lk) with n > 1 would broadcast as per head: refused, as its
    author may have meant batch rows (seed function) or batch x heads (torch.nn.MultiheadAttention)."""
    if _arrays.kind_of(mask) is not None and mask.ndim == 3 and mask.shape[0] > 1:
        raise ValueError(f"a 3-D mask {tuple(mask.shape)} is ambiguous: give it 4-D, (B, 1, Lq, Lk) for batch "
                         f"rows (mask[:, None]) or (1, num_heads, Lq, Lk) for heads (mask[None]); "
                         f"torch.nn.MultiheadAttention's (B * num_heads, Lq, Lk) goes through from_torch_masks")


def _with_causal(mask, score_mod, q, cached: int):
    """The user's mask (any of the mask language) and the bottom-right causal mask, for a call
    after `cached` positions. Masks and score rules describe the whole sequence: the call's
    query i is position cached + i (Mask.from_query); mask arrays hold the call's own rows.

    Returns (mask, score_mod): a float mask is an additive bias, so it travels as a score modifier,
    ahead of the user's own ones (the order qkv.attention applies them in for an uncached call).
    """
    mods = [m.from_query(cached) for m in inputs.as_score_mods(score_mod)]
    if mask is None:  # every decoding step without a mask of its own
        return _CAUSAL, mods or None
    mask_obj, biases = inputs.as_mask(mask, _arrays.kind_of(q), inputs.dtype_name(q))
    combined = _CAUSAL if mask_obj is None else _CAUSAL & mask_obj.from_query(cached)
    return combined, (list(biases) + mods or None)


_CAUSAL = causal()  # masks are immutable: one serves every call

#: The dtypes the NumPy module can hold: those of qkv.attention that NumPy has (it has no bfloat16).
_NUMPY_DTYPES = ("float64", "float32", "float16")


def _numpy_dtype(dtype) -> np.dtype:
    """`dtype` as a np.dtype, or TypeError unless it is one of _NUMPY_DTYPES."""
    try:
        resolved = np.dtype(dtype)
    except TypeError:  # not a NumPy dtype at all (a torch dtype, a typo...)
        raise TypeError(f"dtype must be one of {', '.join(_NUMPY_DTYPES)}, got {dtype!r}") from None
    if resolved.name not in _NUMPY_DTYPES:
        raise TypeError(f"dtype must be one of {', '.join(_NUMPY_DTYPES)}, got {resolved}")
    return resolved


class MultiHeadAttention(AttentionCore):
    """Multi-head attention on NumPy arrays (the seed class, grown up).

    Args:
        d_model: model width; must be divisible by num_heads.
        num_heads: query heads; depth = d_model // num_heads.
        num_kv_heads: key/value heads (grouped-query attention); num_heads must be a
            multiple of it. None (default) means num_heads (plain multi-head attention).
        bias: add biases b_q, b_k, b_v, b_o (zeros at start).
        dtype: the parameters' dtype: float64 (as in the seed), float32 or float16.
        rng: None draws with ``np.random.randn`` (the global generator, as the seed did);
            an int or ``np.random.Generator`` draws from ``np.random.default_rng(rng)``.

    Weights are drawn as ``randn * sqrt(2 / d_model)`` in the order W_q, W_k, W_v, W_o.

    >>> mha = qkv.MultiHeadAttention(d_model=512, num_heads=8)
    >>> out, w = mha.call([Q, K, V])            # (2, 10, 512), (2, 8, 10, 10)
    >>> out, _ = mha(x, mask=qkv.causal())      # self-attention, (B, L, 512)
    """

    _kind = "numpy"

    def __init__(self, d_model, num_heads, num_kv_heads=None, bias=False, *, dtype=np.float64, rng=None):
        self._configure(d_model, num_heads, num_kv_heads, bias)
        self.dtype = _numpy_dtype(dtype)
        self.reset_parameters(rng)

    def reset_parameters(self, rng=None):
        """Draw the weights again (``randn * sqrt(2 / d_model)``); biases become zeros."""
        if rng is None:
            draw = lambda shape: np.random.randn(*shape)  # noqa: E731 - the seed's global generator
        else:
            draw = np.random.default_rng(rng).standard_normal
        for name, shape in self._shapes().items():
            value = np.zeros(shape) if name.startswith("b_") else draw(shape) * init_std(self.d_model)
            setattr(self, name, value.astype(self.dtype))

    def __call__(self, query, key=None, value=None, mask=None, need_weights=False, cache=None, *, score_mod=None):
        return self.forward(query, key, value, mask, need_weights, cache, score_mod=score_mod)

    def forward(self, query, key=None, value=None, mask=None, need_weights=False, cache=None, *, score_mod=None):
        """Attention of query over key/value; returns (output, weights or None).

        Args:
            query: (B, Lq, d_model). key, value: (B, Lk, d_model); key=None means query
                (self-attention), value=None means key.
            mask: any mask of the mask language (``qkv.causal()``, ``qkv.padding(lengths)``,
                ...), a boolean array broadcastable to (B, num_heads, Lq, Lk) (True = attend),
                or a float array added to the scores. A 3-D array (n > 1, Lq, Lk) is refused
                as ambiguous (batch rows or heads?): give it 4-D.
            need_weights: also return the attention weights (B, num_heads, Lq, Lk).
            cache: a KVCache from ``init_cache``: self-attention over the cached tokens and
                these ones, with the bottom-right causal mask (combined with ``mask``).
                ``mask`` objects and ``score_fn`` rules read query i as position
                ``cache.length + i`` of the sequence (``Mask.from_query``); mask arrays hold
                this call's rows.
                The cache holds the module's dtype. Without a cache NumPy promotes (a float64
                query through float32 weights gives float64); a cache cannot widen, so a query
                that would promote past it is refused (TypeError) rather than rounded down:
                pass ``query.astype(module.dtype)``.
            score_mod: a score modifier (``qkv.alibi(slopes)``, ``qkv.softcap(cap)``,
                ``qkv.score_fn(fn)``) or a list of them, applied to the scaled scores after a
                float ``mask``, as in ``qkv.attention``.

        Returns:
            output (B, Lq, d_model) and weights (B, num_heads, Lq, Lk) or None.
        """
        return self._attend(query, key, value, mask, need_weights, cache, 0.0, score_mod)

    def state_dict(self) -> dict:
        """{name: copy of the parameter}; keys as in ``parameter_shapes`` (the torch module's too)."""
        return {name: value.copy() for name, value in self._state_items()}

    def load_state_dict(self, state) -> None:
        """Load parameters from NumPy arrays or torch tensors (e.g. a torch module's state_dict),
        cast to this module's dtype. The keys and shapes must match exactly."""
        check_state_dict(state, self._shapes())
        for name in self._shapes():
            setattr(self, name, _arrays.to_numpy(state[name]).astype(self.dtype))

    def __repr__(self):
        return f"MultiHeadAttention({self._config_repr()}, dtype={self.dtype})"
