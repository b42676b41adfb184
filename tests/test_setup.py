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


def _pretend_mps_only(monkeypatch, probe_result):
    monkeypatch.delenv("GPTBOOK_DEVICE", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    monkeypatch.setattr(S, "_ops_probe", lambda device: probe_result)


def test_pick_device_on_mps_uses_it_only_when_the_probe_passes(monkeypatch, capsys):
    """MPS is untested: a failing probe of the chapters' ops falls back to the CPU, a passing one
    keeps MPS, and either way one line says so."""
    _pretend_mps_only(monkeypatch, "RuntimeError: an op is not implemented for 'MPS'")
    assert S.pick_device() == torch.device("cpu")
    assert S.pick_device("mps") == torch.device("cpu")
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and all("untested" in l and "using the CPU" in l and
                                   "not implemented" in l for l in lines), lines
    _pretend_mps_only(monkeypatch, None)
    assert S.pick_device() == torch.device("mps")
    (line,) = capsys.readouterr().out.splitlines()
    assert "untested" in line and "using mps" in line


def test_ops_probe_passes_on_the_cpu_and_reports_a_missing_mps():
    """The real probe: on the CPU every op runs (so a working MPS would pass it too); on a
    machine without MPS it fails with one line saying why, and never touches the global RNG."""
    state = torch.get_rng_state()
    assert S._ops_probe(torch.device("cpu")) is None
    if not torch.backends.mps.is_available():
        failure = S._ops_probe(torch.device("mps"))
        assert failure and len(failure.splitlines()) == 1
    assert torch.equal(torch.get_rng_state(), state)


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


# --- The chapters' setup cell (tools/setup_cell.py) as a Colab user runs it -------------------

from pathlib import Path
import shutil
import subprocess
import sys
import types

REPO = Path(__file__).resolve().parent.parent
SETUP_CELL = (REPO / "tools" / "setup_cell.py").read_text()


def _copy_book(dest: Path) -> None:
    """A minimal clone of the book: lib/, the setup cell, the requirements (what the cell needs)."""
    shutil.copytree(REPO / "lib", dest / "lib", ignore=shutil.ignore_patterns("__pycache__"))
    (dest / "tools").mkdir(parents=True)
    shutil.copy(REPO / "tools" / "setup_cell.py", dest / "tools" / "setup_cell.py")
    shutil.copy(REPO / "requirements.txt", dest / "requirements.txt")


@pytest.fixture()
def colab(tmp_path, monkeypatch):
    """A Colab-like machine: cwd /content, a bare /lib beside it, google.colab imported,
    subprocess.run recorded instead of run. Yields (content dir, recorded calls)."""
    content = tmp_path / "content"
    content.mkdir()
    (tmp_path / "lib").mkdir()  # like Linux's /lib: a `lib` folder that is not this book's
    (tmp_path / "lib" / "x86_64-linux-gnu").mkdir()
    monkeypatch.chdir(content)
    monkeypatch.setitem(sys.modules, "google.colab", types.ModuleType("google.colab"))
    # The book is not on a Colab kernel's path: only what the cell adds may find `lib`.
    monkeypatch.setattr(sys, "path", [p for p in sys.path if Path(p or ".").resolve() != REPO])
    saved = {k: m for k, m in sys.modules.items() if k == "lib" or k.startswith("lib.")}
    for k in saved:
        del sys.modules[k]
    calls = []

    def fake_run(cmd, *args, **kwargs):
        calls.append(list(cmd))
        if cmd[:2] == ["git", "clone"]:  # what git would do, without the network
            _copy_book(content / cmd[-1])
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(subprocess, "run", fake_run)
    try:
        yield content, calls
    finally:
        for k in [k for k in sys.modules if k == "lib" or k.startswith("lib.")]:
            del sys.modules[k]
        sys.modules.update(saved)


def _run_setup_cell() -> dict:
    namespace: dict = {}
    exec(compile(SETUP_CELL, "setup_cell", "exec"), namespace)
    return namespace


def test_setup_cell_on_colab_uses_the_existing_clone_not_slash_lib(colab, monkeypatch):
    content, calls = colab
    monkeypatch.delenv("GPTBOOK_DEVICE", raising=False)
    _copy_book(content / "gpt-from-the-ground-up")
    ns = _run_setup_cell()
    clone = (content / "gpt-from-the-ground-up").resolve()
    assert Path(sys.modules["lib"].__file__).resolve().parent == clone / "lib"
    assert Path(sys.modules["lib.setup"].__file__).resolve() == clone / "lib" / "setup.py"
    assert ns["env"].colab and ns["env"].root.resolve() == clone
    assert not any(c[:2] == ["git", "clone"] for c in calls)  # the clone was there already
    # setup() installs requirements.txt from the clone once (Colab's torch satisfies its range).
    pip = [c for c in calls if c[1:4] == ["-m", "pip", "install"]]
    assert pip == [[sys.executable, "-m", "pip", "install", "--quiet", "-r",
                    str(clone / "requirements.txt")]]


def test_setup_cell_on_colab_clones_the_book_first(colab):
    content, calls = colab
    _run_setup_cell()
    assert calls[0] == ["git", "clone", "--depth=1",
                        "https://github.com/gpt-from-the-ground-up/gpt-from-the-ground-up",
                        "gpt-from-the-ground-up"]
    assert Path(sys.modules["lib"].__file__).resolve().parent == \
        (content / "gpt-from-the-ground-up" / "lib").resolve()


def test_setup_cell_outside_the_book_is_a_clear_error(tmp_path, monkeypatch):
    (tmp_path / "work").mkdir()
    (tmp_path / "lib").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    monkeypatch.setattr(sys, "path", list(sys.path))
    with pytest.raises(FileNotFoundError, match="chapters/ folder"):
        _run_setup_cell()
