"""`qkv demo` prints the seed example, the PyTorch shapes, a drawn mask, a decoding loop
and a long-sequence memory comparison; without torch it still runs."""
import io
import re
import sys

import pytest

from qkv import demo


def run_demo(**kwargs) -> str:
    out = io.StringIO()
    demo.run(out, **kwargs)
    return out.getvalue()


def test_demo_prints_every_part():
    pytest.importorskip("torch")
    text = run_demo()
    assert "Input Q:" in text and "Output:" in text
    assert "Q, K, V (2, 10, 512) -> output (2, 10, 512), attention weights (2, 8, 10, 10)" in text
    assert "query, key, value (2, 10, 64) -> output (2, 10, 64), attention weights (2, 10, 10)" in text
    assert "qkv.torch.MultiHeadAttention(" in text
    assert "█" in text and "·" in text  # the mask drawn by to_string()
    err = float(re.search(r"one full causal pass over 8 tokens\| = (\S+)", text).group(1))
    assert err < 1e-12
    used, formula = (float(x) for x in re.search(
        r"output included\): ([\d.]+) MiB\n.*score matrix: ([\d.]+) MiB", text).groups())
    assert formula == 256.0 and used < formula / 10  # O(N) memory, not the 8192 x 8192 matrix


def test_demo_runs_without_torch(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` now raises ImportError
    text = run_demo(long_len=1024)
    assert "PyTorch is not installed: skipped" in text
    assert "(2, 8, 10, 10)" in text and "cache length 8" in text and "1024 x 1024" in text
