"""Prose numbers are glued, not typed: a number a chapter's code computed must reach the text through glue.

The check is a heuristic. For each chapter notebook it collects every number the code cells show
(stream output, displayed results, glued values) that is not also a literal in some code cell's source
(a literal is an input the chapter chose, such as a base of 10_000 or 256 merges, which the reader
sees in the code; a shown number that no literal explains is a result), then reads the markdown cells and flags a number
typed there that equals one of them: either the same digits, or a computed non-integer rounded to the
precision the prose shows (``35`` for a measured ``35.3``, ``0.38`` for ``0.3838``). Typed numbers below
10 are not checked (counts like "two heads" and small shapes are everywhere and mostly definitions,
not results), nor years (1950-2030, which are citation dates far more often than results), nor
numbers that carry a unit suffix glued to them (``124M``, ``128k``, ``4x``), nor anything inside math,
inline code, roles (``{glue:text}``, ``{eq}``, ``{numref}``, ``{cite}``, ...), link targets, or
directive options.

A number that is a deliberate definition the prose states first and the code then uses (say, "a
context of 128") is still flagged when the code prints it: glue it from the code's value, so that
changing the code changes the text. ``ALLOWED`` lists the few exceptions, each with its reason.
"""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "chapters").glob("*.ipynb"))

# (notebook name, typed number as written) -> why it may stay typed. Keep this short.
ALLOWED: dict[tuple[str, str], str] = {}

NUMBER = re.compile(r"(?<![\w.,/-])(\d{1,3}(?:,\d{3})+|\d+)(\.\d+)?(?![\w%×°-]|\.\d|,\d)")
SCRUB = [
    re.compile(r"\$\$.*?\$\$", re.S),                        # display math
    re.compile(r"(?<!\\)\$[^$\n]+?(?<!\\)\$"),               # inline math
    re.compile(r"```.*?```", re.S),                          # fenced blocks and directives' bodies
    re.compile(r"\{[a-z:]+\}`[^`]*`"),                       # roles: {glue:text}`...`, {eq}`...`, {cite}`...`
    re.compile(r"`[^`\n]*`"),                                # inline code
    re.compile(r"\]\([^)]*\)"),                              # link targets
    re.compile(r"^\s*:[a-z_-]+:.*$", re.M),                  # directive options
    re.compile(r"<[^>\n]+>"),                                # HTML tags
    re.compile(r"\([a-z0-9-]+\)\s*$", re.M),                 # equation labels after $$ ... $$
]


def _source(cell: dict) -> str:
    src = cell["source"]
    return "".join(src) if isinstance(src, list) else src


def _output_texts(cell: dict) -> list[str]:
    texts = []
    for out in cell.get("outputs", []):
        if "text" in out:
            texts.append(_source({"source": out["text"]}))
        for mime, value in out.get("data", {}).items():
            if mime.endswith("text/plain") or mime == "text/markdown":
                texts.append(_source({"source": value}))
    return texts


def _code_literals(cells: list[dict]) -> set[float]:
    """Numbers written as literals in code sources: the chapter's chosen inputs, visible in its code."""
    found: set[float] = set()
    for cell in cells:
        if cell["cell_type"] == "code":
            for m in re.finditer(r"(?<![\w.])\d[\d_]*(?:\.\d+)?(?:e[-+]?\d+)?", _source(cell)):
                found.add(float(m.group(0).replace("_", "")))
    return found


def _computed_numbers(cells: list[dict]) -> set[float]:
    """Every number the code cells show or glue, as floats, less the literals typed in the code."""
    found: set[float] = set()
    for cell in cells:
        if cell["cell_type"] != "code":
            continue
        for text in _output_texts(cell):
            for m in re.finditer(r"-?\d[\d,]*(?:\.\d+)?(?:e[-+]?\d+)?", text):
                token = m.group(0).replace(",", "")
                try:
                    found.add(abs(float(token)))
                except ValueError:
                    continue
    return found


def _matches(typed: str, computed: set[float]) -> bool:
    """True when a typed number equals a computed one, or is one rounded to the typed precision."""
    value = float(typed.replace(",", ""))
    decimals = len(typed.split(".")[1]) if "." in typed else 0
    for v in computed:
        if v == value:
            return True
        if v != int(v) and math.isclose(round(v, decimals), value, rel_tol=0, abs_tol=1e-12):
            return True
    return False


def typed_computed_numbers(path: Path) -> list[tuple[int, str, str]]:
    """(cell index, number, context) for each number typed in prose that the code computed."""
    cells = json.loads(path.read_text())["cells"]
    literals = _code_literals(cells)
    computed = _computed_numbers(cells) - literals
    hits = []
    for index, cell in enumerate(cells):
        if cell["cell_type"] != "markdown":
            continue
        text = _source(cell)
        for pattern in SCRUB:
            text = pattern.sub(" ", text)
        for m in NUMBER.finditer(text):
            typed = m.group(0)
            value = float(typed.replace(",", ""))
            if value < 10 or (1950 <= value <= 2030 and "." not in typed and "," not in typed):
                continue
            if value in literals:  # an input the code states, not a result (not even a rounded one)
                continue
            if (path.name, typed) in ALLOWED or not _matches(typed, computed):
                continue
            start, end = max(0, m.start() - 40), min(len(text), m.end() + 40)
            hits.append((index, typed, " ".join(text[start:end].split())))
    return hits


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_prose_does_not_retype_computed_numbers(path: Path):
    hits = typed_computed_numbers(path)
    report = "\n".join(f"  cell {i}: {n!r} in '...{ctx}...'" for i, n, ctx in hits)
    assert not hits, (f"{path.name}: numbers typed in markdown that code cells computed; glue them "
                      f"({{glue:text}}) or, if truly a definition, add to ALLOWED with a reason:\n{report}")


def test_heuristic_catches_a_typed_result_and_ignores_glued_and_math(tmp_path: Path):
    nb = {"cells": [
        {"cell_type": "code", "source": "print(speedup)", "metadata": {},
         "outputs": [{"output_type": "stream", "name": "stdout", "text": "35.3 1115394\n"}]},
        {"cell_type": "code", "source": "lengths = [16, 12]\nprint(15.9, 12.2)", "metadata": {},
         "outputs": [{"output_type": "stream", "name": "stdout", "text": "15.9 12.2\n"}]},
        {"cell_type": "markdown", "metadata": {},
         "source": "Lengths 16 and 12 are inputs. About 35 times faster on 1,115,394 characters; {glue:text}`x:.1f` and $35$ and `35` "
                   "are fine, as are 124M, the year 2017 and small counts like 3."},
    ]}
    path = tmp_path / "99_demo.ipynb"
    path.write_text(json.dumps(nb))
    assert [n for _, n, _ in typed_computed_numbers(path)] == ["35", "1,115,394"]
