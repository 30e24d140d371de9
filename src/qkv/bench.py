"""`qkv bench`: qkv's backends against their peers, measured side by side in one run.

Each workload runs every implementation on the same inputs, interleaved (round-robin, so
drifting clocks and background load hit all of them alike), and reports the median time
as GFLOP/s (4·B·H·Lq·Lk·D for the forward; when causal, top-left aligned in every
implementation, the share of pairs it allows, half for Lq = Lk; 2.5x for the backward)
or, for decoding, as GB/s of K/V read, beside a plain read of as many bytes (torch's sum)
timed in the same rounds, so the share of the memory's bandwidth compares like with like
(and the other workloads beside as many FLOPs of the native kernel's independent
multiply-adds, the arithmetic's own rate); the ratio to torch's own
`scaled_dot_product_attention`; and the peak memory a call added
(resident set, Linux). Each implementation's first output is checked against float64 on
sampled query rows (the output, or dq with the backward) under the tolerance rule, and a row
that breaks it is marked: a fast wrong answer is not a result (and a qkv one makes the
command exit with status 1).
"""
from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field

import numpy as np

from . import attention, causal, dispatch, inputs
from .backends.base import ATOL, max_error
from ._memory import peak_growth
from ._paths import output_file
from ._threads import available_cpus, cpu_name


@dataclass
class Workload:
    name: str
    B: int
    Hq: int
    Hkv: int
    Lq: int
    Lk: int
    D: int
    dtype: str = "float32"
    causal: bool = False
    backward: bool = False
    device: str = "cpu"

    @property
    def decoding(self) -> bool:
        return self.Lq <= 16 and self.Lk >= 1024 and not self.backward

    def flops(self) -> float:
        f = 4.0 * self.B * self.Hq * self.Lq * self.Lk * self.D
        f = f * self.causal_share() if self.causal else f
        return f * 3.5 if self.backward else f  # forward + backward (2.5x)

    def causal_share(self) -> float:
        """The share of (query, key) pairs a top-left causal mask allows, query i seeing keys
        j <= i: one half for square problems, as FlashAttention counts; exact otherwise."""
        if self.Lq == self.Lk:
            return 0.5
        n = min(self.Lq, self.Lk)
        pairs = n * (n + 1) / 2 + max(self.Lq - self.Lk, 0) * self.Lk
        return pairs / (self.Lq * self.Lk)

    def bytes_read(self) -> float:
        element = 2 if self.dtype in ("bfloat16", "float16") else 4
        return 2.0 * self.B * self.Hkv * self.Lk * self.D * element  # K and V


@dataclass
class Result:
    workload: str
    impl: str
    seconds: float | None
    rate: float | None  # GFLOP/s, or GB/s for decoding
    unit: str
    ratio_to_torch: float | None = None
    share_of_read: float | None = None  # decoding: rate / the plain read's rate in the same rounds
    share_of_peak: float | None = None  # the others: rate / the arithmetic peak's rate in the same rounds
    peak_mib: float | None = None
    error: str | None = None
    check: str | None = None  # "ok", or how far the first output was from float64 and the bound
    times: list[float] = field(default_factory=list)  # every timed round, seconds

    @property
    def wrong(self) -> bool:
        return self.check is not None and self.check != "ok"


def default_suite() -> list[Workload]:
    return [
        Workload("fwd fp32", 1, 8, 8, 4096, 4096, 64),
        Workload("fwd bf16", 1, 8, 8, 4096, 4096, 64, dtype="bfloat16"),
        Workload("fwd causal fp32", 1, 8, 8, 4096, 4096, 64, causal=True),
        Workload("fwd+bwd fp32", 1, 8, 8, 4096, 4096, 64, backward=True),
        Workload("fwd+bwd bf16", 1, 8, 8, 4096, 4096, 64, dtype="bfloat16", backward=True),
        Workload("decode GQA 32/8 fp32", 1, 32, 8, 1, 32768, 128),
        Workload("decode GQA 32/8 bf16", 1, 32, 8, 1, 32768, 128, dtype="bfloat16"),
    ]


def gpu_suite(lengths=(512, 1024, 2048, 4096, 8192, 16384), head_dims=(64, 128)) -> list[Workload]:
    """bfloat16 at 16k tokens per batch and 2048 channels (B = 16384 / L, H = 2048 / D), every
    length, head dim, causal or not, forward and forward + backward."""
    return [Workload(f"{'fwd+bwd' if bwd else 'fwd'}{' causal' if causal else ''} D={d} L={n}",
                     16384 // n, 2048 // d, 2048 // d, n, n, d, "bfloat16", causal, bwd, "cuda")
            for bwd in (False, True) for d in head_dims for causal in (False, True) for n in lengths]


def sweep_suite(lengths=(512, 1024, 2048, 4096, 8192)) -> list[Workload]:
    return [Workload(f"fwd fp32 L={n}", 1, 8, 8, n, n, 64) for n in lengths]


# ---- implementations ------------------------------------------------------------------------
def implementations(w: Workload, peers: bool = True) -> dict:
    """name -> (setup() -> call) for everything that can run this workload here."""
    impls = {}
    if w.device != "cpu":  # on a GPU: qkv's own kernel against torch's fused kernels
        impls["qkv triton"] = _qkv_impl(w, "triton")
        impls["torch sdpa (flash)"] = _torch_sdpa_impl(w, "FLASH_ATTENTION")
        impls["torch sdpa (cudnn)"] = _torch_sdpa_impl(w, "CUDNN_ATTENTION")
        if peers:
            impls["torch flex (compiled)"] = _flex_impl(w)
        return impls
    for name in _cpu_backends():
        if w.dtype in dispatch.REGISTRY[name].caps.dtypes and not (name == "numpy" and _numpy_left_out(w)):
            impls[f"qkv {name}"] = _qkv_impl(w, name)
    impls["torch sdpa"] = _torch_sdpa_impl(w)
    if w.decoding:
        impls[MEMORY_READ] = _memory_read_impl(w)
    elif peak_dtype := _peak_dtype(w):
        impls[ARITHMETIC_PEAK] = _arithmetic_peak_impl(w, peak_dtype)
    if peers and not w.decoding and importlib.util.find_spec("torch.nn.attention.flex_attention"):
        impls["torch flex (compiled)"] = _flex_impl(w)
    return impls


def _cpu_backends() -> list[str]:
    """qkv's backends that run here on the CPU and may be chosen automatically."""
    return [name for name, backend in dispatch.REGISTRY.items()
            if backend.ever_automatic and backend.runs_on_cpu and backend.missing() is None]


def _numpy_left_out(w: Workload) -> str | None:
    """Why the NumPy backend sits out a workload: it has no autograd, its float16 is a float32
    computation, and its giant runs would take minutes."""
    if w.backward:
        return "no backward"
    if w.dtype != "float32":
        return "timed in float32 only"
    return "too slow at this size" if w.flops() > 2e11 else None


def _left_out(w: Workload) -> list[str]:
    """qkv's CPU backends left out of a workload, each with why."""
    if w.device != "cpu":
        return []
    reasons = {name: f"no {w.dtype}" if w.dtype not in dispatch.REGISTRY[name].caps.dtypes
               else _numpy_left_out(w) if name == "numpy" else None for name in _cpu_backends()}
    return [f"qkv {name} ({reason})" for name, reason in reasons.items() if reason]


def _inputs(w: Workload, kind: str, requires_grad: bool = False):
    import torch

    g = torch.Generator().manual_seed(0)
    dt = getattr(torch, w.dtype)
    q = torch.randn(w.B, w.Hq, w.Lq, w.D, generator=g).to(dt)
    k = torch.randn(w.B, w.Hkv, w.Lk, w.D, generator=g).to(dt)
    v = torch.randn(w.B, w.Hkv, w.Lk, w.D, generator=g).to(dt)
    if kind == "numpy":
        return tuple(x.numpy() for x in (q, k, v))
    return tuple(x.to(w.device).requires_grad_(requires_grad) for x in (q, k, v))


def _with_backward(run, tensors):
    """A call that runs forward and backward (gradient of out.sum()) and returns the gradients,
    leaving none behind on the inputs."""
    def call():
        run().sum().backward()
        grads = tuple(t.grad for t in tensors)
        for t in tensors:
            t.grad = None
        return grads
    return call


def _qkv_impl(w, backend):
    def setup():
        kind = "numpy" if "torch" not in dispatch.REGISTRY[backend].caps.kinds else "torch"
        q, k, v = _inputs(w, kind, w.backward)
        mask = causal(align="top_left") if w.causal else None  # what torch's is_causal and the flex peer mean
        run = lambda: attention(q, k, v, mask, backend=backend)  # noqa: E731
        return _with_backward(run, (q, k, v)) if w.backward else run
    return setup


def _torch_sdpa_impl(w, kernel: str | None = None):
    """torch's SDPA, left to choose its kernel or pinned to one (an SDPBackend name)."""
    def setup():
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel

        q, k, v = _inputs(w, "torch", w.backward)
        gqa = {"enable_gqa": True} if w.Hq != w.Hkv else {}  # only where needed: torch 2.4 has no such argument

        def run():
            # torch's is_causal is top-left aligned, as qkv's peers are given (see _qkv_impl)
            return F.scaled_dot_product_attention(q, k, v, is_causal=w.causal, **gqa)

        def run_pinned():
            with sdpa_kernel(getattr(SDPBackend, kernel)):
                return run()
        call = run_pinned if kernel else run
        return _with_backward(call, (q, k, v)) if w.backward else call
    return setup


#: The decoding workloads' yardstick: a read of as many bytes as K and V hold.
MEMORY_READ = "memory read (torch sum)"


def _memory_read_impl(w):
    """torch's sum over a float32 tensor of K and V's size (threaded on a CPU): what the memory
    gives a plain read, timed in the same rounds as the kernels so that drifting bandwidth and
    the idle time before each call hit it alike."""
    def setup():
        import torch

        x = torch.ones(int(w.bytes_read()) // 4, device=w.device)
        return lambda: x.sum()
    return setup


#: The compute workloads' yardstick: as many FLOPs of independent multiply-adds on the native
#: kernel's threads, in the arithmetic its products use.
ARITHMETIC_PEAK = "arithmetic peak (native loop)"

#: Rows that are yardsticks, not attention: no output to check, no ratio to torch.
YARDSTICKS = (MEMORY_READ, ARITHMETIC_PEAK)


def _peak_dtype(w: Workload) -> str | None:
    """The arithmetic of the native kernel's products in a compute workload: 'float32' for FMAs
    (float32 inputs, bfloat16 ones widened where the CPU has no bfloat16 dot products, and the
    backward on AMX machines, which multiplies in float32), 'bfloat16' for bfloat16 forwards and
    backwards on VDPBF16PS pairs; None where the kernel does not run the workload here, or
    multiplies on AMX tiles, which this loop does not measure."""
    from .backends import native

    backend = dispatch.REGISTRY["native"]
    if w.device != "cpu" or w.decoding or backend.missing() or w.dtype not in backend.caps.dtypes:
        return None
    isa = native._native.isa()
    if w.dtype == "bfloat16" and isa == "avx512bf16":
        return "bfloat16"
    if w.dtype == "bfloat16" and not w.backward and isa == "amx":
        return None
    return None if isa == "amx" and backend.float32_on_amx else "float32"


def _arithmetic_peak_impl(w, dtype: str):
    def setup():
        from .backends import native

        threads, flops = dispatch.REGISTRY["native"].call_threads(), int(w.flops())
        return lambda: native._native.peak_loop(flops, threads, dtype)
    return setup


def _flex_impl(w):
    def setup():
        import torch
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        q, k, v = _inputs(w, "torch", w.backward)
        compiled = torch.compile(flex_attention, dynamic=False)
        block_mask = None
        if w.causal:
            block_mask = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, w.Lq, w.Lk, device=w.device)
        run = lambda: compiled(q, k, v, block_mask=block_mask, enable_gqa=w.Hq != w.Hkv)  # noqa: E731
        return _with_backward(run, (q, k, v)) if w.backward else run
    return setup


# ---- checking ---------------------------------------------------------------------------------
#: Query rows per batch and head whose results are checked (every row of a shorter problem).
CHECKED_ROWS = 32


def checked_rows(Lq: int) -> np.ndarray:
    """Query rows spread evenly over the sequence, the first and the last among them."""
    return np.unique(np.linspace(0, Lq - 1, min(Lq, CHECKED_ROWS)).round().astype(np.int64))


def _reference_result(w: Workload, q, k, v, rows: np.ndarray, dtype: str) -> np.ndarray:
    """The output on the given query rows, or their dq with the backward, as the tolerance
    rule's yardsticks take them: qkv's reference backend in `dtype` (lower precisions
    accumulating in float32), and for dq its own backward, in float64 or in float32 rounded to
    `dtype`; q (those rows only), k and v: the workload's inputs as CPU tensors; top-left
    causal where asked. A row's output and dq depend on its own query row alone, so a few rows
    cost little."""
    import torch

    allowed = np.arange(w.Lk) <= rows[:, None] if w.causal else None  # (R, Lk): key j <= query i
    if not w.backward:
        t = getattr(torch, dtype)
        mask = None if allowed is None else torch.from_numpy(allowed)
        return attention(q.to(t), k.to(t), v.to(t), mask, backend="reference").double().numpy()
    computed = "float64" if dtype == "float64" else "float32"
    arrays = [x.double().numpy().astype(computed) for x in (q, k, v)]
    dout = np.ones(q.shape[:-1] + (w.D,), dtype=computed)  # the gradient of out.sum()
    dq = dispatch.REGISTRY["reference"].backward(inputs.prepare(*arrays, allowed), dout)[0]
    return torch.from_numpy(dq).to(getattr(torch, dtype)).double().numpy()


class OutputCheck:
    """Checks an implementation's first result (its output, or its gradients with the backward)
    against float64 on the checked rows, under the tolerance rule: off by at most twice what the
    reference loses in the workload's dtype plus ATOL (times max(1, max|dq|) for dq, as the
    gradient tests scale it)."""

    def __init__(self, w: Workload):
        import torch

        self.rows = checked_rows(w.Lq)
        q, k, v = (x.detach().cpu() for x in _inputs(w, "torch"))
        q = q[:, :, torch.from_numpy(self.rows)]  # (B, Hq, R, D)
        self.want = _reference_result(w, q, k, v, self.rows, "float64")
        reference_err = max_error(_reference_result(w, q, k, v, self.rows, w.dtype), self.want)
        magnitude = max(1.0, float(np.abs(self.want).max(initial=0.0))) if w.backward else 1.0
        self.bound = 2 * reference_err + ATOL[w.dtype] * magnitude

    def __call__(self, result) -> str:
        got = result[0] if isinstance(result, tuple) else result  # dq, with the backward
        if hasattr(got, "detach"):  # a tensor, perhaps on a GPU: its checked rows only cross to the host
            import torch

            got = got.detach()[:, :, torch.from_numpy(self.rows)].cpu().double().numpy()
        else:
            got = np.asarray(got, dtype=np.float64)[:, :, self.rows]
        err = max_error(got, self.want)
        return "ok" if err <= self.bound else f"off by {err:.1e} from float64 (the rule allows {self.bound:.1e})"


# ---- measuring --------------------------------------------------------------------------------
def _peak_mib(call, device: str) -> float | None:
    """Peak memory one call adds, in MiB (resident set on CPU, allocator peak on a GPU); None
    where the resident set cannot be read (tracemalloc would miss torch's and native memory)."""
    if device == "cpu":
        _, grown, how = peak_growth(call)
        return grown / 2**20 if how == "peak resident set" else None
    import torch

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    call()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2**20


#: Timed rounds per workload where --repeats does not say. On a shared 2-CPU machine single
#: calls of one implementation spread by ±10% and more (torch's float32 SDPA forward at
#: 4096 tokens: 140-166 GFLOP/s over 30 rounds of one run), and a median of 5 left ratios
#: 0.1 apart from run to run; 15 rounds cost the default suite about a minute more.
DEFAULT_REPEATS = 15

#: Idle time before each timed call. OpenMP pools (torch's, BLAS's) keep spinning for a few
#: milliseconds after a call; on a machine with few cores that steals a core from whichever
#: implementation runs next, so each one starts on an idle machine instead.
SETTLE_SECONDS = 0.05


def _synchronizer(device: str):
    """A function that waits for queued device work (nothing to wait for on CPU)."""
    if device == "cpu":
        return lambda: None
    import torch

    return torch.cuda.synchronize


def baseline(device: str) -> str:
    """The row every ratio is taken against: torch's SDPA (its flash kernel on a GPU)."""
    return "torch sdpa" if device == "cpu" else "torch sdpa (flash)"


def measure_workload(w: Workload, repeats: int, peers: bool, progress=None) -> list[Result]:
    calls, results, checks = {}, {}, {}
    sync = _synchronizer(w.device)
    check = OutputCheck(w)
    for name, setup in implementations(w, peers).items():
        try:
            call = setup()
            first = call()  # warm-up (compiles what compiles), and the result checked
            sync()
            calls[name] = call
            results[name] = []
        except Exception as error:  # a peer that does not run here is reported, not fatal
            results[name] = error
        else:
            checks[name] = None if name in YARDSTICKS else check(first)
            del first
        if progress:
            progress()
    for _ in range(repeats):  # interleaved: every implementation once per round
        for name, call in calls.items():
            if w.device == "cpu":
                time.sleep(SETTLE_SECONDS)
            start = time.perf_counter()
            call()
            sync()
            results[name].append(time.perf_counter() - start)
        if progress:
            progress()
    rows = []
    for name, times in results.items():
        if isinstance(times, Exception):
            rows.append(Result(w.name, name, None, None, "", error=f"{type(times).__name__}: {times}"[:120]))
            continue
        seconds = statistics.median(times)
        if w.decoding:
            rate, unit = w.bytes_read() / seconds / 1e9, "GB/s"
        elif w.device == "cpu":
            rate, unit = w.flops() / seconds / 1e9, "GFLOP/s"
        else:
            rate, unit = w.flops() / seconds / 1e12, "TFLOP/s"
        rows.append(Result(w.name, name, seconds, rate, unit, peak_mib=_peak_mib(calls[name], w.device),
                           check=checks[name], times=times))
    torch_time = next((r.seconds for r in rows if r.impl == baseline(w.device) and r.seconds), None)
    read_rate = next((r.rate for r in rows if r.impl == MEMORY_READ and r.rate), None)
    peak_rate = next((r.rate for r in rows if r.impl == ARITHMETIC_PEAK and r.rate), None)
    for r in rows:
        if r.seconds and torch_time and r.impl not in YARDSTICKS:
            r.ratio_to_torch = torch_time / r.seconds
        if r.rate and read_rate and r.unit == "GB/s":
            r.share_of_read = r.rate / read_rate
        if r.rate and peak_rate and r.unit == "GFLOP/s":
            r.share_of_peak = r.rate / peak_rate
    return rows


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _version_of(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def machine() -> dict:
    import torch

    from . import __version__
    from .backends import native

    return {
        "cpu": cpu_name(), "machine": platform.machine(),
        "cpus": available_cpus(),
        "native_threads": dispatch.REGISTRY["native"].call_threads() if native._native else None,
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(), "numpy": np.__version__, "torch": torch.__version__, "qkv": __version__,
        "native_isa": native._native.isa() if native._native else "unavailable",
        "native_missing": dispatch.REGISTRY["native"].missing(),
        "native_threading": native._native.threading() if native._native else None,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "cuda": torch.version.cuda,
        "triton": _version_of("triton"),
        "date": time.strftime("%Y-%m-%d"),
    }


# ---- the command ------------------------------------------------------------------------------
def parse_shape(text: str) -> Workload:
    """'B,H,L,D' or 'B,Hq,Hkv,Lq,Lk,D' -> a workload named by its sizes (run() adds the rest)."""
    parts = text.split(",")
    if len(parts) not in (4, 6) or not all(map(_is_positive_int, parts)):
        raise argparse.ArgumentTypeError(f"takes B,H,L,D or B,Hq,Hkv,Lq,Lk,D in positive integers; got {text!r}")
    if len(parts) == 4:
        B, H, L, D = map(int, parts)
        return Workload(f"B={B} H={H} L={L} D={D}", B, H, H, L, L, D)
    B, Hq, Hkv, Lq, Lk, D = map(int, parts)
    if Hq % Hkv:
        raise argparse.ArgumentTypeError(f"the query heads ({Hq}) must be a multiple of the key/value heads ({Hkv}); "
                                         f"got {text!r}")
    return Workload(f"B={B} Hq={Hq} Hkv={Hkv} Lq={Lq} Lk={Lk} D={D}", B, Hq, Hkv, Lq, Lk, D)


def positive_int(text: str) -> int:
    if not _is_positive_int(text):
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return int(text)


def _is_positive_int(text: str) -> bool:
    return text.strip().isdecimal() and int(text) > 0


def world_size(text: str) -> int:
    """--distributed: ranks that split every default length of the distributed benchmark."""
    from . import bench_distributed

    world, lengths = positive_int(text), bench_distributed.LENGTHS
    try:
        bench_distributed.check_config(world, bench_distributed.with_defaults({}, lengths))
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"{error} (it runs lengths {', '.join(map(str, lengths))})") from None
    return world


def add_arguments(parser) -> None:
    parser.add_argument("--shape", action="append", type=parse_shape, default=[],
                        help="B,H,L,D or B,Hq,Hkv,Lq,Lk,D (repeatable); replaces the default suite")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="dtype of --shape workloads")
    parser.add_argument("--device", choices=["cpu", "cuda"],
                        help="cpu (the default), or cuda: qkv's triton kernel against torch's flash and cuDNN SDPA "
                             "and flex_attention; the default suite becomes bfloat16 forward and backward at head "
                             "dims 64 and 128, L 512 to 16k")
    parser.add_argument("--causal", action="store_true",
                        help="--shape workloads are causal, top-left aligned as torch's is_causal (query i sees keys "
                             "0..i); refused for decoding shapes (forward, Lq <= 16, Lk >= 1024: rated by the K and V "
                             "they read, of which they would read Lq keys)")
    parser.add_argument("--backward", action="store_true", help="--shape workloads include the backward")
    parser.add_argument("--sweep", action="store_true", help="also sweep the sequence length (for --plot; CPU)")
    parser.add_argument("--repeats", type=positive_int,
                        help=f"timed rounds per workload, the median reported (default {DEFAULT_REPEATS})")
    parser.add_argument("--no-peers", action="store_true", help="skip torch flex_attention (slow to compile)")
    parser.add_argument("--json", metavar="PATH", type=output_file(), help="write every result and the machine as JSON")
    parser.add_argument("--plot", metavar="PNG", type=output_file((".png",)),
                        help="plot throughput against sequence length (needs --sweep)")
    parser.add_argument("--distributed", type=world_size, metavar="N",
                        help="instead: ring attention over N local processes against one process (per-rank memory, "
                             "bytes sent; takes no other option, python -m qkv.bench_distributed takes more); "
                             "see docs/distributed.md")


def check_arguments(parser, args) -> None:
    """Combinations of options that cannot run: parser.error (one line, exit status 2) before any work.
    Then the defaults of --device and --repeats (None until here, so that --distributed can tell
    them given) are filled in."""
    if args.distributed is not None:
        others = [f"--{dest.replace('_', '-')}" for dest in ("shape", "dtype", "device", "causal", "backward",
                                                            "sweep", "repeats", "no_peers", "json", "plot")
                  if getattr(args, dest) != parser.get_default(dest)]
        if others:
            parser.error(f"--distributed takes no other option (got {', '.join(others)}); "
                         "python -m qkv.bench_distributed takes the ring benchmark's options")
    args.device, args.repeats = args.device or "cpu", args.repeats or DEFAULT_REPEATS
    if args.sweep and args.device != "cpu":
        parser.error("--sweep runs on CPU (the cuda suite sweeps the sequence length already)")
    if args.plot and not args.sweep:
        parser.error("--plot needs --sweep (it plots the sequence-length sweep)")
    if args.json and args.plot and os.path.realpath(args.json) == os.path.realpath(args.plot):
        parser.error("--json and --plot name one file: the plot would overwrite the JSON")
    decoding = [w.name for w in args.shape if w.decoding]  # rated in GB/s of K and V
    if args.causal and not args.backward and decoding:
        parser.error(f"--causal is top-left aligned (as torch's is_causal): the decoding shape {decoding[0]} would "
                     "read only its first Lq keys. A decoding step attends to every cached key: leave out --causal")
    shape_only = [f"--{dest}" for dest in ("dtype", "causal", "backward") if getattr(args, dest)]
    if shape_only and not args.shape:
        parser.error(f"{', '.join(shape_only)} set the --shape workloads; give --shape too (the default suite "
                     "has its own dtypes and masks)")


def run(args) -> int:
    if args.distributed is not None:
        from . import bench_distributed

        return bench_distributed.main(["--world", str(args.distributed)]) or 0
    from rich.console import Console
    from rich.progress import Progress

    console = Console(width=None if os.isatty(1) else 130)
    if args.device == "cuda" and not _cuda_available():
        print("qkv bench --device cuda: no CUDA GPU here", file=sys.stderr)
        return 2
    workloads = args.shape or (gpu_suite() if args.device == "cuda" else default_suite())
    for w in args.shape:
        w.dtype = args.dtype or w.dtype
        w.causal, w.backward, w.device = args.causal, args.backward, args.device
        w.name = f"{'fwd+bwd' if w.backward else 'fwd'}{' causal' if w.causal else ''} {w.dtype} {w.name}"
    if args.sweep:
        workloads = workloads + sweep_suite()
    info = machine()
    if args.device == "cuda":
        console.print(f"GPU: {info['gpu']} (CUDA {info['cuda']}), triton {info['triton']}; host {info['cpu']}")
    threads = info["native_threads"]
    native_runs = f" on {threads} thread{'s' * (threads != 1)} ({info['native_threading']})" if threads else ""
    console.print(f"{info['cpu']} ({info['machine']}), {info['cpus']} CPUs, native kernel: {info['native_isa']}"
                  f"{native_runs}, torch on {info['torch_threads']} threads; "
                  f"qkv {info['qkv']}, torch {info['torch']}, numpy {info['numpy']}, python {info['python']}")
    if info["native_missing"]:
        console.print(info["native_missing"], style="dim", markup=False)
    results = []
    with Progress(console=console, transient=True) as bar:
        for w in workloads:
            steps = len(implementations(w, not args.no_peers)) + args.repeats
            task = bar.add_task(w.name, total=steps)
            results += measure_workload(w, args.repeats, not args.no_peers, lambda: bar.advance(task))
    base = baseline(args.device)
    console.print(_table(results, info["date"], base))
    notes = _notes(results, workloads)
    for note in notes:
        console.print(note, style="red" if "WRONG" in note else "dim", markup=False)
    if args.json:
        settings = {"repeats": args.repeats, "settle_seconds": SETTLE_SECONDS if args.device == "cpu" else 0.0,
                    "peers": not args.no_peers, "baseline": base, "checked_rows": CHECKED_ROWS}
        sizes = [{**asdict(w), "flops": w.flops(), "bytes_read": w.bytes_read() if w.decoding else None}
                 for w in workloads]
        with open(args.json, "w") as f:
            json.dump({"machine": info, "settings": settings, "workloads": sizes,
                       "results": [asdict(r) for r in results], "notes": notes}, f, indent=2)
    if args.plot:
        plot(results, args.plot, info)
        console.print(f"plot written to {args.plot}")
    nothing_ran = sorted({r.workload for r in results} - {r.workload for r in results if not r.error})
    if nothing_ran:
        console.print(f"nothing ran for {', '.join(nothing_ran)}")
    return 1 if nothing_ran or any(r.wrong and r.impl.startswith("qkv ") for r in results) else 0


def _table(results: list[Result], date: str, base: str):
    from rich.table import Table

    table = Table(title=f"qkv bench, {date}")
    for col in ("workload", "implementation", "time (ms)", "throughput", f"vs {base}", "peak MiB", "output"):
        table.add_column(col, justify="left" if col in ("workload", "implementation") else "right")
    for r in results:
        if r.error:
            table.add_row(r.workload, r.impl, "-", "-", "-", "-", "-", style="dim")
            continue
        share = r.share_of_read or r.share_of_peak
        share = f" ({100 * share:.0f}%)" if share and r.impl not in YARDSTICKS else ""
        table.add_row(r.workload, r.impl, f"{r.seconds * 1e3:.1f}", f"{r.rate:.1f} {r.unit}{share}",
                      f"{r.ratio_to_torch:.2f}x" if r.ratio_to_torch else "-",
                      f"{r.peak_mib:.1f}" if r.peak_mib is not None else "-",
                      "-" if r.check is None else "WRONG" if r.wrong else "ok", style="red" if r.wrong else None)
    return table


def _notes(results: list[Result], workloads: list[Workload]) -> list[str]:
    """What the table leaves out: results that failed their check, implementations that did not
    run or sat out, and how decoding's share is taken."""
    notes = [f"{r.workload} / {r.impl}: WRONG output, {r.check}" for r in results if r.wrong]
    notes += [f"{r.workload} / {r.impl}: did not run ({r.error})" for r in results if r.error]
    notes += [f"{w.name}: left out {', '.join(left_out)}" for w in workloads if (left_out := _left_out(w))]
    if any(r.impl == MEMORY_READ and r.rate for r in results):
        notes.append(f"decoding: (n%) is the share of the '{MEMORY_READ}' row's rate, a sum over as many bytes "
                     "as K and V hold, timed in the same rounds (medians of both)")
    if any(r.impl == ARITHMETIC_PEAK and r.rate for r in results):
        threads = dispatch.REGISTRY["native"].call_threads()
        notes.append(f"compute: (n%) is the share of the '{ARITHMETIC_PEAK}' row's rate, as many FLOPs of "
                     f"independent multiply-adds on the native kernel's {threads} thread{'s' * (threads != 1)} "
                     "(float32 FMAs; bfloat16 pair dot products where a bfloat16 forward's products use them), "
                     "timed in the same rounds (medians of both)")
    if any(r.check for r in results):
        notes.append(f"output: each result checked against float64 on {CHECKED_ROWS} query rows per head (the "
                     "output, or dq with the backward), under the tolerance rule")
    return notes


def plot(results: list[Result], path: str, info: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sweep = [r for r in results if r.workload.startswith("fwd fp32 L=") and r.rate]
    fig, ax = plt.subplots(figsize=(7, 4))
    for impl in sorted({r.impl for r in sweep}):
        points = sorted((int(r.workload.split("=")[1]), r.rate) for r in sweep if r.impl == impl)
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=impl)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("sequence length (B=1, H=8, D=64, float32)")
    ax.set_ylabel("GFLOP/s")
    ax.set_title(f"attention forward, {info['cpu']}, {info['cpus']} CPUs", fontsize=9)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
