"""The qkv command."""
import os
import subprocess
import sys

import pytest

from helpers import native_here, needs_native
from qkv import bench, cli, dispatch
from qkv.backends import triton as triton_backend


def test_info_lists_every_backend_and_why(capsys):
    assert cli.main(["info"]) == 0
    text = capsys.readouterr().out
    for name in dispatch.REGISTRY:
        assert name in text
    assert "never automatic" in text and "numpy" in text
    assert "head dims up to 256, score modifiers alibi, bias, softcap (each once, softcap last)" in text  # native


@needs_native
def test_a_backends_declared_score_modifiers_are_what_it_refuses_by():
    """The native kernel declares the modifiers it applies inline; explain refuses it the others by name."""
    import numpy as np

    import qkv

    q = np.zeros((1, 2, 8, 16), np.float32)
    report = qkv.explain(q, q, q, score_mod=qkv.score_fn(lambda s, b, h, i, j: s))
    assert "the native kernel applies alibi, bias, softcap inline, not score_fn" in report.refused["native"]
    twice = qkv.explain(q, q, q, score_mod=[qkv.softcap(5.0), qkv.alibi([1.0, 2.0])])
    once = "the native kernel applies each of alibi, bias, softcap at most once, softcap last"
    assert once in twice.refused["native"]


def test_check_passes(capsys):
    assert cli.main(["check"]) == 0
    out = capsys.readouterr().out
    assert "FAILED" not in out and "numpy      float32" in out
    assert ("native     bfloat16" in out) == native_here()
    assert "torch      float16" in out and "numpy      float16" in out  # every dtype a backend has


def test_check_without_torch_skips_bfloat16_with_a_hint():
    """A core install (NumPy only): NumPy has no bfloat16, so that dtype is skipped, not failed."""
    code = "import sys; sys.modules['torch'] = None; from qkv import cli; sys.exit(cli.main(['check']))"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "FAILED" not in run.stdout and "numpy      float32" in run.stdout
    if dispatch.REGISTRY["native"].missing() is None:
        assert "native     bfloat16  skipped: bfloat16 arrays are torch tensors (pip install 'qkv[torch]')" \
            in run.stdout


def test_distributed_benchmark_without_torch_says_what_to_install(monkeypatch, capsys):
    from qkv import bench_distributed

    real_find_spec = bench_distributed.importlib.util.find_spec
    monkeypatch.setattr(bench_distributed.importlib.util, "find_spec",
                        lambda name, *a: None if name == "torch" else real_find_spec(name, *a))
    monkeypatch.setattr(bench_distributed, "_launch", lambda *a: pytest.fail("started processes"))
    assert bench_distributed.main(["--world", "2", "--lengths", "256"]) == 1
    assert "the distributed benchmark needs torch: pip install 'qkv[torch]'" in capsys.readouterr().err


def _numpy_backend_off(monkeypatch, change):
    """The numpy backend's forward, its (out, lse) passed through change."""
    numpy_backend = dispatch.REGISTRY["numpy"]
    forward = numpy_backend.forward
    monkeypatch.setattr(numpy_backend, "forward", lambda inp: change(*forward(inp)))


@pytest.mark.parametrize("change,failing", [
    # past the rule in float32 (2 * 5e-7 + 2e-6), under the old 1e-5, and within float16's
    (lambda out, lse: (out * (1 + 4e-6), lse), ["float64", "float32"]),
    (lambda out, lse: (out, lse + 1e-5), ["float64", "float32"]),  # the output right, the lse wrong
    (lambda out, lse: (out.__setitem__((0, 0, 5), 0.0) or out, lse), ["float64", "float32", "float16"]),  # a row zeroed
])
def test_check_fails_a_backend_the_rule_fails(monkeypatch, capsys, change, failing):
    _numpy_backend_off(monkeypatch, change)
    assert cli.main(["check"]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[:2] for line in lines if "FAILED" in line] == [["numpy", dtype] for dtype in failing]


def test_check_reports_a_backend_that_raises_and_goes_on(monkeypatch, capsys):
    def broken(out, lse):
        raise RuntimeError("broken kernel")
    _numpy_backend_off(monkeypatch, broken)
    assert cli.main(["check"]) == 1
    out = capsys.readouterr().out
    assert "numpy      float64   causal GQA: RuntimeError: broken kernel  FAILED" in out
    assert "torch      float32" in out and ("native     float32" in out) == native_here()  # the others ran


def test_unknown_command_is_an_error(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["nonsense"])
    assert exc.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


def test_info_with_triton_but_without_torch_says_why(monkeypatch, capsys):
    monkeypatch.setattr(triton_backend, "_triton_installed", lambda: True)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch fails
    assert cli.main(["info"]) == 0
    assert "triton     unavailable: PyTorch is not installed" in capsys.readouterr().out


def test_info_counts_one_thread_in_the_singular():
    env = dict(os.environ, QKV_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-m", "qkv.cli", "info"], env=env, capture_output=True, text=True)
    assert done.returncode == 0 and "1 threads" not in done.stdout
    if dispatch.REGISTRY["native"].missing() is None:
        assert "instructions, 1 thread (" in done.stdout


def test_a_bad_thread_count_in_the_environment_warns_and_info_still_runs():
    env = dict(os.environ, QKV_NUM_THREADS="abc")
    done = subprocess.run([sys.executable, "-m", "qkv.cli", "info"], env=env, capture_output=True, text=True)
    assert done.returncode == 0 and "native" in done.stdout
    assert "QKV_NUM_THREADS='abc' is not an integer" in done.stderr


@pytest.mark.parametrize("module", ["torch", "rich"])
def test_bench_without_its_dependencies_gives_the_install_hint(monkeypatch, capsys, module):
    monkeypatch.setitem(sys.modules, module, None)  # import fails as if not installed
    assert cli.main(["bench", "--shape", "1,1,16,8", "--repeats", "1", "--no-peers"]) == 1
    err = capsys.readouterr().err
    assert "qkv bench needs torch and rich: pip install 'qkv[bench]'" in err and f"missing: {module}" in err


def test_the_ring_benchmark_runs_without_rich(monkeypatch):
    from qkv import bench_distributed

    monkeypatch.setitem(sys.modules, "rich", None)
    asked = []
    monkeypatch.setattr(bench_distributed, "main", lambda argv: asked.append(argv) or 0)
    assert cli.main(["bench", "--distributed", "2"]) == 0 and asked == [["--world", "2"]]


@pytest.mark.parametrize("argv, message", [
    (["--repeats", "0"], "argument --repeats: must be a positive integer, got '0'"),
    (["--shape", "1,x,64,8"], "argument --shape: takes B,H,L,D or B,Hq,Hkv,Lq,Lk,D in positive integers; got "),
    (["--shape", "1,2,64"], "argument --shape: takes B,H,L,D"),
    (["--distributed", "0"], "argument --distributed: must be a positive integer, got '0'"),
    (["--distributed", "-1"], "argument --distributed: must be a positive integer, got '-1'"),
    (["--distributed", "3"], "argument --distributed: each length = 2048 must be divisible"),
    (["--distributed", "2", "--json", "x.json", "--shape", "1,1,64,8"],
     "--distributed takes no other option (got --shape, --json)"),
    (["--plot", "p.png"], "--plot needs --sweep (it plots the sequence-length sweep)"),
    (["--dtype", "bfloat16"], "--dtype set the --shape workloads; give --shape too"),
    (["--causal", "--backward"], "--causal, --backward set the --shape workloads; give --shape too"),
    (["--json", "missing/x.json"], "argument --json: cannot write 'missing/x.json': no folder"),
    (["--sweep", "--plot", "."], "argument --plot: needs a file name ending in .png, got '.'"),
    (["--sweep", "--plot", ""], "argument --plot: needs a file name, got an empty one"),
    (["--json", "."], "argument --json: cannot write '.': it is a folder"),
    (["--shape", "1,3,2,16,16,8"], "argument --shape: the query heads (3) must be a multiple of the key/value heads (2)"),
    pytest.param(["--json", "/proc/x.json"], "argument --json: cannot write '/proc/x.json': ",
                 marks=pytest.mark.skipif(not os.path.isdir("/proc"), reason="needs /proc")),
])
def test_bench_argument_errors_are_one_line_before_anything_runs(monkeypatch, tmp_path, capsys, argv, message):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(bench, "run", lambda args: pytest.fail("the benchmark ran"))
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", *argv])
    assert exc.value.code == 2
    assert f"qkv bench: error: {message}" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_bench_fails_when_nothing_ran_for_a_workload(monkeypatch, capsys):
    def broken_setup():
        raise RuntimeError("cannot run here")
    monkeypatch.setattr(bench, "implementations", lambda w, peers=True: {"broken": broken_setup})
    assert cli.main(["bench", "--shape", "1,1,8,8", "--repeats", "1", "--no-peers"]) == 1
    out = capsys.readouterr().out
    assert "did not run (RuntimeError: cannot run here)" in out and "nothing ran for fwd float32 B=1 H=1 L=8 D=8" in out


def test_python_dash_m_qkv_is_the_qkv_command():
    done = subprocess.run([sys.executable, "-m", "qkv", "info"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("qkv ") and "native" in done.stdout


def test_a_reader_that_leaves_early_gets_no_traceback(monkeypatch):
    """`qkv info | head -1`: when the reader has closed the pipe, the command stops quietly."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader has left
    with open(write_end, "w", buffering=1) as closed_pipe:  # line-buffered: the first line fails
        monkeypatch.setattr(sys, "stdout", closed_pipe)
        assert cli.main(["info"]) == 141


@pytest.mark.parametrize("encoding", ["ascii", "cp1252"])
def test_pictures_come_out_as_ascii_shades_where_the_output_cannot_encode_blocks(encoding):
    """A pipe in a legacy code page, or PYTHONIOENCODING=ascii: the same picture, drawn in ASCII."""
    env = dict(os.environ, PYTHONIOENCODING=encoding)
    done = subprocess.run([sys.executable, "-m", "qkv", "viz", "--random"], env=env, capture_output=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr.decode(encoding, "replace")
    text = done.stdout.decode(encoding)
    utf8 = subprocess.run([sys.executable, "-m", "qkv", "viz", "--random"], capture_output=True, timeout=120,
                          env=dict(os.environ, PYTHONIOENCODING="utf-8")).stdout.decode("utf-8")
    assert any(block in utf8 for block in "░▒▓█")  # the check below compares drawn pictures
    assert text == utf8.translate(str.maketrans({"█": "#", "▓": "%", "▒": "+", "░": ".", "│": "|"}))
