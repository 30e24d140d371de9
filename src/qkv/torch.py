"""qkv for PyTorch users: ``qkv.torch.MultiHeadAttention`` and ``qkv.torch.from_torch_masks``.

Needs PyTorch (``pip install qkv[torch]``). Inside this package ``import torch`` is absolute,
so it always means PyTorch itself.
"""
try:
    import torch as _torch  # noqa: F401
except ImportError as error:  # pragma: no cover - torch is installed for the tests
    raise ImportError("qkv.torch needs PyTorch: pip install qkv[torch]") from error

from .kv_cache import KVCache
from .torch_nn import MultiHeadAttention, from_torch_masks

__all__ = ["MultiHeadAttention", "from_torch_masks", "KVCache"]
