"""Notebook bootstrap: one call at the top of every chapter.

The chapter's first cell finds (or, on Colab, clones) the repository, puts it on ``sys.path`` and
calls :func:`setup`. ``setup`` installs the requirements when running on Colab (without touching
Colab's torch), picks the device, seeds every random generator, fixes print options and the figure
style, and returns an :class:`Env` describing where the notebook runs.
"""
from __future__ import annotations

import os
import random
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, TypeVar

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
T = TypeVar("T")

_VALID_DEVICES = ("auto", "cpu", "cuda", "mps")


def in_colab() -> bool:
    """True when running inside Google Colab."""
    return "google.colab" in sys.modules


def pick_device(preference: str = "auto") -> torch.device:
    """Return the device to compute on: CUDA if present, then Apple MPS, else CPU.

    ``preference`` asks for one of 'cpu', 'cuda', 'mps' (or 'auto'). The environment variable
    ``GPTBOOK_DEVICE`` overrides 'auto', which lets CI and readers pin the CPU path. MPS is
    untested: it is used only when a probe of the chapters' ops (:func:`_ops_probe`) runs there,
    else the CPU, and either way one printed line says so.
    """
    if preference == "auto":
        preference = os.environ.get("GPTBOOK_DEVICE", "auto")
    if preference not in _VALID_DEVICES:
        raise ValueError(f"preference (or GPTBOOK_DEVICE when preference is 'auto') must be one "
                         f"of {_VALID_DEVICES}, got {preference!r}")
    mps = getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available()
    available = {"cuda": torch.cuda.is_available(), "mps": mps, "cpu": True}
    if preference == "auto":
        preference = next(d for d in ("cuda", "mps", "cpu") if available[d])
    elif not available[preference]:
        raise ValueError(f"device {preference!r} was asked for, but torch finds none")
    if preference == "mps":  # untested: used only when the ops the chapters need run there
        failure = _ops_probe(torch.device("mps"))
        outcome = f"using the CPU ({failure})" if failure else "its ops ran in a probe, using mps"
        print(f"Apple MPS is untested with this book: {outcome}. GPTBOOK_DEVICE=cpu picks the CPU.")
        return torch.device("cpu" if failure else "mps")
    return torch.device(preference)


def _ops_probe(mps: torch.device) -> str | None:
    """None when a small run of the ops the chapters use works on ``mps``, else what failed: causal
    SDPA, float32 and bfloat16 matmuls, cross-entropy's backward, AdamW, top-k and sampling.
    Fixed inputs and its own generator, so the global random state is untouched."""
    try:
        x = torch.linspace(-1.0, 1.0, 32, device=mps).reshape(4, 8)
        q = x.reshape(1, 2, 2, 8)
        torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
        for dtype in (torch.float32, torch.bfloat16):
            x.to(dtype) @ x.to(dtype).T
        w = x.T[:, :3].clone().requires_grad_()
        torch.nn.functional.cross_entropy(x @ w, torch.tensor([0, 1, 2, 0], device=mps)).backward()
        torch.optim.AdamW([w]).step()
        probs = torch.softmax(w.detach().topk(2, dim=-1).values, dim=-1)
        torch.multinomial(probs, 1, generator=torch.Generator(device=mps).manual_seed(0))
    except Exception as exc:  # any failure means: not this device
        return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:160]
    return None


def seed_everything(seed: int = 0) -> None:
    """Seed Python's, NumPy's and torch's generators (all devices) with ``seed``."""
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # also seeds CUDA and MPS generators


@dataclass(frozen=True)
class Env:
    """Where a chapter runs and the settings that depend on it."""

    device: torch.device
    colab: bool
    root: Path = field(default=ROOT)
    seed: int = 0
    emulated: bool = False  # CUDA emulated on a CPU (GPTBOOK_FAKE_CUDA=1): CPU-sized settings

    @property
    def accelerated(self) -> bool:
        """True on a GPU (CUDA or MPS): chapters then use their larger settings."""
        return self.device.type in ("cuda", "mps")

    def pick(self, *, cpu: T, gpu: T) -> T:
        """The one switch between small CPU settings (what CI runs) and larger GPU settings."""
        return gpu if self.accelerated and not self.emulated else cpu


def _install_requirements_on_colab(root: Path) -> None:
    """Install requirements.txt on Colab; its ranges are satisfied by Colab's torch, so torch stays."""
    marker = root / ".colab-installed"
    if marker.exists():
        return
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "-r",
                    str(root / "requirements.txt")], check=True)
    marker.touch()


def setup(seed: int = 0, device: str = "auto") -> Env:
    """Prepare a chapter: install on Colab, choose the device, seed, set print and figure style.

    With ``GPTBOOK_FAKE_CUDA=1`` (a test switch: ``tools/fake_cuda_chapters.py``) the device
    is CUDA emulated on the CPU by ``tests/fakecuda`` while ``Env.pick`` keeps the CPU
    settings, so a chapter's device handling runs in CI at CPU sizes (12a's, for the budget).
    """
    colab = in_colab()
    if colab:
        _install_requirements_on_colab(ROOT)
    emulated = os.environ.get("GPTBOOK_FAKE_CUDA") == "1"
    if emulated:  # a test switch (tools/fake_cuda_chapters.py): CUDA emulated on the CPU
        from tests.fakecuda import activate_from_env

        activate_from_env()
        device = "cuda"
    seed_everything(seed)
    torch.set_printoptions(precision=4, sci_mode=False, linewidth=100)
    np.set_printoptions(precision=4, suppress=True, linewidth=100)
    # Imported here so that a failure to import matplotlib never hides a device or seed problem.
    from lib import plotting

    plotting.use_style()
    return Env(device=pick_device(device), colab=colab, seed=seed, emulated=emulated)


def glue(name: str, value: Any, display: bool = False) -> None:
    """Store ``value`` under ``name`` for ``{glue:text}`` in the book's prose.

    Uses myst-nb's ``glue`` when it is installed (building the book, running the tests); on a
    reader's machine without myst-nb (plain Colab) it shows the value instead of failing.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"name must be a non-empty string, got {name!r}")
    try:
        from myst_nb import glue as _glue
    except ImportError:  # pragma: no cover - exercised only without myst-nb
        if display:
            print(f"{name} = {value!r}")
        return
    _glue(name, value, display=display)


def show_source(obj: Callable[..., Any] | type) -> Any:
    """Return a library object's source as highlighted code (each chapter's 'library version')."""
    import inspect

    if not (inspect.isfunction(obj) or inspect.isclass(obj) or inspect.ismethod(obj)):
        raise TypeError(f"obj must be a function, method or class, got {type(obj).__name__}")
    source = inspect.getsource(obj)
    try:
        from IPython.display import Code
    except ImportError:  # pragma: no cover
        return source
    return Code(source, language="python")
