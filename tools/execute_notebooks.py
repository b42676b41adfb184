"""Execute chapter notebooks in place with nbclient, so committed outputs match the code.

Usage: python tools/execute_notebooks.py chapters/01_tokens.ipynb [more.ipynb ...]
Each notebook runs with its own folder as the working directory, as nbval runs it.
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient


def execute(path: Path, timeout: int = 900) -> float:
    """Run one notebook top to bottom and write it back; return the seconds it took."""
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        cell.metadata.pop("execution", None)  # timings from an earlier run
    start = time.perf_counter()
    NotebookClient(nb, timeout=timeout, kernel_name="python3", record_timing=False,
                   resources={"metadata": {"path": str(path.parent)}}).execute()
    nbformat.write(nb, path)
    return time.perf_counter() - start


if __name__ == "__main__":
    # The kernels inherit this environment: the same settings as `make execute` and nbval
    # (conftest.py), so a direct call cannot store outputs nbval will not reproduce (an
    # inline figure under the default backend, a different set order).
    os.environ.setdefault("MPLBACKEND", "Agg")
    os.environ.setdefault("PYTHONHASHSEED", "0")
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    for arg in sys.argv[1:]:
        seconds = execute(Path(arg))
        print(f"{arg}: executed in {seconds:.1f} s")
