"""Run a few local processes together (the ranks of a distributed run) and never hang:
a rank that fails or outlives the deadline stops them all, with its output in the error."""
from __future__ import annotations

import subprocess
import time
from pathlib import Path


class RanksFailed(RuntimeError):
    """A rank exited with an error or ran past the deadline (the message has its output)."""


def run_ranks(commands: list[list[str]], folder: Path, timeout: float, env: dict) -> None:
    """Start one process per command (rank r logs to folder/rank{r}.log) and wait for all.

    Raises RanksFailed, after killing every rank still running, when a rank exits with an
    error (the others get 5 s to report how they saw it) or the run takes over `timeout` s.
    """
    logs, procs = [], []
    try:  # from the first start on: a rank that cannot start still stops those already running
        for rank, cmd in enumerate(commands):
            logs.append(open(folder / f"rank{rank}.log", "wb"))
            procs.append(subprocess.Popen(cmd, stdout=logs[-1], stderr=subprocess.STDOUT, env=env))
        _wait_all(procs, folder, timeout)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for log in logs:
            log.close()


def _wait_all(procs, folder: Path, timeout: float) -> None:
    deadline, grace, first = time.monotonic() + timeout, None, None
    while any(p.poll() is None for p in procs):
        failed = [r for r, p in enumerate(procs) if p.poll() not in (None, 0)]
        now = time.monotonic()
        if failed and grace is None:
            first, grace = failed[0], now + 5.0  # let the other ranks report how they saw it, then stop them
        if now > deadline or (grace is not None and now > grace):
            break
        time.sleep(0.05)
    failed = [r for r, p in enumerate(procs) if p.poll() not in (None, 0)]
    running = [r for r, p in enumerate(procs) if p.poll() is None]
    if failed:
        first = failed[0] if first is None else first
        raise RanksFailed(f"rank(s) {failed} of {len(procs)} failed (exit codes "
                          f"{[procs[r].returncode for r in failed]}; rank {first} was seen first)"
                          + _tails(folder, [first] + [r for r in failed if r != first]))
    if running:
        raise RanksFailed(f"rank(s) {running} of {len(procs)} did not finish within {timeout:.0f} s and were "
                          "killed" + _tails(folder, running))


def _tails(folder: Path, ranks) -> str:
    parts = []
    for r in ranks:
        text = (folder / f"rank{r}.log").read_text(errors="replace").strip().splitlines()
        parts.append(f"\n--- rank {r} output (last lines) ---\n" + "\n".join(text[-15:]))
    return "".join(parts)
