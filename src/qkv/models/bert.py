"""A BERT encoder built on qkv's attention module, loading the weights of a BERT checkpoint.

Shape legend:
    B   sentences in a batch          L   tokens (the longest sentence; shorter ones padded)
    E   hidden size (384 for MiniLM)   F   feed-forward size (4E)
    H   attention heads                N   layers

One layer (post-norm, as in BERT)::

    a = LayerNorm(x + MultiHeadAttention(x, mask=padding(lengths)))   # (B, L, E)
    y = LayerNorm(a + gelu(a @ W1 + b1) @ W2 + b2)                      # (B, L, E)

The padding mask hides the padded keys from every query (padded query rows still
attend, as in BERT; their outputs are never used). Inference only: no dropout.
"""
from __future__ import annotations

import json
from dataclasses import MISSING, dataclass, fields
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ..masks import padding
from ..torch_nn import MultiHeadAttention


@dataclass(frozen=True)
class BertConfig:
    """The sizes of a BERT encoder (the keys of a checkpoint's config.json)."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    max_position_embeddings: int
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    hidden_act: str = "gelu"

    @classmethod
    def from_file(cls, path) -> "BertConfig":
        """Read config.json; only BERT with absolute positions and exact GELU is supported."""
        data = json.loads(Path(path).read_text())
        if data.get("model_type", "bert") != "bert":
            raise ValueError(f"{path}: expected a BERT config (model_type 'bert'), got {data.get('model_type')!r}")
        if data.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError(f"{path}: only absolute position embeddings are supported, "
                             f"got {data['position_embedding_type']!r}")
        if data.get("hidden_act", "gelu") != "gelu":
            raise ValueError(f"{path}: only hidden_act 'gelu' is supported, got {data['hidden_act']!r}")
        required = [f.name for f in fields(cls) if f.default is MISSING]
        missing = [name for name in required if name not in data]
        if missing:
            raise ValueError(f"{path}: the config lacks {', '.join(missing)}")
        return cls(**{name: data[name] for name in cls.__dataclass_fields__ if name in data})


class Embeddings(nn.Module):
    """Token + position + segment embeddings, then LayerNorm: ids (B, L) -> (B, L, E)."""

    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.word = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.position = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.token_type = nn.Embedding(cfg.type_vocab_size, cfg.hidden_size)
        self.norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, ids, token_types=None):
        if ids.shape[1] > self.position.num_embeddings:
            raise ValueError(f"ids has {ids.shape[1]} tokens a row; the model has positions for "
                             f"{self.position.num_embeddings} (max_position_embeddings)")
        positions = torch.arange(ids.shape[1], device=ids.device)  # (L,)
        token_types = torch.zeros_like(ids) if token_types is None else token_types
        return self.norm(self.word(ids) + self.position(positions) + self.token_type(token_types))  # (B, L, E)


class Layer(nn.Module):
    """One encoder layer: attention and feed-forward, each with a residual and LayerNorm."""

    def __init__(self, cfg: BertConfig):
        super().__init__()
        E = cfg.hidden_size
        self.attention = MultiHeadAttention(E, cfg.num_attention_heads, bias=True)
        self.attention_norm = nn.LayerNorm(E, eps=cfg.layer_norm_eps)
        self.up = nn.Linear(E, cfg.intermediate_size)
        self.down = nn.Linear(cfg.intermediate_size, E)
        self.output_norm = nn.LayerNorm(E, eps=cfg.layer_norm_eps)

    def forward(self, x, mask, need_weights=False):
        """x (B, L, E) -> (y (B, L, E), weights (B, H, L, L) or None)."""
        attended, weights = self.attention(x, mask=mask, need_weights=need_weights)  # (B, L, E)
        a = self.attention_norm(x + attended)
        y = self.output_norm(a + self.down(nn.functional.gelu(self.up(a))))  # (B, L, E)
        return y, weights


class BertEncoder(nn.Module):
    """Embeddings and N layers: token ids (B, L) and lengths (B,) -> hidden states (B, L, E)."""

    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.config = cfg
        self.embeddings = Embeddings(cfg)
        self.layers = nn.ModuleList(Layer(cfg) for _ in range(cfg.num_hidden_layers))

    def forward(self, ids, lengths=None, need_weights=False):
        """Returns (hidden (B, L, E), weights: a list of N (B, H, L, L) or None).

        lengths: the real tokens of each row (the rest is padding); None = no padding.
        """
        mask = None if lengths is None else padding(np.asarray(lengths))
        x = self.embeddings(ids)  # (B, L, E)
        all_weights = []
        for layer in self.layers:
            x, weights = layer(x, mask, need_weights)
            all_weights.append(weights)
        return x, (all_weights if need_weights else None)

    def load_checkpoint(self, state: dict) -> None:
        """Load a BERT checkpoint's tensors (names as in BertModel's state_dict; extra ones are ignored).

        Values are torch tensors of any float dtype (bfloat16 included) or NumPy arrays, cast to
        the encoder's dtype. A checkpoint that lacks a tensor the encoder needs is a ValueError
        naming it.
        """
        self.load_state_dict(_rename(state, len(self.layers)), strict=True)


def _rename(state: dict, n_layers: int) -> dict:
    """BertModel names -> this module's names. Linear weights (out, in) become x @ W matrices (in, out)."""
    names = _name_map(n_layers)
    missing = [theirs for _, theirs, _ in names if theirs not in state]
    if missing:
        raise ValueError(f"the checkpoint lacks {len(missing)} BERT tensors, e.g. {missing[:3]}")
    out = {}
    for ours, theirs, transpose in names:
        tensor = _as_tensor(theirs, state[theirs])
        out[ours] = tensor.T.contiguous() if transpose else tensor  # (E, E) for x @ W when transposed
    return out


def _name_map(n_layers: int) -> list:
    """(our name, the checkpoint's name, transpose?) for every tensor the encoder loads: the one list
    both the loading and the check for missing tensors read."""
    names = [("embeddings.word.weight", "embeddings.word_embeddings.weight", False),
             ("embeddings.position.weight", "embeddings.position_embeddings.weight", False),
             ("embeddings.token_type.weight", "embeddings.token_type_embeddings.weight", False),
             ("embeddings.norm.weight", "embeddings.LayerNorm.weight", False),
             ("embeddings.norm.bias", "embeddings.LayerNorm.bias", False)]
    for i in range(n_layers):
        src, dst = f"encoder.layer.{i}.", f"layers.{i}."
        for ours, theirs in (("q", "attention.self.query"), ("k", "attention.self.key"),
                             ("v", "attention.self.value"), ("o", "attention.output.dense")):
            names += [(f"{dst}attention.W_{ours}", f"{src}{theirs}.weight", True),
                      (f"{dst}attention.b_{ours}", f"{src}{theirs}.bias", False)]
        for ours, theirs in (("attention_norm", "attention.output.LayerNorm"), ("up", "intermediate.dense"),
                             ("down", "output.dense"), ("output_norm", "output.LayerNorm")):
            names += [(f"{dst}{ours}.{part}", f"{src}{theirs}.{part}", False) for part in ("weight", "bias")]
    return names


def _as_tensor(name: str, value):
    """A checkpoint entry as a torch tensor: tensors as they are (bfloat16 included, which NumPy
    cannot hold), NumPy arrays converted; the copy into the parameters casts them."""
    if isinstance(value, (torch.Tensor, np.ndarray)):
        return torch.as_tensor(value)
    raise TypeError(f"checkpoint[{name!r}] must be a torch.Tensor or numpy.ndarray, got {type(value).__name__}")
