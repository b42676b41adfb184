"""Run chapters on emulated CUDA and fail on any device or dtype error.

Usage: python tools/fake_cuda_chapters.py [--capability 7.5] [--full] chapters/12a_*.ipynb [...]

Each notebook runs (a copy; the committed file is left alone) in a kernel started with the
fake-CUDA shim preloaded and ``GPTBOOK_FAKE_CUDA=1``, so ``env.device`` is ``cuda`` (CPU
values behind it, tests/fakecuda) while ``env.pick`` keeps the CPU settings. Chapters named in
SHORTER below train shorter than written (12a: 20 steps instead of 100; ``--full`` runs them as
written). Every cell runs even after an error. The run fails when a cell raises a device or dtype
error (a tensor left on the CPU, a dtype a GPU path produces that the code did not expect; never
excused), or any other error not listed in KNOWN below with its reason, or, in a shortened run,
an AssertionError other than the claims about trained models listed in NEEDS_FULL_LENGTH. Results
can differ from the CPU run (dropout and other draws on the device come from CUDA's stream, not
the CPU's), so an assert that holds for one random stream only fails here: fix the claim, or list
it in KNOWN saying why.
"""
from __future__ import annotations

import argparse
import os
import re
import resource
import sys
import tempfile
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests import fakecuda  # noqa: E402

# What CI runs. Chapters with device-dependent code are 11, 12a and A1 (env.device); no other
# chapter uses env.device or env.pick. 12a (0 errors; with its cell-67 bug back, cell 67 raises
# the device error) is what fits CI's budget today. A1 was run once by hand (2026-11-26, load ~4:
# 398 s wall, 271 s of kernel CPU, 0 cells raised); 11 (a long training run) has not been run
# emulated yet.
# Figures go to a temporary folder (GPTBOOK_FIGURES): the emulated run draws different noise,
# so writing figures/ would change the checkout's files.
DEFAULT = ["chapters/12a_architecture_training.ipynb"]
DEVICE_ERROR = re.compile(r"same device|device type|Expected .*(cuda|cpu)|cuda:0|"
                          r"expected (scalar type|.*dtype)|dtype|BFloat16|Half")
# The emulated run trains shorter than the chapter: every training step takes the same device path
# (the ops and dtypes of lib.training.train at 20 and at 100 steps were recorded and are the same
# set), so 20 steps find what 100 find. For CI's budget: on a loaded 2-core machine (2026-11-26)
# the run took 639 s of kernel CPU at full length and 248-266 s shortened (each run still
# evaluates as often).
# {chapter stem: {exact line of a code cell: what replaces it}}; a line not found exactly once
# fails the run, so an edit of the chapter cannot switch the shortening off unnoticed.
SHORTER: dict[str, dict[str, str]] = {
    "12a_architecture_training": {"STEPS = env.pick(cpu=100, gpu=2000)": "STEPS = 20"},
}
# {chapter stem: {cell id: (the assert's line, the claim)}}: asserts about trained models that need
# the chapter's own training length (nbval checks them on the CPU); in a shortened run only, that
# line may raise its AssertionError (the traceback's arrow points at it), not a device or dtype one.
NEEDS_FULL_LENGTH: dict[str, dict[str, tuple[str, str]]] = {
    "12a_architecture_training": {
        "88127ce4": ('assert busiest.word == "clearly lower than", busiest',
                     "the busiest expert's load, balanced against free routing, over 5 seeds")},
}
ANSI = re.compile(r"\x1b\[[0-9;]*m")
# {chapter stem: {cell id: why the cell may raise here (e.g. an assert that needs the CPU random
# stream)}}; empty today. Excuses any error of that cell but a device or dtype one.
KNOWN: dict[str, dict[str, str]] = {}


def errors_of(nb) -> list[tuple[int, str, str, str, str]]:
    """(cell index, cell id, exception name, message, traceback) of every cell that raised."""
    found = []
    for index, cell in enumerate(nb.cells):
        for output in cell.get("outputs", []):
            if output.get("output_type") == "error":
                found.append((index, cell.get("id", "?"), output["ename"],
                              output["evalue"].splitlines()[0][:300] if output["evalue"]
                              else "", ANSI.sub("", "\n".join(output.get("traceback", [])))))
    return found


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def shorten(nb, stem: str) -> None:
    "Replace SHORTER's lines in the notebook's code cells; each must be found exactly once."
    for line, new in SHORTER.get(stem, {}).items():
        cells = [c for c in nb.cells if c.cell_type == "code" and line in c.source.splitlines()]
        if len(cells) != 1:
            raise SystemExit(f"{stem}: SHORTER's line {line!r} is in {len(cells)} code cells, "
                             "not one: update SHORTER in tools/fake_cuda_chapters.py")
        cells[0].source = "\n".join(new if text == line else text
                                    for text in cells[0].source.splitlines())


def run(path: Path, capability: str, timeout: int, full: bool = False
        ) -> tuple[float, float, list]:
    nb = nbformat.read(path, as_version=4)
    if not full:
        shorten(nb, path.stem)
    figures = tempfile.TemporaryDirectory(prefix="fake-cuda-figures-")
    env = fakecuda.subprocess_env(capability, GPTBOOK_FAKE_CUDA="1",
                                  PYTHONPATH=str(ROOT), GPTBOOK_FIGURES=figures.name)
    old = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)  # the kernel inherits this process's environment
    try:
        start, cpu = time.perf_counter(), _children_cpu()
        NotebookClient(nb, timeout=timeout, kernel_name="python3", allow_errors=True,
                       resources={"metadata": {"path": str(path.parent)}}).execute()
        seconds = time.perf_counter() - start
    finally:
        os.environ.clear()
        os.environ.update(old)
        figures.cleanup()
    return seconds, _children_cpu() - cpu, errors_of(nb)


def raised_at(traceback: str) -> str | None:
    "The code line IPython's traceback marks as the one that raised (its last '---->' line)."
    marked = re.findall(r"^-*> *\d+ (.*?)\s*$", traceback, re.M)
    return marked[-1].strip() if marked else None


def classify(stem: str, shortened: bool, error: tuple[str, str, str, str]
             ) -> tuple[str, bool]:
    """What one cell's error is, and whether it fails the run: a device or dtype error always
    does; KNOWN's cells, and NEEDS_FULL_LENGTH's asserts in a shortened run, are excused."""
    cell_id, ename, message, traceback = error
    claims = NEEDS_FULL_LENGTH.get(stem, {}) if shortened else {}
    if DEVICE_ERROR.search(f"{ename}: {message}"):
        return "DEVICE/DTYPE ERROR", True
    if cell_id in KNOWN.get(stem, {}):
        return f"known: {KNOWN[stem][cell_id]}", False
    if (cell_id in claims and ename == "AssertionError"
            and raised_at(traceback) == claims[cell_id][0]):
        return f"needs the full-length training: {claims[cell_id][1]}", False
    return "error", True


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("notebooks", nargs="*", default=DEFAULT)
    parser.add_argument("--capability", default="7.5", help="7.5 (T4, float32) or 8.0 (bf16)")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds per cell")
    parser.add_argument("--full", action="store_true",
                        help="train as long as the chapters do (no SHORTER lines)")
    args = parser.parse_args(argv)
    os.environ.setdefault("MPLBACKEND", "Agg")
    os.environ.setdefault("PYTHONHASHSEED", "0")
    try:
        fakecuda.build_shim()
    except fakecuda.ShimUnavailable as error:
        if fakecuda.in_ci():
            print(f"fake CUDA must run in CI: {error}")
            return 1
        print(f"skipped, fake CUDA unavailable: {error}")
        return 0
    failed = False
    for name in args.notebooks:
        path = (ROOT / name).resolve()
        seconds, cpu, errors = run(path, args.capability, args.timeout, args.full)
        length = "as written" if args.full or not SHORTER.get(path.stem) else "shortened"
        print(f"{name} ({length}): {seconds:.0f} s ({cpu:.0f} s of CPU in the kernel) on "
              f"fake CUDA {args.capability}, {len(errors)} cell(s) raised", flush=True)
        for index, cell_id, ename, message, traceback in errors:
            kind, fails = classify(path.stem, length == "shortened",
                                   (cell_id, ename, message, traceback))
            failed = failed or fails
            print(f"  {path.name}:cell {index} (id {cell_id}) {kind}: {ename}: {message}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
