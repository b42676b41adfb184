"""Write docs/lib_api.md, the reference of lib's public names, from the library itself.

    .venv/bin/python tools/lib_api.py          # rewrite docs/lib_api.md
    .venv/bin/python tools/lib_api.py --check  # exit 1 if docs/lib_api.md is out of date

Each module gets a section: the first paragraph of its docstring, then every public name (its
``__all__``, or else every public function, class and UPPER_CASE constant defined in it) with its
call signature (annotations left out) and the first paragraph of its docstring; classes list their
public methods and properties the same way. tests/test_lib_api.py keeps the page and the library in
step.
"""
from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import lib  # noqa: E402

DOC = ROOT / "docs" / "lib_api.md"
HEADER = """# The `lib` API

The reference of every public name in `lib`, generated from the library's own docstrings by
`tools/lib_api.py` (run it after changing a public name; `tests/test_lib_api.py` fails while this
page and the library disagree). Shapes: B batch, T sequence, C = d_model, H heads, H_kv key/value
heads, D head_dim = C / H, V vocabulary size.
"""


def module_names() -> list[str]:
    """Every module of the lib package, in alphabetical order."""
    return sorted(m.name for m in pkgutil.iter_modules(lib.__path__))


def public_names(module) -> list[str]:
    """``module.__all__``, or the public functions, classes and UPPER_CASE constants it defines."""
    if hasattr(module, "__all__"):
        return list(module.__all__)
    tree = ast.parse(inspect.getsource(module))
    names = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.append(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names += [t.id for t in targets if isinstance(t, ast.Name) and t.id.isupper()]
    return [n for n in names if not n.startswith("_")]


def first_paragraph(obj) -> str:
    """The first paragraph of ``obj``'s docstring, on one line, Sphinx roles and double
    backticks turned into Markdown code."""
    doc = inspect.getdoc(obj) or ""
    text = " ".join(doc.split("\n\n")[0].split())
    text = re.sub(r":(?:func|class|meth|mod|data|attr|obj):`~?([^`]+)`", r"`\1`", text)
    return text.replace("``", "`")


def signature(obj) -> str:
    """``(a, b=1, *, c=None)``: parameter names and defaults, without annotations."""
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return ""
    parts, star = [], False
    for p in sig.parameters.values():
        if p.name == "self":
            continue
        if p.kind is p.VAR_POSITIONAL:
            parts.append(f"*{p.name}")
            star = True
            continue
        if p.kind is p.VAR_KEYWORD:
            parts.append(f"**{p.name}")
            continue
        if p.kind is p.KEYWORD_ONLY and not star:
            parts.append("*")
            star = True
        parts.append(p.name if p.default is p.empty else f"{p.name}={p.default!r}")
    return f"({', '.join(parts)})"


def members(cls) -> list[str]:
    """Lines for the public methods and properties ``cls`` itself defines."""
    lines = []
    for name, value in vars(cls).items():
        if name.startswith("_") or name in ("forward", "extra_repr"):
            continue
        if isinstance(value, property):
            lines.append(f"  - `.{name}`: {first_paragraph(value)}")
        elif isinstance(value, (classmethod, staticmethod)) or inspect.isfunction(value):
            func = getattr(cls, name)
            lines.append(f"  - `.{name}{signature(func)}`: {first_paragraph(func)}")
    return lines


def entry(module, name: str) -> list[str]:
    """The lines documenting ``module.name``."""
    obj = getattr(module, name)
    if inspect.isclass(obj):
        kind = "class"
        head = f"- `{name}{signature(obj)}` ({kind}): {first_paragraph(obj)}"
        return [head, *members(obj)]
    if callable(obj):
        return [f"- `{name}{signature(obj)}`: {first_paragraph(obj)}"]
    text = repr(obj)
    text = text if len(text) <= 60 else text[:57] + "..."
    return [f"- `{name}` = `{text}`"]


def render() -> str:
    """The whole page."""
    out = [HEADER]
    for short in module_names():
        module = importlib.import_module(f"lib.{short}")
        out += ["", f"## lib.{short}", "", first_paragraph(module), ""]
        for name in public_names(module):
            out += entry(module, name)
    # paths under the checkout print relative to it, so the page is the same in every clone
    return "\n".join(out).rstrip().replace(str(ROOT), "<repo>") + "\n"


def main() -> None:
    text = render()
    if "--check" in sys.argv[1:]:
        sys.exit(0 if DOC.read_text() == text else 1)
    DOC.write_text(text)
    print(f"wrote {DOC.relative_to(ROOT)} ({len(text.splitlines())} lines)")


if __name__ == "__main__":
    main()
