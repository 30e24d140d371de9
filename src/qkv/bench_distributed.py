"""Benchmark of ring attention: per-rank peak memory, throughput and bytes sent, against one process.

For each sequence length L it measures

- one process running ``qkv.attention`` on the whole sequence (all the machine's cores), and
- ``qkv.distributed.ring_attention`` on P processes holding L/P tokens each,

and reports time, tokens per second, the peak memory of each process (inputs, outputs
and workspace: O(L) for one process, O(L/P) per rank) and the bytes each rank sends.

On one machine the P ranks are local processes joined by gloo, each given cores/P threads::

    python -m qkv.bench_distributed --world 2 --lengths 2048 4096 8192

Under torchrun (one process per GPU, NCCL; or gloo on CPUs) it benchmarks the real
group; rank 0 also runs the single-process baseline and prints the table::

    torchrun --nproc-per-node 8 -m qkv.bench_distributed --lengths 32768 65536
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

from ._processes import run_ranks

DTYPES = ("float32", "float64", "bfloat16", "float16")
DEFAULTS = dict(heads=4, kv_heads=None, head_dim=64, batch=1, dtype="float32", mask="causal", layout="zigzag",
                repeat=3, backward=False)
LENGTHS = (2048, 4096, 8192)


# ======================================================================================
# Measuring
# ======================================================================================
class PeakMemory:
    """Peak memory of this process during a `with` block, in bytes, above what it held before.

    CUDA: the allocator's peak. CPU: the resident-set high-water mark (VmHWM), reset
    through /proc/self/clear_refs where Linux allows it (else the peak since start).
    """

    def __init__(self, device):
        self.device, self.peak = device, 0

    def __enter__(self):
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
        else:
            _tame_malloc()
            self.exact = _reset_rss_peak()
            self.base = _rss()[1]
        return self

    def __exit__(self, *exc):
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device) - self.base
        else:
            self.peak = _rss()[0] - self.base
        return False


def _tame_malloc() -> None:
    """Make freed memory go back to the system, so that the resident set measures what is held.

    glibc serves large blocks with mmap only above a threshold that grows as blocks are
    freed; fixing it at 64 KiB returns every large tensor's memory when it is freed.
    """
    try:
        import ctypes

        libc = ctypes.CDLL(None)
        libc.mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD
        libc.malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: the numbers are only less precise
        pass


def _rss() -> tuple[int, int]:
    """(peak, current) resident set size of this process in bytes (0, 0 where /proc is missing)."""
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        return 0, 0
    get = lambda key: int(re.search(rf"{key}:\s+(\d+)", status).group(1)) * 1024  # noqa: E731
    return get("VmHWM"), get("VmRSS")


def _reset_rss_peak() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _inputs(cfg: dict, length: int, device, seed: int):
    """q (B, H, length, D), k, v (B, Hkv, length, D): random, requiring grad when timing the backward."""
    import torch

    gen = torch.Generator(device="cpu").manual_seed(seed)
    dt = getattr(torch, cfg["dtype"])
    make = lambda h: torch.randn(cfg["batch"], h, length, cfg["head_dim"], generator=gen).to(device, dt)  # noqa: E731
    q, k, v = make(cfg["heads"]), make(cfg["kv_heads"]), make(cfg["kv_heads"])
    return [x.requires_grad_(cfg["backward"]) for x in (q, k, v)]


def _mask(cfg: dict):
    from . import masks

    return masks.causal() if cfg["mask"] == "causal" else None


def _timed(fn, cfg: dict, device, barrier=None) -> tuple[float, int]:
    """(best seconds per call, peak bytes) of fn() (+ its backward) after one warm-up call."""
    def once():
        out = fn()
        if cfg["backward"]:
            out.backward(out.detach())  # any upstream gradient of out's shape
        _sync(device)

    once()
    best = float("inf")
    with PeakMemory(device) as mem:
        for _ in range(cfg["repeat"]):
            if barrier is not None:
                barrier()
            start = time.perf_counter()
            once()
            best = min(best, time.perf_counter() - start)
    return best, mem.peak


def measure_single(cfg: dict, length: int, device) -> dict:
    """qkv.attention on the whole sequence in this process (inputs counted in its peak memory)."""
    from .api import attention

    def run():
        return attention(q, k, v, _mask(cfg))

    (q, k, v), held = _held_inputs(cfg, length, device, seed=0)
    seconds, peak = _timed(run, cfg, device)
    return {"L": length, "seconds": seconds, "peak_bytes": peak + held}


def _held_inputs(cfg: dict, length: int, device, seed: int):
    """(_inputs(...), the bytes they hold). A process's first random tensor also allocates
    torch's own state (1.7 MiB on a CPU), counted against whichever length ran first: a
    one-token draw comes first."""
    _inputs(cfg, 1, device, seed)
    with PeakMemory(device) as held:
        tensors = _inputs(cfg, length, device, seed)
    return tensors, held.peak


def measure_ring(cfg: dict, length: int, device, group=None) -> dict:
    """ring_attention with this rank's shard of a length-`length` sequence (call on every rank)."""
    import torch.distributed as dist

    from .distributed import RingStats, ring_attention

    world, rank = dist.get_world_size(group), dist.get_rank(group)
    (q, k, v), held = _held_inputs(cfg, length // world, device, seed=1 + rank)
    stats = RingStats()

    def run():
        return ring_attention(q, k, v, _mask(cfg), layout=cfg["layout"], group=group, stats=stats)

    seconds, peak = _timed(run, cfg, device, barrier=lambda: dist.barrier(group=group))
    calls = 1 + cfg["repeat"]
    return {"L": length, "rank": rank, "seconds": seconds, "peak_bytes": peak + held,
            "sent_bytes": stats.bytes_sent // calls, "blocks": stats.blocks_computed // calls,
            "skipped": stats.blocks_skipped // calls}


# ======================================================================================
# Running: local processes (gloo), or under torchrun
# ======================================================================================
def run_distributed_bench(world_size: int, lengths=LENGTHS, *, timeout: float = 600.0,
                          **options) -> list[dict]:
    """Benchmark ring attention on `world_size` local processes (gloo) against one process.

    Args:
        world_size: ranks P (local processes, each with cores/P threads).
        lengths: sequence lengths L; each must be divisible by P (contiguous) or 2P (zigzag).
        timeout: seconds for each launch before its processes are killed.
        options: heads, kv_heads (None: as many as heads), head_dim, batch, dtype, mask
            ("causal" or "none"), layout, repeat, backward (time forward + backward) — see DEFAULTS.

    Returns:
        One dict per length: L, world, single/ring seconds and tokens per second,
        speedup, peak MiB of the single process and of the largest rank, MiB each rank
        sends per call, and blocks computed / skipped per rank.
    """
    from . import inputs

    world_size = inputs.check_positive_int("world_size", world_size)
    unknown = set(options) - set(DEFAULTS)
    if unknown:
        raise ValueError(f"unknown options {sorted(unknown)}; expected some of {sorted(DEFAULTS)}")
    cfg = with_defaults(options, lengths)
    check_config(world_size, cfg)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    with tempfile.TemporaryDirectory(prefix="qkv-bench-") as tmp:
        single = _launch(1, dict(cfg, role="single"), Path(tmp) / "single", cores, timeout)[0]
        ring = _launch(world_size, dict(cfg, role="ring"), Path(tmp) / "ring", max(1, cores // world_size), timeout)
    return [_row(cfg, world_size, single[i], [r[i] for r in ring]) for i in range(len(cfg["lengths"]))]


def with_defaults(options: dict, lengths) -> dict:
    """The whole configuration; kv_heads None means one KV head per query head, as the modules'
    num_kv_heads=None does."""
    cfg = {**DEFAULTS, **options, "lengths": list(lengths)}
    if cfg["kv_heads"] is None:
        cfg["kv_heads"] = cfg["heads"]
    return cfg


def check_config(world: int, cfg: dict) -> None:
    """A ValueError, before any process starts, for a configuration the ranks cannot run."""
    from . import inputs
    from .distributed import _check_divisible

    for name in ("heads", "kv_heads", "head_dim", "batch", "repeat"):
        inputs.check_positive_int(name, cfg[name])
    if cfg["heads"] % cfg["kv_heads"]:
        raise ValueError(f"heads = {cfg['heads']} must be a multiple of kv_heads = {cfg['kv_heads']}")
    inputs.check_choice("mask", cfg["mask"], ("causal", "none"))
    inputs.check_choice("dtype", cfg["dtype"], DTYPES)
    for n in cfg["lengths"]:
        _check_divisible("each length", inputs.check_positive_int("lengths", n), world, cfg["layout"])


def _row(cfg: dict, world: int, single: dict, ranks: list[dict]) -> dict:
    mib = 1 / 2**20
    tokens = cfg["batch"] * single["L"]
    ring_s = max(r["seconds"] for r in ranks)  # the ring is as fast as its slowest rank
    return {"L": single["L"], "world": world, "single_s": single["seconds"], "ring_s": ring_s,
            "speedup": single["seconds"] / ring_s, "single_tok_s": tokens / single["seconds"],
            "ring_tok_s": tokens / ring_s, "single_peak_mib": single["peak_bytes"] * mib,
            "rank_peak_mib": max(r["peak_bytes"] for r in ranks) * mib,
            "sent_mib_per_rank": max(r["sent_bytes"] for r in ranks) * mib,
            "blocks_per_rank": [r["blocks"] for r in ranks], "skipped_per_rank": [r["skipped"] for r in ranks]}


def _launch(world: int, cfg: dict, folder: Path, threads: int, timeout: float) -> list[list[dict]]:
    """Run `world` worker processes; their results (per rank, per length). Kills them all on failure
    (RanksFailed)."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), QKV_NUM_THREADS=str(threads))
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    commands = [[sys.executable, "-m", "qkv.bench_distributed", "--worker", str(rank), "--world", str(world),
                 "--folder", str(folder)] for rank in range(world)]
    run_ranks(commands, folder, timeout, env)
    return [json.loads((folder / f"result{rank}.json").read_text()) for rank in range(world)]


def _worker(rank: int, world: int, folder: Path) -> None:
    """One local process: the single-process baseline (world 1) or one rank of the ring (gloo)."""
    from datetime import timedelta

    import torch

    cfg = json.loads((folder / "config.json").read_text())
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    device = torch.device("cpu")
    if cfg["role"] == "single":
        results = [measure_single(cfg, n, device) for n in cfg["lengths"]]
    else:
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"file://{folder / 'rendezvous'}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=300))
        try:
            results = [measure_ring(cfg, n, device) for n in cfg["lengths"]]
        finally:
            dist.destroy_process_group()
    (folder / f"result{rank}.json").write_text(json.dumps(results))


def _under_torchrun(cfg: dict) -> list[dict] | None:
    """Benchmark the group torchrun started; rows on rank 0, None on the others."""
    import torch
    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    world, rank = dist.get_world_size(), dist.get_rank()
    rows = []
    try:
        for n in cfg["lengths"]:
            ring = measure_ring(cfg, n, device)
            everyone = [None] * world
            dist.all_gather_object(everyone, ring)
            single = _single_or_none(cfg, n, device) if rank == 0 else None
            dist.barrier()
            if rank == 0:
                rows.append(_row(cfg, world, single, everyone) if single else _row_without_single(cfg, world, everyone))
    finally:
        dist.destroy_process_group()
    return rows if rank == 0 else None


def _single_or_none(cfg, n, device):
    """The baseline on rank 0's device, or None where the whole sequence does not fit."""
    import torch

    try:
        return measure_single(cfg, n, device)
    except torch.OutOfMemoryError:
        torch.cuda.empty_cache()
        return None


def _row_without_single(cfg, world, ranks):
    nan = float("nan")
    fake = {"L": ranks[0]["L"], "seconds": nan, "peak_bytes": nan}
    return _row(cfg, world, fake, ranks)


# ======================================================================================
# The table
# ======================================================================================
def format_table(rows: list[dict], cfg: dict) -> str:
    head = (f"ring attention, {rows[0]['world'] if rows else '?'} ranks, layout {cfg['layout']}, mask {cfg['mask']}, "
            f"{cfg['dtype']}, batch {cfg['batch']}, heads {cfg['heads']}/{cfg['kv_heads']}, D {cfg['head_dim']}, "
            f"{'forward + backward' if cfg['backward'] else 'forward'}; best of {cfg['repeat']}")
    cols = f"{'L':>7} {'1 proc ms':>10} {'ring ms':>9} {'speedup':>8} {'1 proc tok/s':>13} {'ring tok/s':>11} " \
           f"{'1 proc MiB':>11} {'MiB/rank':>9} {'ratio':>6} {'sent MiB/rank':>14} {'blocks/rank':>12}"
    lines = [head, cols]
    for r in rows:
        lines.append(f"{r['L']:>7} {r['single_s'] * 1e3:>10.1f} {r['ring_s'] * 1e3:>9.1f} {r['speedup']:>8.2f} "
                     f"{r['single_tok_s']:>13.0f} {r['ring_tok_s']:>11.0f} {r['single_peak_mib']:>11.1f} "
                     f"{r['rank_peak_mib']:>9.1f} {r['rank_peak_mib'] / r['single_peak_mib']:>6.2f} "
                     f"{r['sent_mib_per_rank']:>14.2f} "
                     f"{'/'.join(map(str, r['blocks_per_rank'])):>12}")
    lines.append("MiB: peak memory of a process (its inputs, outputs and workspace); ratio: MiB/rank over 1 proc MiB;\n"
                 "sent: bytes each rank sends per call; blocks: (query chunk, key chunk) pairs each rank computes "
                 "per call")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    from .bench import positive_int

    p = argparse.ArgumentParser(prog="python -m qkv.bench_distributed", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--world", type=positive_int, default=2,
                   help="ranks to start on this machine (ignored under torchrun)")
    p.add_argument("--lengths", type=positive_int, nargs="+", default=list(LENGTHS),
                   help="sequence lengths L, each divisible by the world size (twice it for zigzag)")
    p.add_argument("--heads", type=positive_int, default=DEFAULTS["heads"], help="query heads")
    p.add_argument("--kv-heads", type=positive_int, default=DEFAULTS["kv_heads"],
                   help="key/value heads, dividing --heads (None: as many as --heads)")
    p.add_argument("--head-dim", type=positive_int, default=DEFAULTS["head_dim"], help="D")
    p.add_argument("--batch", type=positive_int, default=DEFAULTS["batch"], help="batch rows")
    p.add_argument("--dtype", default=DEFAULTS["dtype"], choices=DTYPES, help="inputs' dtype")
    p.add_argument("--mask", default=DEFAULTS["mask"], choices=("causal", "none"), help="the attention mask")
    p.add_argument("--layout", default=DEFAULTS["layout"], choices=("contiguous", "zigzag"),
                   help="how the sequence is split over the ranks (zigzag balances causal work)")
    p.add_argument("--repeat", type=positive_int, default=DEFAULTS["repeat"],
                   help="timed calls per length (the best is reported)")
    p.add_argument("--backward", action="store_true", help="time forward + backward")
    p.add_argument("--json", action="store_true", help="print the rows as JSON instead of a table")
    p.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    p.add_argument("--folder", help=argparse.SUPPRESS)
    return p


def main(argv=None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if importlib.util.find_spec("torch") is None:
        print("the distributed benchmark needs torch: pip install 'qkv[torch]'", file=sys.stderr)
        return 1
    if args.worker is not None:
        _worker(args.worker, args.world, Path(args.folder))
        return 0
    cfg = with_defaults({k: getattr(args, k) for k in DEFAULTS}, args.lengths)
    options = {k: cfg[k] for k in DEFAULTS}
    torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    try:  # under torchrun the group's size is the world
        check_config(int(os.environ["WORLD_SIZE"]) if torchrun else args.world, cfg)
    except ValueError as error:
        parser.error(str(error))
    if torchrun:
        rows = _under_torchrun(cfg)
    else:
        rows = run_distributed_bench(args.world, args.lengths, **options)
    if rows is not None:
        print(json.dumps(rows, indent=1) if args.json else format_table(rows, options))
    return 0


if __name__ == "__main__":
    sys.exit(main())
