"""The book's CUDA paths checked on a CPU-only machine, through tests/fakecuda (a C++ shim that
gives the CPU build a CUDA device guard and hooks, built here with g++; see its docstring).

Each check runs in its own Python process, since the shim must be loaded before torch is
imported: ``python -m tests.fakecuda --capability C ...``. Capability 7.5 is Colab's T4 (lib
trains it in float32), 8.0 an A100 (bf16 autocast). Without g++ or with another torch than the
shim was written for, the tests skip saying why; under ``CI=true`` they fail instead."""
from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import fakecuda

ROOT = Path(__file__).resolve().parent.parent
CAPABILITIES = ["7.5", "8.0"]


@pytest.fixture(scope="module")
def shim():
    start = time.perf_counter()
    path = fakecuda.shim_or_skip()
    print(f"fake-CUDA shim ready in {time.perf_counter() - start:.1f} s: {path}")
    return path


def run_emulated(capability: str, *pytest_args: str, wrapper: bool = True
                 ) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "tests.fakecuda", "--capability", capability,
               *([] if wrapper else ["--no-wrapper"]), "-q", "-p", "no:cacheprovider",
               *pytest_args]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900,
                          env=fakecuda.subprocess_env(capability))


def _summary(done: subprocess.CompletedProcess) -> str:
    lines = [line for line in done.stdout.splitlines() if "registered at" not in line]
    return "\n".join(lines[-60:]) + "\n" + done.stderr[-3000:]


@pytest.mark.parametrize("capability", CAPABILITIES)
def test_fake_mode_checks(shim, capability):
    """tests/fakecuda/fake_mode_checks.py: the GPU profile's step (devices, dtypes, fused
    AdamW), the compiled forward with fullgraph=True, a CPU tensor raising, every chapter's
    gpu= line filed in GPU_SETTINGS, and the peak memory of the one that changes a step's
    size (chapter 11's GPU profile) against a T4's budget."""
    done = run_emulated(capability, "tests/fakecuda/fake_mode_checks.py", wrapper=False)
    assert done.returncode == 0, _summary(done)
    assert re.search(r"^\d+ passed in ", done.stdout, re.M), _summary(done)  # none skipped


@pytest.mark.parametrize("capability", CAPABILITIES)
def test_the_gpu_tests_pass_on_emulated_cuda(shim, capability):
    """tests/test_cuda.py (skipped in a plain CPU run) on fake CUDA whose tensors hold CPU
    values: training with amp/compile/fused AdamW, bf16 generation, resuming the CUDA random
    state. A batch left on the CPU, a model not moved, or a generator state not restored
    fails here as on a GPU (compile runs eagerly: its tracing is test_fake_mode_checks')."""
    done = run_emulated(capability, "tests/test_cuda.py")
    assert done.returncode == 0, _summary(done)
    assert re.search(r"^4 passed in ", done.stdout, re.M), _summary(done)


def test_the_chapter_switch_gives_cuda_with_cpu_settings(shim):
    """GPTBOOK_FAKE_CUDA=1 (tools/fake_cuda_chapters.py): a chapter's setup() returns CUDA as
    its device while env.pick keeps the CPU value, and a CPU tensor meeting a model moved to
    env.device raises as on a GPU."""
    code = ("from lib.setup import setup; import torch\n"
            "env = setup()\n"
            "layer = torch.nn.Linear(3, 2).to(env.device)\n"
            "print(env.device.type, env.pick(cpu='small', gpu='large'),\n"
            "      layer(torch.ones(1, 3, device=env.device)).device)\n"
            "try:\n    layer(torch.ones(1, 3))\nexcept RuntimeError as e:\n    print(e)\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=300,
                          env=fakecuda.subprocess_env("7.5", GPTBOOK_FAKE_CUDA="1"))
    assert done.returncode == 0, _summary(done)
    lines = done.stdout.splitlines()
    assert lines[0] == "cuda small cuda:0"
    assert "same device" in lines[1]


def test_a_random_draw_needs_a_generator_of_its_own_device(shim):
    """As on a GPU: a CPU generator cannot drive a draw on the device, nor the device's
    generator a draw on the CPU (torch's "Expected a 'cuda' device type for generator" error);
    ``torch.Generator("cuda")`` reports ``cuda`` (no index, as torch's CUDA generator made
    from the bare string) and repeats its draws after the same seed."""
    code = ("from tests import fakecuda; fakecuda.activate_from_env(); import torch\n"
            "probs = torch.ones(2, 3, device='cuda')\n"
            "def gen(device): return torch.Generator(device).manual_seed(0)\n"
            "draws = {\n"
            " 'cpu-on-cuda multinomial': lambda: torch.multinomial(probs, 1, generator=gen('cpu')),\n"
            " 'cpu-on-cuda randn': lambda: torch.randn(2, device='cuda', generator=gen('cpu')),\n"
            " 'cuda-on-cpu randn': lambda: torch.randn(2, generator=gen('cuda')),\n"
            " 'cuda-on-cuda uniform_': lambda: probs.clone().uniform_(generator=gen('cuda')),\n"
            " 'cuda-on-cuda multinomial': lambda: torch.multinomial(probs, 1,\n"
            "                                                      generator=gen('cuda'))}\n"
            "for name, draw in draws.items():\n"
            "    try:\n        print(name, draw().device)\n"
            "    except RuntimeError as error:\n        print(name, error)\n"
            "again = [torch.randn(3, device='cuda', generator=gen('cuda')) for _ in range(2)]\n"
            "print(torch.Generator('cuda').device, torch.equal(*again),\n"
            "      isinstance(torch.default_generator, torch.Generator))\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env=fakecuda.subprocess_env("8.0"))
    assert done.returncode == 0, _summary(done)
    assert done.stdout.splitlines() == [
        "cpu-on-cuda multinomial Expected a 'cuda' device type for generator but found 'cpu'",
        "cpu-on-cuda randn Expected a 'cuda' device type for generator but found 'cpu'",
        "cuda-on-cpu randn Expected a 'cpu' device type for generator but found 'cuda'",
        "cuda-on-cuda uniform_ cuda:0",
        "cuda-on-cuda multinomial cuda:0",
        "cuda True True"]


@pytest.fixture
def tool():
    "tools/fake_cuda_chapters.py (`make devices`) as a module."
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import fake_cuda_chapters
    finally:
        sys.path.remove(str(ROOT / "tools"))
    return fake_cuda_chapters


def test_the_shortened_emulated_run_matches_the_chapters(tool):
    """`make devices` trains 12a shorter (SHORTER): each line it replaces is in exactly one code
    cell of the chapter as committed and is replaced there, and each assert allowed to fail in
    the shortened run (NEEDS_FULL_LENGTH) is a line of the code cell it names."""
    import nbformat
    assert set(tool.NEEDS_FULL_LENGTH) <= set(tool.SHORTER)
    for stem, lines in tool.SHORTER.items():
        nb = nbformat.read(ROOT / "chapters" / f"{stem}.ipynb", as_version=4)
        code = {c.get("id"): c.source.splitlines() for c in nb.cells if c.cell_type == "code"}
        for cell_id, (line, _) in tool.NEEDS_FULL_LENGTH.get(stem, {}).items():
            assert line.startswith("assert ") and line in code.get(cell_id, []), cell_id
        tool.shorten(nb, stem)
        after = [c.source.splitlines() for c in nb.cells if c.cell_type == "code"]
        for line, new in lines.items():
            assert sum(line in c for c in code.values()) == 1, line
            assert not any(line in c for c in after) and sum(new in c for c in after) == 1


def _traceback(lines: list[str], raised: int) -> str:
    "An IPython traceback of a cell whose line `raised` (0-based) raised, in its format."
    shown = [f"{'---->' if i == raised else '     '} {i + 1} {text}"
             for i, text in enumerate(lines)]
    return "\n".join(["-" * 75, "AssertionError   Traceback (most recent call last)",
                      "Cell In[1], line 2", *shown, "", "AssertionError: "])


def test_only_a_named_assert_of_a_shortened_run_is_excused(tool, monkeypatch):
    stem, (cell_id, (line, _)) = next((s, next(iter(c.items())))
                                      for s, c in tool.NEEDS_FULL_LENGTH.items())
    cell = ["x = 1", "assert x.dtype == torch.float32", line]
    own, before = _traceback(cell, 2), _traceback(cell, 1)  # the line after is shown too

    def fails(shortened, ename, message, traceback, cell=cell_id):
        return tool.classify(stem, shortened, (cell, ename, message, traceback))[1]

    assert fails(True, "AssertionError", "x", own) is False
    assert fails(True, "AssertionError", "x", f"      9 x = 1\n---> 10 {line}\n") is False
    inner = own + "\nFile lib/stats.py:12, in compare()\n---> 12     assert n > 1\n"
    assert fails(True, "AssertionError", "", inner)  # raised inside a call on that line
    assert fails(False, "AssertionError", "x", own)  # as written: a failure
    assert fails(True, "AssertionError", "", before)  # another line of the cell raised
    assert fails(True, "AssertionError", "x", own, cell="another cell")
    assert fails(True, "AssertionError", "The values for attribute 'dtype' do not match", own)
    assert fails(True, "RuntimeError", "Expected all tensors to be on the same device", own)
    monkeypatch.setitem(tool.KNOWN, stem, {"c1": "needs the CPU stream"})
    assert fails(False, "ValueError", "x", "", cell="c1") is False
    assert fails(False, "RuntimeError", "Expected all tensors to be on the same device", "",
                 cell="c1")  # KNOWN never excuses a device error


def test_errors_are_read_from_the_outputs_and_decide_the_exit_code(tool, monkeypatch):
    import nbformat
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("1/0", id="c0")])
    nb.cells[0].outputs = [nbformat.v4.new_output(
        "error", ename="ZeroDivisionError", evalue="division by zero",
        traceback=["\x1b[0;31m----> 1\x1b[0m 1/0", "ZeroDivisionError: division by zero"])]
    ((index, cell_id, ename, message, traceback),) = tool.errors_of(nb)
    assert (index, cell_id, ename, message) == (0, "c0", "ZeroDivisionError", "division by zero")
    assert tool.raised_at(traceback) == "1/0"  # colour codes stripped
    monkeypatch.setattr(tool.fakecuda, "build_shim", lambda: None)
    for error, code in ((("c0", "RuntimeError", "Expected all tensors to be on the same device",
                          ""), 1), (("c0", "ValueError", "x", ""), 1), (None, 0)):
        found = [(0, *error)] if error else []
        monkeypatch.setattr(tool, "run", lambda *args, found=found: (1.0, 1.0, found))
        assert tool.main(["chapters/12a_architecture_training.ipynb"]) == code
