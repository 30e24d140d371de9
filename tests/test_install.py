"""qkv installs and works without its native kernel: built with QKV_NATIVE=OFF, as happens
where no C++17 compiler or no Python headers are found."""
import json
import os
import site
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from helpers import within_rule

REPO = Path(__file__).resolve().parents[1]

# Run with -S: without site's .pth files the editable install's import hook does not load,
# so `import qkv` finds the copy installed without the kernel; NumPy and torch come from here.
SCRIPT = textwrap.dedent("""
    import io, json, sys
    from contextlib import redirect_stdout
    sys.path[:0] = sys.argv[1:]
    import numpy as np
    import torch
    import qkv
    from qkv import cli
    info = io.StringIO()
    with redirect_stdout(info):
        cli.main(["info"])
    native = next(line for line in info.getvalue().splitlines() if line.split()[:1] == ["native"])
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 4, 70, 32)).astype(np.float32) for _ in range(3))
    errors = {}
    for kind, arrays in (("numpy", (q, k, v)), ("torch", [torch.from_numpy(x) for x in (q, k, v)])):
        got = np.asarray(qkv.attention(*arrays, qkv.causal()), dtype=np.float64)
        oracle = qkv.attention(*(x.astype(np.float64) for x in (q, k, v)), qkv.causal(), backend="reference")
        in_float32 = qkv.attention(q, k, v, qkv.causal(), backend="reference")
        errors[kind] = [float(np.abs(got - oracle).max()), float(np.abs(in_float32 - oracle).max()),
                        qkv.explain(*arrays, qkv.causal()).backend]
    print(json.dumps({"file": qkv.__file__, "native": native, "errors": errors}))
""")


def test_qkv_installs_and_works_without_its_native_kernel(tmp_path):
    pytest.importorskip("torch")
    target = tmp_path / "site"
    env = {**os.environ, "QKV_NATIVE": "OFF"}
    install = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check",
                              "--no-deps", "--no-build-isolation", "--target", str(target),
                              "-C", f"build-dir={tmp_path / 'build'}", str(REPO)],
                             capture_output=True, text=True, timeout=300, env=env)
    assert install.returncode == 0, install.stdout + install.stderr
    assert (target / "qkv" / "__init__.py").exists() and not list((target / "qkv").glob("_native*"))

    done = subprocess.run([sys.executable, "-S", "-c", SCRIPT, str(target), *site.getsitepackages()],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.splitlines()[-1])
    assert Path(report["file"]).is_relative_to(target)
    assert report["native"].split(None, 1)[1].startswith("unavailable: the native kernel is not built: ")
    assert "QKV_NATIVE=OFF" in report["native"]
    for kind, (error, reference_error, backend) in report["errors"].items():
        assert backend == kind and within_rule(error, reference_error, "float32"), (kind, backend, error)
