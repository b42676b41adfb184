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


# SmolLM2-135M-Instruct's GGUF file (98 MB), shared by test_gguf, test_smollm and
# test_posttrain: lib parses and dequantises it once per session (per xdist worker), and
# transformers builds its tokenizer from it once.


@pytest.fixture(scope="session")
def smollm2_path():
    from lib.smollm import smollm2_gguf

    return smollm2_gguf()


@pytest.fixture(scope="session")
def smollm2_file(smollm2_path):
    """``(GGUFFile, dequantised tensors)`` from :func:`lib.gguf.load_gguf`, checksum
    verified."""
    from lib.gguf import load_gguf
    from lib.smollm import GGUF_SHA256

    return load_gguf(smollm2_path, sha256=GGUF_SHA256)


@pytest.fixture(scope="session")
def smollm2(smollm2_file):
    """``(model, tokenizer)`` in lib, built from the parsed file as from_gguf builds them."""
    from lib.smollm import model_from_gguf, tokenizer_from_gguf

    gf, weights = smollm2_file
    return model_from_gguf(gf.metadata, weights), tokenizer_from_gguf(gf.metadata)


@pytest.fixture(scope="session")
def hf_smollm2_tokenizer(smollm2_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_path.parent, gguf_file=smollm2_path.name)
