"""Shared test set-up: the repository root on sys.path, a headless matplotlib backend."""
import os
import sys
from pathlib import Path

import pytest
import torch

os.environ.setdefault("MPLBACKEND", "Agg")
ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


@pytest.fixture(scope="module")
def one_thread():
    """Run a module's tests on one torch thread. Their tensors are tiny, so thread start-up and
    spinning dominate, badly so on a busy 2-core machine. Use with
    ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
