"""Helpers for writing chapter notebooks from Python (authoring only; the .ipynb is the source).

    from tools.new_chapter import notebook, md, code
    nb = notebook([md("# 04 · Attention"), code("x = 1"), code("...", tags=["hide-cell"])])
    nbformat.write(nb, "chapters/04_attention.ipynb")

``notebook`` puts the shared setup cell (tools/setup_cell.py) first, tagged ``remove-input``.
"""
from __future__ import annotations

from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

SETUP_CELL = (Path(__file__).parent / "setup_cell.py").read_text().rstrip("\n")


def md(text: str) -> nbformat.NotebookNode:
    """A markdown cell (MyST)."""
    return new_markdown_cell(text.strip("\n"))


def code(text: str, tags: list[str] | None = None) -> nbformat.NotebookNode:
    """A code cell, optionally tagged (remove-input, hide-cell, remove-output, ...)."""
    cell = new_code_cell(text.strip("\n"))
    if tags:
        cell.metadata["tags"] = list(tags)
    return cell


def notebook(cells: list[nbformat.NotebookNode]) -> nbformat.NotebookNode:
    """A chapter notebook: the shared setup cell, then ``cells``."""
    setup = code(SETUP_CELL, tags=["remove-input"])
    nb = new_notebook(cells=[setup, *cells])
    nb.metadata["kernelspec"] = {"display_name": "Python 3", "language": "python", "name": "python3"}
    nb.metadata["language_info"] = {"name": "python"}
    return nb
