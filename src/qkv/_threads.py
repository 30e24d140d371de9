"""Threads for the NumPy code paths: one shared pool, and BLAS kept to one thread inside it."""
from __future__ import annotations

import contextlib
import os
import threading
from concurrent.futures import ThreadPoolExecutor

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _start_afresh_in_child():
    """A forked child inherits the pool but none of its threads, and the locks as some other
    thread may have held them: it makes its own (a BLAS limit set at the fork stays set)."""
    global _pool, _pool_lock, _blas_lock, _blas_users, _blas_limiter
    _pool, _pool_lock = None, threading.Lock()
    _blas_lock, _blas_users, _blas_limiter = threading.Lock(), 0, None


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
                _restore(_blas_limiter)
                _blas_limiter = None


def _restore(limiter):
    """Undo the limit from whichever thread leaves last. threadpoolctl 3.8 and later let only the
    thread that set OpenBLAS's limit change it again (the 'controlling thread'): control is
    released before the restore and after it, so the next first caller, in any thread, can set it."""
    import threadpoolctl

    release = getattr(getattr(threadpoolctl, "OpenBLASController", None), "clear_controlling_thread", None)
    if release is not None:
        release(force=True)
    limiter.restore_original_limits()
    if release is not None:
        release(force=True)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_start_afresh_in_child)


def parallel_map(fn, items) -> list:
    """[fn(x) for x in items], on the shared pool when there is more than one item."""
    global _pool
    items = list(items)
    if len(items) <= 1:
        return [fn(x) for x in items]
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=available_cpus(), thread_name_prefix="qkv")
        pool = _pool
    with one_blas_thread():
        return list(pool.map(fn, items))
