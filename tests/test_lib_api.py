"""docs/lib_api.md keeps step with lib: every module has a section, every public name of a module
(its ``__all__``, or the public functions, classes and constants it defines) is documented there,
and every name the page documents exists (methods and properties on their class). The page is
written by ``tools/lib_api.py``; run it after changing a public name."""
from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import lib_api  # noqa: E402

ENTRY = re.compile(r"^- `([A-Za-z_]\w*)")
MEMBER = re.compile(r"^  - `\.([A-Za-z_]\w*)")


def _sections() -> dict[str, list[str]]:
    """Lines of docs/lib_api.md under each '## lib.<module>' heading."""
    sections: dict[str, list[str]] = {}
    current = None
    for line in lib_api.DOC.read_text().splitlines():
        heading = re.match(r"^## lib\.(\w+)\s*$", line)
        if heading:
            current = sections.setdefault(heading.group(1), [])
        elif current is not None:
            current.append(line)
    return sections


def test_every_module_has_a_section_and_no_section_names_a_missing_module():
    assert sorted(_sections()) == lib_api.module_names()


@pytest.mark.parametrize("short", lib_api.module_names())
def test_public_names_and_documented_names_agree(short):
    module = importlib.import_module(f"lib.{short}")
    lines = _sections().get(short, [])
    documented = [m.group(1) for m in map(ENTRY.match, lines) if m]
    missing = [n for n in lib_api.public_names(module) if n not in documented]
    assert not missing, f"lib.{short}: public but not in docs/lib_api.md: {missing}"
    unknown = [n for n in documented if not hasattr(module, n)]
    assert not unknown, f"lib.{short}: documented but not in the module: {unknown}"
    owner = None
    for line in lines:
        entry, member = ENTRY.match(line), MEMBER.match(line)
        if entry:
            owner = getattr(module, entry.group(1))
        elif member:
            assert hasattr(owner, member.group(1)), f"lib.{short}: no {owner}.{member.group(1)}"


def test_public_names_exist():
    for short in lib_api.module_names():
        module = importlib.import_module(f"lib.{short}")
        for name in lib_api.public_names(module):
            assert hasattr(module, name), f"lib.{short}.__all__ names {name}, which is missing"


def test_the_page_is_what_the_tool_writes_now():
    """Docstrings and signatures too, not just names: run tools/lib_api.py after a change."""
    assert lib_api.DOC.read_text() == lib_api.render(), "docs/lib_api.md is stale: run tools/lib_api.py"
