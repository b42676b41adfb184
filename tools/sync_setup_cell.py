"""Write tools/setup_cell.py into the first code cell of chapter notebooks, changing nothing else.

Usage: python tools/sync_setup_cell.py [chapters/NN_x.ipynb ...]   (default: every chapter notebook)
Only that cell's source changes: its outputs, tags and execution count stay, and the notebook is not
re-executed (the cell prints nothing, so its stored output does not depend on its text).
"""
from __future__ import annotations

import sys
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parent.parent
SETUP_CELL = (ROOT / "tools" / "setup_cell.py").read_text().rstrip("\n")


def sync(path: Path) -> bool:
    """Replace the setup cell's source in ``path``; return True when the file changed."""
    nb = nbformat.read(path, as_version=4)
    first = next(c for c in nb.cells if c.cell_type == "code")
    if first.source == SETUP_CELL:
        return False
    first.source = SETUP_CELL
    nbformat.write(nb, path)
    return True


if __name__ == "__main__":
    paths = [Path(a) for a in sys.argv[1:]] or sorted((ROOT / "chapters").glob("*.ipynb"))
    for p in paths:
        print(f"{p}: {'updated' if sync(p) else 'already current'}")
