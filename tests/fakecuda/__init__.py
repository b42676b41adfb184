"""Fake CUDA on a CPU-only torch build: the book's GPU code paths exercised in CPU CI.

Nothing here touches a GPU. Three layers, used by ``tests/test_fake_cuda.py`` (which also runs
``tests/test_cuda.py`` this way), the ``GPTBOOK_FAKE_CUDA`` switch of ``lib.setup`` and
``tools/fake_cuda_chapters.py``:

1. ``shim.cpp``, compiled with g++ against the installed torch into a cache directory
   (:func:`build_shim`) and loaded before ``import torch`` (:func:`load_shim`, or
   ``LD_PRELOAD``): a CUDA device guard (c10's ``FakeGuardImpl``) and CUDA hooks that say
   "built and available, one device" and hand out the CPU allocator and CPU generators. A
   CPU-only build has neither, so without it no tensor that claims ``cuda:0`` can pass a
   device guard, take part in backward or be pinned.
2. :func:`patch_torch_cuda`: the Python side of ``torch.cuda`` (``is_available``, the device's
   capability and name, its random state, memory statistics) answers as one GPU of the given
   compute capability would: 7.5 is a T4 (float32 training in lib), 8.0 an A100 (bf16).
3. Tensors that claim ``cuda:0``: ``FakeTensorMode`` (shapes, dtypes, devices, peak memory;
   no values) or :mod:`tests.fakecuda.wrapper` (real CPU values behind a ``cuda:0`` face, for
   code that reads values: training, generation, the chapters).

Limits: CPU numerics (SDPA takes the math path, no TF32), no asynchronous copies, one device,
CPU generators underneath (``torch.Generator("cuda")`` reports ``cuda``, and a draw with a
generator of the other device raises as on a GPU: :mod:`tests.fakecuda.rng`), and a 0-dim CPU
tensor accepted in every op (a GPU accepts it only in the ops without a device check);
``torch.compile`` is traced (FakeTensorMode, ``aot_eager``) but runs eagerly under the wrapper.
The shim and the dispatcher details it relies on are private torch APIs: they are pinned to
:data:`TORCH_VERSION`; elsewhere the callers skip, and fail when ``CI=true``.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SHIM_SOURCE = HERE / "shim.cpp"
TORCH_VERSION = "2.13.0"  # the torch these private APIs were written and checked against
SHIM_ENV = "GPTBOOK_FAKE_CUDA_SHIM"  # set by load_shim / the runners: the loaded library's path
CAPABILITY_ENV = "GPTBOOK_FAKE_CUDA_CAPABILITY"  # "8.0" or "7.5" in the emulated process

# GPUs by compute capability: memory as the real devices report it; the name marked fake.
DEVICES = {(7, 5): ("Tesla T4 (fake CUDA)", 15_828_320_256),
           (8, 0): ("NVIDIA A100-SXM4-40GB (fake CUDA)", 42_298_834_944)}


class ShimUnavailable(RuntimeError):
    """The shim cannot be built or used here (no g++, another torch version, torch imported)."""


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() == "true"


def _torch_dir() -> Path:
    """The installed torch package, found without importing it (the shim must load first)."""
    import importlib.util

    spec = importlib.util.find_spec("torch")
    if spec is None or spec.origin is None:
        raise ShimUnavailable("torch is not installed")
    return Path(spec.origin).parent


def installed_torch_version() -> str:
    from importlib.metadata import version

    return version("torch").split("+")[0]


def cache_dir() -> Path:
    """Beside lib's caches (GPTBOOK_CACHE: a fresh folder per CI run, so CI pays the build)."""
    default = Path.home() / ".cache" / "gpt-from-the-ground-up"
    return Path(os.environ.get("GPTBOOK_CACHE") or default) / "fakecuda"


def build_shim() -> Path:
    """Compile shim.cpp against the installed torch (cached by source, torch and Python) and
    return the library's path; :class:`ShimUnavailable` saying why when it cannot."""
    version = installed_torch_version()
    if version != TORCH_VERSION:
        raise ShimUnavailable(f"fake CUDA is written for torch {TORCH_VERSION} (private APIs); "
                              f"torch {version} is installed")
    torch_dir = _torch_dir()
    key = hashlib.sha256(SHIM_SOURCE.read_bytes() + str(torch_dir).encode()
                         + version.encode()).hexdigest()[:16]
    target = cache_dir() / f"fakecuda-{key}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(f".{os.getpid()}.tmp")
    command = ["g++", "-std=c++20", "-O1", "-shared", "-fPIC", "-w",
               f"-I{torch_dir / 'include'}", str(SHIM_SOURCE), f"-L{torch_dir / 'lib'}",
               "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{torch_dir / 'lib'}", "-o", str(tmp)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise ShimUnavailable(f"cannot run g++ to build the fake-CUDA shim: {error}") from error
    if done.returncode != 0:
        raise ShimUnavailable("g++ failed to build the fake-CUDA shim:\n" + done.stderr[-3000:])
    os.replace(tmp, target)
    return target


def shim_or_skip() -> Path:
    """:func:`build_shim` for tests: a failure fails under CI=true, skips (with the reason)
    elsewhere."""
    import pytest

    try:
        return build_shim()
    except ShimUnavailable as error:
        if in_ci():
            pytest.fail(f"fake CUDA must run in CI: {error}")
        pytest.skip(f"fake CUDA unavailable: {error}")


def load_shim(path: Path | None = None) -> Path:
    """Load the shim into this process; it must come before ``import torch`` (torch reads the
    CUDA hooks once). Idempotent when it is already loaded (e.g. by LD_PRELOAD)."""
    if _shim_loaded():
        return Path(os.environ.get(SHIM_ENV, "LD_PRELOAD"))
    if "torch" in sys.modules:
        raise ShimUnavailable("the fake-CUDA shim must be loaded before torch is imported")
    path = path or build_shim()
    ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
    os.environ[SHIM_ENV] = str(path)
    return path


def _shim_loaded() -> bool:
    try:
        return bool(ctypes.CDLL(None).gptbook_fake_cuda_loaded())
    except AttributeError:
        return False


def subprocess_env(capability: str = "8.0", **extra: str) -> dict[str, str]:
    """The environment of a child process that runs on fake CUDA: the shim preloaded."""
    env = dict(os.environ, LD_PRELOAD=str(build_shim()), **{CAPABILITY_ENV: capability},
               **extra)
    env.pop("PYTEST_XDIST_WORKER", None)
    return env


def parse_capability(text: str) -> tuple[int, int]:
    major, minor = (int(part) for part in text.split("."))
    if (major, minor) not in DEVICES:
        raise ValueError(f"capability must be one of {sorted(DEVICES)}, got {text!r}")
    return major, minor


def patch_torch_cuda(capability: tuple[int, int] = (8, 0)) -> None:
    """Make ``torch.cuda``'s Python side report one GPU of ``capability``. Needs the shim
    loaded (the C++ side: device guard, hooks, autograd's accelerator)."""
    import torch

    if not _shim_loaded():
        raise ShimUnavailable("load_shim() (or LD_PRELOAD) must run before torch is imported")
    if torch.accelerator.current_accelerator() != torch.device("cuda"):
        raise ShimUnavailable("the shim is loaded but torch does not see it as its accelerator "
                              "(it was imported before the shim)")
    name, memory = DEVICES[capability]
    from tests.fakecuda import rng

    cuda = torch.cuda
    cuda.is_available = lambda: True
    cuda.device_count = lambda: 1
    cuda.current_device = lambda: 0
    cuda.set_device = lambda device: None
    cuda.synchronize = lambda device=None: None
    cuda.is_initialized = lambda: True
    cuda._lazy_init = lambda: None
    cuda.init = lambda: None
    cuda.get_device_capability = lambda device=None: capability
    cuda.get_device_name = lambda device=None: name
    # as torch's: a T4 (7.5) answers True unless emulation is excluded (lib checks 8.0 itself)
    cuda.is_bf16_supported = lambda including_emulation=True: (
        capability >= (8, 0) or including_emulation)
    cuda.get_arch_list = lambda: [f"sm_{capability[0]}{capability[1]}"]
    cuda.mem_get_info = lambda device=None: (memory, memory)
    for stat in ("memory_allocated", "max_memory_allocated", "memory_reserved",
                 "max_memory_reserved"):
        setattr(cuda, stat, lambda device=None: 0)
    for noop in ("reset_peak_memory_stats", "empty_cache", "reset_accumulated_memory_stats"):
        setattr(cuda, noop, lambda device=None: None)
    rng.patch(cuda)
    os.environ[CAPABILITY_ENV] = f"{capability[0]}.{capability[1]}"


def activate_from_env() -> tuple[int, int]:
    """In a process started with :func:`subprocess_env`: patch ``torch.cuda`` for the
    capability it names and put values behind ``cuda:0`` (:mod:`tests.fakecuda.wrapper`)."""
    capability = parse_capability(os.environ.get(CAPABILITY_ENV, "8.0"))
    patch_torch_cuda(capability)
    from tests.fakecuda import wrapper

    wrapper.install()
    return capability
