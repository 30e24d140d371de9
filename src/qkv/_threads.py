"""Threads for the NumPy code paths: one shared pool, and BLAS kept to one thread inside it."""
from __future__ import annotations

import contextlib
import os
import threading
from concurrent.futures import ThreadPoolExecutor

_pool: ThreadPoolExecutor | None = None


def available_cpus() -> int:
    """The CPUs this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def cpu_name() -> str:
    """The processor's model name (Linux), or what the platform module knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or "unknown CPU"


_blas_lock = threading.Lock()
_blas_users = 0  # calls inside one_blas_thread now, in any thread
_blas_limiter = None  # their shared limit, undone when the last one leaves


@contextlib.contextmanager
def one_blas_thread():
    """A context in which BLAS runs single-threaded: our threads split the work, BLAS threads
    inside them would only oversubscribe the cores. Needs threadpoolctl (qkv[cpu]); without
    it BLAS keeps its own threads. The limit is process-wide, so calls from several threads
    share one: the first sets it and the last restores what was there before."""
    global _blas_users, _blas_limiter
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        yield
        return
    with _blas_lock:
        if _blas_users == 0:
            _blas_limiter = threadpool_limits(limits=1, user_api="blas")
        _blas_users += 1
    try:
        yield
    finally:
        with _blas_lock:
            _blas_users -= 1
            if _blas_users == 0:
                _blas_limiter.restore_original_limits()
                _blas_limiter = None


def parallel_map(fn, items) -> list:
    """[fn(x) for x in items], on the shared pool when there is more than one item."""
    global _pool
    items = list(items)
    if len(items) <= 1:
        return [fn(x) for x in items]
    if _pool is None:
        _pool = ThreadPoolExecutor(max_workers=available_cpus(), thread_name_prefix="qkv")
    with one_blas_thread():
        return list(_pool.map(fn, items))
