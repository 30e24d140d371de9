import importlib.util
import os
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, settings

sys.path.insert(0, str(Path(__file__).parent))


def _use_triton_interpreter() -> None:
    """Triton decides when it is imported whether kernels run in its CPU interpreter; without
    a GPU, the triton backend's tests need it, so it is set before anything imports triton."""
    if importlib.util.find_spec("triton") is None or importlib.util.find_spec("torch") is None:
        return
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


_use_triton_interpreter()

from helpers import BACKENDS  # noqa: E402

# Property tests: the same examples on every run (CI must not flip), no deadline (2 slow cores);
# `backend` is a plain name, safe to share between examples.
settings.register_profile("qkv", max_examples=25, deadline=None, derandomize=True,
                          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
settings.load_profile("qkv")


@pytest.fixture(params=BACKENDS)
def backend(request):
    """Every backend that can run on this machine (the oracle excluded)."""
    return request.param


@pytest.fixture
def rng():
    return np.random.default_rng(1234)
