"""The PyTorch multi-head attention module (``qkv.torch.MultiHeadAttention``), batch first.

Shape legend:
    B        batch rows
    L, S     query and key/value sequence lengths
    E        d_model (embed_dim in torch.nn.MultiheadAttention)
    H        num_heads;  Hkv = num_kv_heads

It computes exactly what the NumPy ``qkv.MultiHeadAttention`` computes (the shared
``AttentionCore``), with torch parameters of the same names and shapes, plus dropout on
the attention weights while training. ``from_torch`` takes over the weights of a
``torch.nn.MultiheadAttention``; ``from_torch_masks`` converts that module's masks
(True = ignore) to qkv's (True = attend).
"""
from __future__ import annotations

import math

import torch
from torch import nn

from . import _arrays, inputs
from .nn import AttentionCore, check_state_dict, init_std


class MultiHeadAttention(AttentionCore, nn.Module):
    """Multi-head attention as a ``torch.nn.Module`` (batch first), with GQA, masks and a KV cache.

    Args:
        d_model: model width; must be divisible by num_heads.
        num_heads: query heads; depth = d_model // num_heads.
        num_kv_heads: key/value heads (grouped-query attention); None means num_heads.
        bias: add biases b_q, b_k, b_v, b_o (zeros at start).
        dropout: probability of dropping an attention weight while training, from 0 to
            1 - 2**-13 (checked again whenever ``module.dropout`` is set).
        device, dtype: of the parameters.

    Parameters W_q (E, H*depth), W_k and W_v (E, Hkv*depth), W_o (H*depth, E) are applied
    as ``x @ W`` and drawn as ``randn * sqrt(2 / d_model)``; the state_dict keys are those
    of the NumPy ``qkv.MultiHeadAttention``, so weights move between the two.

    >>> mha = qkv.torch.MultiHeadAttention(512, 8, num_kv_heads=2)
    >>> out, _ = mha(x, mask=qkv.causal())                 # (B, L, 512)
    >>> out, w = mha(x, k, v, need_weights=True)           # w (B, 8, L, S)
    """

    _kind = "torch"

    def __init__(self, d_model, num_heads, num_kv_heads=None, bias=False, dropout=0.0, *, device=None, dtype=None):
        nn.Module.__init__(self)
        self._configure(d_model, num_heads, num_kv_heads, bias)
        self.dropout = dropout
        if dtype is not None and dtype not in (torch.float64, torch.float32, torch.bfloat16, torch.float16):
            raise TypeError(f"dtype must be a floating torch dtype (float64, float32, bfloat16, float16), "
                            f"got {dtype!r}")
        for name, shape in self._shapes().items():
            self.register_parameter(name, nn.Parameter(torch.empty(shape, device=device, dtype=dtype)))
        self.reset_parameters()

    def reset_parameters(self):
        """Draw the weights again (``randn * sqrt(2 / d_model)``); biases become zeros."""
        with torch.no_grad():
            for name, param in self.named_parameters(recurse=False):
                if name.startswith("b_"):
                    param.zero_()
                else:
                    param.normal_(0.0, init_std(self.d_model))

    @property
    def dropout(self) -> float:
        return self._dropout

    @dropout.setter
    def dropout(self, dropout):
        self._dropout = inputs.check_dropout_p(dropout, "dropout")

    def forward(self, query, key=None, value=None, mask=None, need_weights=False, cache=None, *, score_mod=None):
        """Attention of query over key/value; returns (output, weights or None).

        Args:
            query: (B, L, E). key, value: (B, S, E); key=None means query (self-attention),
                value=None means key.
            mask: any mask of the mask language (``qkv.causal()``, ``qkv.padding(lengths)``,
                ...), a boolean tensor broadcastable to (B, H, L, S) (True = attend), or a
                float tensor added to the scores (while gradients are recorded, not one that
                requires grad: qkv gives it no gradient). Masks of torch.nn.MultiheadAttention
                (True = ignore) convert with ``from_torch_masks``. A 3-D tensor (n > 1, L, S)
                is refused as ambiguous (batch rows or heads?): give it 4-D.
            need_weights: also return the attention weights (B, H, L, S), before dropout.
            cache: a KVCache from ``init_cache``: self-attention over the cached tokens and
                these ones, with the bottom-right causal mask (combined with ``mask``).
                ``mask`` objects and ``score_fn`` rules read query i as position
                ``cache.length + i`` of the sequence (``Mask.from_query``); mask arrays hold
                this call's rows.
                Decode under ``torch.no_grad()``: the cache is written in place (while
                autograd records, each call copies it, so gradients reach every step, and so
                does the first call after). The cache holds the module's dtype (query must
                have it too, or under autocast autocast's, which the heads are then cast from).
            score_mod: a score modifier (``qkv.alibi(slopes)``, ``qkv.softcap(cap)``,
                ``qkv.score_fn(fn)``) or a list of them, applied to the scaled scores after a
                float ``mask``, as in ``qkv.attention``.

        Returns:
            output (B, L, E) and weights (B, H, L, S) or None.
        """
        dropout_p = self.dropout if self.training else 0.0
        return self._attend(query, key, value, mask, need_weights, cache, dropout_p, score_mod)

    def _check_dtype(self, name, x):
        # under autocast, also what autocast makes of earlier layers, as torch's own module takes
        # (not for float64 parameters, which autocast leaves alone)
        autocast = _arrays.autocast_dtype(x) if self.W_q.dtype != torch.float64 else None
        if x.dtype != self.W_q.dtype and x.dtype != autocast:
            raise TypeError(f"{name} has dtype {x.dtype} but the module's parameters are {self.W_q.dtype}; "
                            f"convert one of them (module.to(dtype) or {name}.to(dtype))")

    def load_state_dict(self, state_dict, strict=True, assign=False):
        """Load parameters from torch tensors or NumPy arrays (e.g. the NumPy module's
        state_dict), cast to this module's dtype and device. Keys and shapes must match.

        With ``assign=True`` the cast tensors become the parameters (no copy where a tensor
        already has the module's dtype and device); a module on the meta device takes the
        tensors' device, as torch's ``assign=True`` is meant for.
        """
        if strict:
            check_state_dict(state_dict, self._shapes())
        params = dict(self.named_parameters(recurse=False))
        tensors = {name: _cast_like(value, params[name]) if name in params else value
                   for name, value in state_dict.items()}
        return super().load_state_dict(tensors, strict=strict, assign=assign)

    def numpy_state_dict(self) -> dict:
        """The state_dict as NumPy arrays (for ``qkv.MultiHeadAttention.load_state_dict``)."""
        return {name: _arrays.to_numpy(value).copy() for name, value in self.state_dict().items()}

    @classmethod
    def from_torch(cls, module: nn.MultiheadAttention) -> "MultiHeadAttention":
        """A qkv module with the weights, dropout and train/eval mode of a torch.nn.MultiheadAttention.

        torch stores ``in_proj_weight`` (3E, E) and applies ``x @ Wᵀ + b``; here
        W_q, W_k, W_v are its three (E, E) blocks transposed, W_o is ``out_proj.weight``
        transposed. The result takes batch-first inputs whatever ``module.batch_first`` is.
        Its masks convert with ``from_torch_masks(attn_mask, key_padding_mask, num_heads=H)``;
        rows where torch gives NaN (every key masked) give 0 here.
        """
        _check_convertible(module)
        E, H = module.embed_dim, module.num_heads
        bias = module.in_proj_bias is not None
        weight = module.in_proj_weight.detach()  # (3E, E): rows of W_q, W_k, W_v, y = x @ Wᵀ
        new = cls(E, H, bias=bias, dropout=module.dropout, device=weight.device, dtype=weight.dtype)
        w_q, w_k, w_v = weight.chunk(3)  # (E, E) each
        state = {"W_q": w_q.T, "W_k": w_k.T, "W_v": w_v.T, "W_o": module.out_proj.weight.detach().T}
        if bias:
            b_q, b_k, b_v = module.in_proj_bias.detach().chunk(3)
            state.update(b_q=b_q, b_k=b_k, b_v=b_v, b_o=module.out_proj.bias.detach())
        new.load_state_dict(state)
        return new.train(module.training)

    def extra_repr(self) -> str:
        return f"{self._config_repr()}, dropout={self.dropout}"


def _cast_like(value, param):
    """`value` (tensor or NumPy array) in param's dtype and, unless param is on meta, its device."""
    device = None if param.is_meta else param.device
    return torch.as_tensor(value).to(dtype=param.dtype, device=device)


def _check_convertible(module):
    if not isinstance(module, nn.MultiheadAttention):
        raise TypeError(f"from_torch expects a torch.nn.MultiheadAttention, got {type(module).__name__}")
    if not module._qkv_same_embed_dim:
        raise ValueError(f"from_torch needs kdim == vdim == embed_dim ({module.embed_dim}); "
                         f"got kdim={module.kdim}, vdim={module.vdim}")
    if module.bias_k is not None or module.add_zero_attn:
        raise ValueError("from_torch does not support add_bias_kv=True or add_zero_attn=True")


def from_torch_masks(attn_mask=None, key_padding_mask=None, *, num_heads=None):
    """Convert torch.nn.MultiheadAttention's masks to one qkv mask (True = attend, or a float bias).

    Args:
        attn_mask: (L, S), or (B*num_heads, L, S) (needs num_heads); boolean True = NOT
            allowed, or float, added to the scores.
        key_padding_mask: (B, S); boolean True = ignore this key (padding), or float, added.
        num_heads: needed to unfold a 3-D attn_mask into (B, num_heads, L, S).

    Returns:
        None, a boolean tensor (True = attend) when every given mask is boolean, or else a
        float tensor (the masks added, boolean ones as 0 / -inf), broadcastable to
        (B, num_heads, L, S): ready for ``mask=`` of the qkv modules and ``qkv.attention``.
    """
    parts = []
    if attn_mask is not None:
        parts.append(_attn_mask_4d(attn_mask, num_heads))  # (L, S) or (B, H, L, S)
    if key_padding_mask is not None:
        _check_torch_mask("key_padding_mask", key_padding_mask, (2,), "(B, S)")
        parts.append(key_padding_mask[:, None, None, :])  # (B, 1, 1, S)
    if not parts:
        return None
    if len(parts) == 2:
        _check_masks_agree(parts[0], key_padding_mask)
    if all(p.dtype == torch.bool for p in parts):
        combined = ~parts[0]
        for p in parts[1:]:
            combined = combined & ~p
        return combined  # True = attend
    float_dtype = next(p.dtype for p in parts if p.dtype != torch.bool)
    total = 0
    for p in parts:
        total = total + (_bool_to_bias(p, float_dtype) if p.dtype == torch.bool else p.to(float_dtype))
    return total


def _attn_mask_4d(attn_mask, num_heads):
    _check_torch_mask("attn_mask", attn_mask, (2, 3), "(L, S) or (B*num_heads, L, S)")
    if attn_mask.ndim == 2:
        return attn_mask  # (L, S)
    if num_heads is None:
        raise ValueError("a 3-D attn_mask (B*num_heads, L, S) needs num_heads= to unfold it")
    num_heads = inputs.check_positive_int("num_heads", num_heads)
    if attn_mask.shape[0] % num_heads:
        raise ValueError(f"attn_mask's first dim ({attn_mask.shape[0]}) must be B*num_heads "
                         f"(a multiple of num_heads={num_heads})")
    return attn_mask.reshape(-1, num_heads, *attn_mask.shape[1:])  # (B, H, L, S)


def _check_masks_agree(attn_mask, key_padding_mask):
    """attn_mask ((L, S) or (B, H, L, S)) and key_padding_mask (B, S) must agree on S and B."""
    S, B = key_padding_mask.shape[1], key_padding_mask.shape[0]
    if attn_mask.shape[-1] != S:
        raise ValueError(f"attn_mask and key_padding_mask must have the same number of keys S: attn_mask has "
                         f"{attn_mask.shape[-1]}, key_padding_mask {S}")
    if attn_mask.ndim == 4 and attn_mask.shape[0] != B:
        rows = f"{attn_mask.shape[0]} batch row{'s' * (attn_mask.shape[0] != 1)}"
        raise ValueError(f"a 3-D attn_mask unfolds to {rows} (B*num_heads / num_heads), "
                         f"but key_padding_mask has {B}")


def _check_torch_mask(name, mask, ndims, shape_text):
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(mask).__name__}")
    if mask.dtype != torch.bool and not mask.is_floating_point():
        raise TypeError(f"{name} must be boolean (True = ignore) or float (added), got dtype {mask.dtype}")
    if mask.ndim not in ndims:
        raise ValueError(f"{name} must have shape {shape_text}, got {tuple(mask.shape)}")


def _bool_to_bias(ignore, dtype):
    """True = ignore -> -inf, False -> 0."""
    return torch.zeros(ignore.shape, dtype=dtype, device=ignore.device).masked_fill(ignore, -math.inf)
