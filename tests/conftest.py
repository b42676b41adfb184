"""Fixtures for the unit tests. The environment (headless matplotlib, the shared data copies, the
repository root on sys.path) is set by the repository's conftest.py, for the chapters too."""
import pytest
import torch


@pytest.fixture(scope="module")
def one_thread():
    """Run a module's tests on one torch thread. Their tensors are tiny, so thread start-up and
    spinning dominate, badly so on a busy 2-core machine. Use with
    ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
