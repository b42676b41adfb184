"""The library listings a chapter shows are the library's current source.

Chapters show lib code with ``show_source(obj)``; the HTML shows the output stored in the notebook.
When lib changes, that stored listing silently goes stale until the chapter is re-executed (nbval
would catch it, but only after executing every notebook). This test compares each stored listing
with ``inspect.getsource`` of the same object now, in well under a second, and names the chapter to
re-execute (``make execute NB=...``).
"""
from __future__ import annotations

import importlib
import inspect
import json
import pkgutil
import re
from pathlib import Path

import pytest

import lib

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "chapters").glob("*.ipynb"))
CALL = re.compile(r"^show_source\(([\w.]+)\)\s*$")


def _namespace() -> dict:
    """Every lib module by its short name, and every public and private top-level name in them."""
    names: dict = {}
    modules = [importlib.import_module(f"lib.{m.name}") for m in pkgutil.iter_modules(lib.__path__)]
    for module in modules:
        for key, value in vars(module).items():
            if getattr(value, "__module__", None) == module.__name__:
                names.setdefault(key, value)
    for module in modules:
        names[module.__name__.rsplit(".", 1)[1]] = module
    return names


def _listings(path: Path) -> list[tuple[int, str, str]]:
    """(cell index, expression, stored text) for each cell whose last line is show_source(expr)."""
    found = []
    for index, cell in enumerate(json.loads(path.read_text())["cells"]):
        if cell["cell_type"] != "code":
            continue
        source = "".join(cell["source"]).strip().splitlines()
        match = CALL.match(source[-1]) if source else None
        if not match:
            continue
        texts = [out["data"]["text/plain"] for out in cell.get("outputs", [])
                 if "text/plain" in out.get("data", {})]
        stored = "".join(texts[0]) if texts else ""
        found.append((index, match.group(1), stored))
    return found


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_shown_library_source_is_current(path: Path):
    namespace = _namespace()
    stale = []
    for index, expr, stored in _listings(path):
        head, *rest = expr.split(".")
        assert head in namespace, f"{path.name} cell {index}: cannot resolve {expr!r} in lib"
        obj = namespace[head]
        for part in rest:
            obj = getattr(obj, part)
        if inspect.getsource(obj).rstrip() != stored.rstrip():
            stale.append(f"cell {index}: show_source({expr})")
    assert not stale, (f"{path.name} shows library source that has changed since it was executed; "
                       f"re-execute it (make execute NB=chapters/{path.name}):\n  " + "\n  ".join(stale))
