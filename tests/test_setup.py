import random

import numpy as np
import pytest
import torch

from lib import setup as S


def test_seed_everything_makes_all_generators_repeat():
    S.seed_everything(123)
    a = (random.random(), np.random.rand(), torch.rand(3))
    S.seed_everything(123)
    b = (random.random(), np.random.rand(), torch.rand(3))
    assert a[0] == b[0] and a[1] == b[1] and torch.equal(a[2], b[2])


@pytest.mark.parametrize("bad", [-1, 1.5, "0", True])
def test_seed_rejects_bad_values(bad):
    with pytest.raises(ValueError, match="seed"):
        S.seed_everything(bad)


def test_pick_device_cpu_and_bad_values(monkeypatch):
    monkeypatch.delenv("GPTBOOK_DEVICE", raising=False)
    assert S.pick_device("cpu") == torch.device("cpu")
    assert S.pick_device("auto").type in ("cpu", "cuda", "mps")
    with pytest.raises(ValueError, match="preference"):
        S.pick_device("tpu")
    monkeypatch.setenv("GPTBOOK_DEVICE", "cpu")
    assert S.pick_device() == torch.device("cpu")
    monkeypatch.setenv("GPTBOOK_DEVICE", "gpu")
    with pytest.raises(ValueError, match="GPTBOOK_DEVICE"):
        S.pick_device()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised on a machine without CUDA")
def test_pick_device_cuda_without_cuda_is_a_clear_error():
    with pytest.raises(ValueError, match="cuda"):
        S.pick_device("cuda")


def test_setup_returns_env_and_sets_print_options(monkeypatch):
    monkeypatch.delenv("GPTBOOK_DEVICE", raising=False)
    env = S.setup(seed=7, device="cpu")
    assert env.device == torch.device("cpu") and not env.colab and env.seed == 7
    assert env.pick(cpu=1, gpu=2) == 1
    assert (env.root / "lib" / "setup.py").exists()
    assert "0.3333" in repr(torch.tensor([1 / 3]))
    assert S.Env(device=torch.device("cuda"), colab=False).pick(cpu=1, gpu=2) == 2


def test_glue_and_show_source():
    with pytest.raises(ValueError, match="name"):
        S.glue("", 1)
    S.glue("answer", 42)  # myst-nb is installed in the test environment
    code = S.show_source(S.seed_everything)
    assert "def seed_everything" in str(getattr(code, "data", code))
    with pytest.raises(TypeError, match="obj"):
        S.show_source(42)
