"""``qkv demo``: a short tour, printed.

1. the seed: ``qkv.MultiHeadAttention(512, 8).call([Q, K, V])``, printing Q and the output;
2. PyTorch: ``qkv.scaled_dot_product_attention`` and ``qkv.torch.MultiHeadAttention`` shapes;
3. a mask, drawn with ``to_string()``, and the weights it leaves;
4. decoding with a KV cache, checked against one full causal pass;
5. a long sequence: the memory attention used against what the plain formula would hold.

Printing is this module's job (library code never prints).
"""
from __future__ import annotations

import sys
import time

import numpy as np

import qkv
from qkv._memory import peak_growth

from .nn import MultiHeadAttention


def run(out=sys.stdout, *, long_len: int = 8192) -> None:
    """Print the demo to ``out``. ``long_len`` is the sequence length of part 5."""
    say = lambda *parts: print(*parts, file=out)  # noqa: E731
    for part in (_seed, _pytorch, _masked, _decoding):
        part(say)
        say()
    _long_sequence(say, long_len)


def _title(say, text):
    say(f"== {text}")


def _shape(x) -> str:
    return str(tuple(x.shape))


def _seed(say):
    _title(say, "1. The seed: MultiHeadAttention(d_model=512, num_heads=8).call([Q, K, V])")
    np.random.seed(0)
    d_model, num_heads, batch_size, seq_len = 512, 8, 2, 10
    mha = MultiHeadAttention(d_model, num_heads)
    Q, K, V = (np.random.randn(batch_size, seq_len, d_model) for _ in range(3))
    output, attention_weights = mha.call([Q, K, V])
    with np.printoptions(precision=4, threshold=20, edgeitems=2, suppress=True):
        say("Input Q:")
        say(Q)
        say("Output:")
        say(output)
    say(f"Q, K, V {_shape(Q)} -> output {_shape(output)}, attention weights {_shape(attention_weights)}")


def _pytorch(say):
    _title(say, "2. PyTorch: scaled_dot_product_attention and qkv.torch.MultiHeadAttention")
    try:
        import torch

        from . import torch as qkv_torch
    except ImportError:
        say("PyTorch is not installed: skipped (pip install qkv[torch])")
        return
    torch.manual_seed(0)
    query = key = value = torch.randn(2, 10, 64)
    output, weights = qkv.scaled_dot_product_attention(query, key, value)
    say(f"scaled_dot_product_attention: query, key, value {_shape(query)} -> "
        f"output {_shape(output)}, attention weights {_shape(weights)}")
    mha = qkv_torch.MultiHeadAttention(64, num_heads=8, num_kv_heads=2)
    output, weights = mha(query, mask=qkv.causal(), need_weights=True)
    say(f"qkv.torch.{mha}: x {_shape(query)} -> output {_shape(output)}, weights {_shape(weights)}")


def _masked(say):
    _title(say, "3. A mask: causal, a sliding window of 3 keys, padding (6 real tokens of 8)")
    mask = qkv.causal() & qkv.window(left=2) & qkv.padding([6], q_lengths=[6])
    say(mask.to_string(8, 8))
    rng = np.random.default_rng(0)
    q, k = rng.standard_normal((1, 2, 8, 16)), rng.standard_normal((1, 2, 8, 16))  # (B, H, L, D)
    weights = qkv.attention_weights(q, k, mask)  # (B, H, L, L)
    with np.printoptions(precision=2, suppress=True):
        say(f"weights of query 5 (head 0): {weights[0, 0, 5]}")
        say(f"weights of query 7 (head 0), a padding token: {weights[0, 0, 7]}")


def _decoding(say):
    _title(say, "4. Decoding with a KV cache (MultiHeadAttention(64, 8, num_kv_heads=2))")
    mha = MultiHeadAttention(64, num_heads=8, num_kv_heads=2, rng=0)
    prompt = np.random.default_rng(1).standard_normal((1, 4, 64))  # (B, L, d_model)
    cache = mha.init_cache(batch_size=1, max_len=8)
    output, _ = mha(prompt, cache=cache)
    say(f"prompt {_shape(prompt)} -> {cache}")
    inputs, outputs = [prompt], [output]
    for step in range(1, 5):
        token = outputs[-1][:, -1:]  # feed the last output back in, (1, 1, 64)
        output, weights = mha(token, cache=cache, need_weights=True)
        inputs.append(token)
        outputs.append(output)
        say(f"step {step}: 1 new token attends over {weights.shape[-1]} keys -> cache length {cache.length}")
    full, _ = mha(np.concatenate(inputs, axis=1), mask=qkv.causal())
    err = np.abs(np.concatenate(outputs, axis=1) - full).max()
    say(f"max |decoded - one full causal pass over {full.shape[1]} tokens| = {err:.1e}")


def _long_sequence(say, L):
    D = 64
    _title(say, f"5. A long sequence: qkv.attention, 1 head, L={L}, D={D}, float32, causal")
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, L, D), dtype=np.float32) for _ in range(3))  # (H, L, D)
    mask = qkv.causal()
    backend = qkv.explain(q[:, :8], k[:, :8], v[:, :8], mask).backend  # also warms up dispatch
    qkv.attention(q[:, :8], k[:, :8], v[:, :8], mask)
    start = time.perf_counter()
    _, peak, how = peak_growth(lambda: qkv.attention(q, k, v, mask))
    seconds = time.perf_counter() - start
    formula = 1 * L * L * 4  # the (H, L, L) float32 score matrix
    say(f"backend {backend}: {seconds:.1f} s; memory the call added ({how}, output included): {_mib(peak)}")
    say(f"the plain formula would hold the {L} x {L} score matrix: {_mib(formula)} "
        f"({formula / max(peak, 1):.0f}x more)")


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"
