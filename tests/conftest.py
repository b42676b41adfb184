"""Shared test set-up: the repository root on sys.path, a headless matplotlib backend, the shared
data copies (as the Makefile finds them)."""
import os
import sys
from pathlib import Path

import pytest
import torch

os.environ.setdefault("MPLBACKEND", "Agg")
ROOT = Path(__file__).resolve().parent.parent

# Like the Makefile: use the data copies beside the checkout (../shared, on CI and offline machines)
# when they exist and the variables are unset, so `pytest tests` and `make test` agree.
_SHARED = ROOT.parent / "shared"
if (_SHARED / "data" / "tinyshakespeare.txt").is_file():
    os.environ.setdefault("GPTBOOK_DATA", str(_SHARED / "data"))
if (_SHARED / "tiktoken_cache").is_dir():
    os.environ.setdefault("TIKTOKEN_CACHE_DIR", str(_SHARED / "tiktoken_cache"))
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
