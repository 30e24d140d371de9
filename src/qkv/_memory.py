"""Peak memory of one call, as the operating system sees it (NumPy, torch and native
allocations alike): Linux's peak resident set, reset before the call."""
from __future__ import annotations

import ctypes
import sys
import tracemalloc


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _release_free_memory() -> None:
    """Hand freed heap pages back to the system (glibc), and the block the native kernel keeps
    between calls, so reused pages count as growth."""
    native = sys.modules.get("qkv.backends.native")
    if native is not None:
        native.release_kept_memory()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _reset_peak() -> bool:
    _release_free_memory()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM, the peak resident set
        return True
    except OSError:
        return False


def peak_growth(call):
    """(call(), bytes the peak resident memory grew by during it, how it was measured).

    Falls back to tracemalloc (Python and NumPy allocations only) where Linux's
    counters are not available.
    """
    before = _status_kib("VmRSS:") if _reset_peak() else None
    if before is None:
        tracemalloc.start()
        try:
            result = call()
            return result, tracemalloc.get_traced_memory()[1], "tracemalloc"
        finally:
            tracemalloc.stop()
    result = call()
    peak = _status_kib("VmHWM:")
    return result, max(0, (peak - before) * 1024), "peak resident set"
