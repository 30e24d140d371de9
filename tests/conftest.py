import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))

from helpers import BACKENDS  # noqa: E402


@pytest.fixture(params=BACKENDS)
def backend(request):
    """Every backend that can run on this machine (the oracle excluded)."""
    return request.param


@pytest.fixture
def rng():
    return np.random.default_rng(1234)
