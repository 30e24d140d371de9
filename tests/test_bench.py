"""`qkv bench`: it measures what it says, on tiny shapes (timings are never asserted)."""
import importlib.util
import json
import os
import statistics
import subprocess
import sys

import numpy as np
import pytest

import qkv
from helpers import native_here
from qkv import bench, bench_distributed, cli, dispatch
from qkv.backends.base import max_error, within_rule

pytest.importorskip("torch")
pytest.importorskip("rich")


def test_a_small_run_reports_every_implementation_with_ratios(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert cli.main(["bench", "--shape", "1,2,64,16", "--repeats", "2", "--no-peers", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    rows = {r["impl"]: r for r in report["results"]}
    assert ({"qkv native", "torch sdpa"} if native_here() else {"torch sdpa"}) <= set(rows)
    assert (rows.pop(bench.ARITHMETIC_PEAK, None) is not None) == native_here()  # a yardstick, tested below
    for row in rows.values():
        assert row["error"] is None and row["unit"] == "GFLOP/s"  # times are reported, never asserted
        assert row["rate"] == pytest.approx(4 * 2 * 64 * 64 * 16 / row["seconds"] / 1e9)
    assert rows["torch sdpa"]["ratio_to_torch"] == pytest.approx(1.0)
    assert all(row["check"] == "ok" for row in rows.values())  # every output checked against float64
    assert all(len(row["times"]) == 2 and statistics.median(row["times"]) == row["seconds"] for row in rows.values())
    assert report["settings"] == {"repeats": 2, "settle_seconds": bench.SETTLE_SECONDS, "peers": False,
                                  "baseline": "torch sdpa", "checked_rows": bench.CHECKED_ROWS}
    [workload] = report["workloads"]
    assert (workload["Hq"], workload["Lq"], workload["D"], workload["flops"]) == (2, 64, 16, 4 * 2 * 64 * 64 * 16)
    assert report["machine"]["torch"] and report["machine"]["qkv"]
    native = dispatch.REGISTRY["native"]
    if native.missing() is None:  # the threads the kernel ran on, not the CPUs
        assert report["machine"]["native_threads"] == native.num_threads
    printed = capsys.readouterr().out
    assert "qkv bench" in printed and f"{report['machine']['cpus']} CPUs" in printed


def test_the_header_names_the_threads_the_kernels_run_on():
    code = "from qkv import cli; cli.main(['bench', '--shape', '1,2,64,16', '--repeats', '1', '--no-peers'])"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "QKV_NUM_THREADS": "1", "COLUMNS": "200"})
    assert done.returncode == 0, done.stderr
    header = done.stdout.splitlines()[0]
    assert " CPUs, native kernel: " in header and "torch on " in header
    if dispatch.REGISTRY["native"].missing() is None:
        assert " on 1 " in header, header  # QKV_NUM_THREADS=1, whatever the CPUs


def test_decoding_is_measured_against_a_plain_read_in_the_same_rounds(tmp_path):
    out = tmp_path / "bench.json"
    assert cli.main(["bench", "--shape", "1,4,2,1,1024,16", "--repeats", "2", "--no-peers", "--json", str(out)]) == 0
    rows = {r["impl"]: r for r in json.loads(out.read_text())["results"]}
    read = rows.pop(bench.MEMORY_READ)
    kv_bytes = 2 * 2 * 1024 * 16 * 4
    assert read["unit"] == "GB/s" and read["rate"] == pytest.approx(kv_bytes / read["seconds"] / 1e9)
    assert read["ratio_to_torch"] is None and read["share_of_read"] == pytest.approx(1.0)
    assert bench.ARITHMETIC_PEAK not in rows  # decoding is measured against the read only
    assert ({"qkv native", "torch sdpa"} if native_here() else {"torch sdpa"}) <= set(rows)
    for row in rows.values():
        assert row["unit"] == "GB/s" and row["rate"] == pytest.approx(kv_bytes / row["seconds"] / 1e9)
        assert row["share_of_read"] == pytest.approx(row["rate"] / read["rate"])


@pytest.mark.skipif(not native_here(), reason="the yardstick is the native kernel's own loop")
@pytest.mark.parametrize("dtype,backward,loop", [("float32", False, "float32"), ("bfloat16", False, "bfloat16"),
                                                 ("bfloat16", True, "bfloat16")])
def test_compute_workloads_are_measured_against_the_arithmetic_peak_in_the_same_rounds(tmp_path, monkeypatch,
                                                                                        dtype, backward, loop):
    from qkv.backends import native

    calls = []
    peak_loop = native._native.peak_loop
    monkeypatch.setattr(native._native, "peak_loop", lambda *args: calls.append(args) or peak_loop(*args),
                        raising=False)
    if loop == "bfloat16" and native._native.isa() != "avx512bf16":
        # AMX tiles (the forward) are not this loop's arithmetic; there the backward, and
        # everywhere else both, multiply on FMAs
        loop = None if native._native.isa() == "amx" and not backward else "float32"
    out = tmp_path / "bench.json"
    args = ["bench", "--shape", "1,2,64,16", "--dtype", dtype, "--repeats", "2", "--no-peers", "--json", str(out)]
    assert cli.main(args + ["--backward"] * backward) == 0
    rows = {r["impl"]: r for r in json.loads(out.read_text())["results"]}
    if loop is None:
        assert bench.ARITHMETIC_PEAK not in rows
        return
    peak = rows.pop(bench.ARITHMETIC_PEAK)
    flops = 4 * 2 * 64 * 64 * 16 * (3.5 if backward else 1)
    assert peak["unit"] == "GFLOP/s" and peak["rate"] == pytest.approx(flops / peak["seconds"] / 1e9)
    assert peak["check"] is None and peak["ratio_to_torch"] is None and peak["share_of_peak"] == pytest.approx(1.0)
    threads = dispatch.REGISTRY["native"].call_threads()
    assert set(calls) == {(int(flops), threads, loop)} and len(calls) >= 1 + 2  # warm-up, rounds
    for row in rows.values():
        assert row["share_of_peak"] == pytest.approx(row["rate"] / peak["rate"]) and row["share_of_read"] is None


@pytest.mark.skipif(not native_here(), reason="the native kernel's loop")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_peak_loop_does_the_flops_it_is_asked_for_rounded_up_to_whole_passes(dtype):
    from qkv.backends import native

    per_pass = 2 * 16 * 24 if native._native.isa() in ("avx512", "avx512bf16", "amx") else None
    if dtype == "bfloat16" and native._native.isa() not in ("avx512bf16", "amx"):
        assert native._native.peak_loop(10**6, 2, dtype) == 0  # no bfloat16 pair products here
        return
    for flops in (0, 1, 10**6, 10**6 + 1):
        done = native._native.peak_loop(flops, 2, dtype)
        assert flops <= done
        if per_pass:
            step = per_pass * (2 if dtype == "bfloat16" else 1)
            assert done == -(-flops // step) * step
    with pytest.raises(ValueError, match="dtype"):
        native._native.peak_loop(10, 1, "float16")
    with pytest.raises(ValueError, match="threads >= 1"):
        native._native.peak_loop(10, 0, dtype)


def test_shape_workloads_are_named_by_what_they_run(tmp_path):
    out = tmp_path / "bench.json"
    assert cli.main(["bench", "--shape", "1,2,64,16", "--causal", "--backward", "--repeats", "1", "--no-peers",
                     "--json", str(out)]) == 0
    names = {r["workload"] for r in json.loads(out.read_text())["results"]}
    assert names == {"fwd+bwd causal float32 B=1 H=2 L=64 D=16"}


def test_sweep_writes_a_plot_of_every_implementation_against_the_length(tmp_path, monkeypatch):
    """--sweep --plot: the length sweep runs (here two short lengths) and its rates become one
    line per implementation in a PNG."""
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.image
    import matplotlib.pyplot as plt

    lengths = (64, 128)
    monkeypatch.setattr(bench, "sweep_suite", lambda: [bench.Workload(f"fwd fp32 L={n}", 1, 2, 2, n, n, 16)
                                                       for n in lengths])
    drawn = {}
    savefig = plt.Figure.savefig

    def keep_lines(fig, path, **kwargs):
        drawn.update({line.get_label(): list(line.get_xdata()) for line in fig.axes[0].get_lines()})
        return savefig(fig, path, **kwargs)

    monkeypatch.setattr(plt.Figure, "savefig", keep_lines)
    png, out = tmp_path / "sweep.png", tmp_path / "sweep.json"
    assert cli.main(["bench", "--shape", "1,2,32,16", "--sweep", "--plot", str(png), "--json", str(out),
                     "--repeats", "1", "--no-peers"]) == 0
    swept = {r["impl"] for r in json.loads(out.read_text())["results"]
             if r["workload"].startswith("fwd fp32 L=") and r["rate"]}
    assert "torch sdpa" in swept and set(drawn) == swept
    assert all(xs == list(lengths) for xs in drawn.values())
    height, width = matplotlib.image.imread(png).shape[:2]
    assert (width, height) == (840, 480)  # 7 x 4 inches at 120 dpi


def test_gpu_suite_covers_head_dims_lengths_masks_and_directions():
    suite = bench.gpu_suite()
    assert {w.D for w in suite} == {64, 128}
    assert {w.Lq for w in suite} == {512, 1024, 2048, 4096, 8192, 16384}
    assert {(w.causal, w.backward) for w in suite} == {(False, False), (True, False), (False, True), (True, True)}
    assert all(w.device == "cuda" and w.dtype == "bfloat16" and w.B * w.Lq == 16384 and w.Hq * w.D == 2048
               for w in suite)
    causal_bwd = next(w for w in suite if w.causal and w.backward)
    assert causal_bwd.flops() == 4 * causal_bwd.B * causal_bwd.Hq * causal_bwd.Lq ** 2 * causal_bwd.D / 2 * 3.5


def test_gpu_implementations_are_qkv_triton_and_torch_kernels():
    w = bench.gpu_suite()[0]
    assert set(bench.implementations(w, peers=True)) == {
        "qkv triton", "torch sdpa (flash)", "torch sdpa (cudnn)", "torch flex (compiled)"}


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the message without a GPU")
def test_cuda_bench_without_a_gpu_says_so(capsys):
    assert cli.main(["bench", "--device", "cuda"]) == 2
    captured = capsys.readouterr()
    assert "qkv bench --device cuda: no CUDA GPU here" in captured.err and captured.out == ""


@pytest.mark.parametrize("dtype,backward,expected", [
    ("float16", False, ["qkv native (no float16)", "qkv numpy (timed in float32 only)"]),
    ("float32", True, ["qkv numpy (no backward)"]),
    ("float32", False, []),
])
def test_every_cpu_backend_left_out_of_a_workload_is_named_with_why(dtype, backward, expected):
    w = bench.Workload("w", 1, 2, 2, 64, 64, 16, dtype=dtype, backward=backward)
    left_out = bench._left_out(w)
    assert left_out == [name for name in expected if native_here() or not name.startswith("qkv native")]
    ran = {name for name in bench.implementations(w, peers=False) if name.startswith("qkv ")}
    assert not ran & {name.split(" (")[0] for name in left_out}


def test_distributed_runs_the_ring_benchmark_on_that_many_ranks(monkeypatch):
    calls = []
    monkeypatch.setattr(bench_distributed, "main", calls.append)
    assert cli.main(["bench", "--distributed", "1"]) == 0
    assert calls == [["--world", "1"]]


@pytest.mark.parametrize("Lq,Lk", [(4, 4), (3, 5), (5, 3), (1, 9)])
def test_causal_work_is_the_pairs_a_top_left_mask_allows(Lq, Lk, monkeypatch):
    """qkv gets the top-left causal mask torch's is_causal means, and the flops count the pairs
    it allows (square problems count half, as FlashAttention does)."""
    allowed = np.tril(np.ones((Lq, Lk), dtype=bool))  # query i sees keys j <= i
    w = bench.Workload("w", 1, 2, 2, Lq, Lk, 8, causal=True)
    share = 0.5 if Lq == Lk else allowed.sum() / (Lq * Lk)
    assert w.flops() == pytest.approx(4 * 2 * Lq * Lk * 8 * share)
    masks = []
    monkeypatch.setattr(bench, "attention", lambda q, k, v, mask, **kw: masks.append(mask))
    bench._qkv_impl(w, "numpy")()()
    np.testing.assert_array_equal(masks[0].materialize(Lq, Lk), allowed)


def _fake_implementations(impls: dict):
    """implementations() replaced: name -> the function a timed call runs."""
    return lambda w, peers=True: {name: (lambda run=run: run) for name, run in impls.items()}


@pytest.mark.parametrize("backward", [False, True])
def test_a_wrong_result_is_marked_however_fast(backward, tmp_path, monkeypatch, capsys):
    """A fast wrong answer is not a result: each implementation's first output (dq with the
    backward) is checked against float64, and a qkv row that breaks the rule fails the command."""
    w = bench.Workload("w", 1, 4, 2, 40, 20, 16, causal=True, backward=backward)
    right = bench._qkv_impl(w, "torch")()
    off = (lambda: tuple(g * 1.001 for g in right())) if backward else (lambda: right() * 1.001)
    monkeypatch.setattr(bench, "implementations", _fake_implementations(
        {"qkv right": right, "torch sdpa": bench._torch_sdpa_impl(w)(), "qkv off": off}))
    rows = {r.impl: r for r in bench.measure_workload(w, 1, peers=False)}
    assert rows["qkv right"].check == rows["torch sdpa"].check == "ok"
    assert rows["qkv off"].wrong and "from float64 (the rule allows" in rows["qkv off"].check
    assert rows["qkv off"].ratio_to_torch  # still timed: the mark says what it is worth

    out = tmp_path / "bench.json"
    argv = ["bench", "--shape", "1,4,2,40,20,16", "--causal", "--repeats", "1", "--json", str(out)]
    assert cli.main(argv + ["--backward"] * backward) == 1
    assert "qkv off: WRONG output, off by" in capsys.readouterr().out
    assert [note.split(": ")[0] for note in json.loads(out.read_text())["notes"] if "WRONG" in note] == [
        f"{'fwd+bwd' if backward else 'fwd'} causal float32 B=1 Hq=4 Hkv=2 Lq=40 Lk=20 D=16 / qkv off"]


def test_the_check_takes_the_rules_yardstick_in_low_precision(monkeypatch):
    """The rule's yardstick is qkv's reference in the dtype, accumulating in float32: the plain
    formula on torch's float16 operations loses 7x as much, and let through an output off by
    more than the rule allows."""
    import torch

    w = bench.Workload("w", 1, 8, 2, 512, 700, 64, dtype="float16")
    q, k, v = bench._inputs(w, "torch")
    exact = qkv.attention(*(x.double() for x in (q, k, v)), backend="reference")
    off = (exact + 3e-3).to(torch.float16)
    reference_err = max_error(qkv.attention(q, k, v, backend="reference"), exact.numpy())
    assert not within_rule(max_error(off, exact.numpy()), reference_err, "float16")
    assert bench.OutputCheck(w)(off) != "ok"
    assert bench.OutputCheck(w)(qkv.attention(q, k, v, backend="torch")) == "ok"


def test_the_checked_rows_span_the_sequence():
    assert bench.checked_rows(1).tolist() == [0]
    assert bench.checked_rows(5).tolist() == [0, 1, 2, 3, 4]
    rows = bench.checked_rows(4096)
    assert len(rows) == bench.CHECKED_ROWS and rows[0] == 0 and rows[-1] == 4095


def test_gpu_ratios_are_against_the_flash_row_alone(monkeypatch):
    """Where torch's flash kernel does not run, there is no ratio: not one against cuDNN."""
    def fails():
        raise RuntimeError("No available kernel")
    timed = (lambda: (lambda: None))
    monkeypatch.setattr(bench, "OutputCheck", lambda w: lambda result: "ok")
    monkeypatch.setattr(bench, "_synchronizer", lambda device: lambda: None)
    monkeypatch.setattr(bench, "_peak_mib", lambda call, device: None)
    w = bench.Workload("w", 1, 2, 2, 64, 64, 16, device="cuda")
    for flash in (timed, fails):
        monkeypatch.setattr(bench, "implementations", lambda w, peers=True: {
            "qkv triton": timed, "torch sdpa (flash)": flash, "torch sdpa (cudnn)": timed})
        rows = {r.impl: r for r in bench.measure_workload(w, 1, peers=False)}
        assert (rows["qkv triton"].ratio_to_torch is not None) == (flash is timed)
        assert rows["torch sdpa (cudnn)"].ratio_to_torch is None or flash is timed


@pytest.mark.parametrize("argv, message", [
    (["--shape", "1,4,2,1,4096,16", "--causal"], "--causal is top-left aligned .* would read only its first Lq keys"),
    (["--distributed", "2", "--repeats", "5"], "--distributed takes no other option (got --repeats)"),
    (["--distributed", "2", "--device", "cpu"], "--distributed takes no other option (got --device)"),
    (["--device", "cuda", "--shape", "1,2,64,16", "--sweep"], "--sweep runs on CPU"),
    (["--shape", "1,2,64,16", "--sweep", "--json", "same.png", "--plot", "same.png"],
     "--json and --plot name one file: the plot would overwrite the JSON"),
])
def test_options_that_would_mislead_are_refused(argv, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", *argv])
    assert exc.value.code == 2 and message.split(" .* ")[0] in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_a_causal_decoding_shape_with_its_backward_runs_rated_in_flops(tmp_path):
    """With --backward the shape is no decoding step (flops, not bytes): --causal is fine there."""
    out = tmp_path / "bench.json"
    argv = ["bench", "--shape", "1,2,1,1,1024,16", "--causal", "--backward", "--repeats", "1", "--no-peers"]
    assert cli.main([*argv, "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["results"]
    assert rows and all(r["unit"] == "GFLOP/s" for r in rows if r["error"] is None)


def test_peak_memory_is_left_out_where_the_resident_set_cannot_be_read(monkeypatch):
    """tracemalloc, the fallback, sees no torch or native memory: no number beats a wrong one."""
    from qkv import _memory

    monkeypatch.setattr(_memory, "_reset_peak", lambda: False)
    assert bench._peak_mib(lambda: None, "cpu") is None
    monkeypatch.undo()
    if _memory._reset_peak():  # Linux: the resident set's growth, written pages counted
        assert bench._peak_mib(lambda: np.ones(16 * 2**20, np.float32), "cpu") >= 60


@pytest.mark.parametrize("Hkv, passed", [(2, {"is_causal": False}), (1, {"is_causal": False, "enable_gqa": True})])
def test_torch_sdpa_is_asked_for_gqa_only_where_heads_are_grouped(Hkv, passed, monkeypatch):
    """torch 2.4 (which the torch extra accepts) has no enable_gqa: equal heads leave it out."""
    import torch.nn.functional as F

    calls = []
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda q, k, v, **kw: calls.append(kw))
    bench._torch_sdpa_impl(bench.Workload("w", 1, 2, Hkv, 4, 4, 8))()()
    assert calls == [passed]


FLEX = "torch flex (compiled)"


@pytest.mark.parametrize("backward", [False, True], ids=["forward", "forward+backward"])
def test_the_flex_peer_runs_compiled_on_the_cpu_and_its_output_is_checked(tmp_path, backward):
    """torch.compile'd flex_attention with a causal block mask over grouped heads: the output is
    checked against float64 like every row's, or the row carries flex's own error (torch 2.13's
    flex has no CPU backward), and the other rows run on."""
    if importlib.util.find_spec("torch.nn.attention.flex_attention") is None:
        pytest.skip("this torch has no flex_attention")
    out = tmp_path / "bench.json"
    argv = ["bench", "--shape", "1,4,2,128,128,32", "--causal", "--repeats", "1", "--json", str(out)]
    assert cli.main(argv + (["--backward"] if backward else [])) == 0
    rows = {r["impl"]: r for r in json.loads(out.read_text())["results"]}
    flex = rows[FLEX]
    if flex["error"] is None:
        assert flex["check"] == "ok" and flex["rate"] > 0 and flex["ratio_to_torch"] > 0
    else:
        assert backward and "backward" in flex["error"] and flex["check"] is None, flex
    assert rows["torch sdpa"]["check"] == "ok"
