"""Prefix each chapter's citations and bibliography with its chapter (ch04-...).

sphinxcontrib-bibtex warns "duplicate citation" when two chapters each have a local bibliography
that lists the same paper. Giving every chapter its own key prefix (`:keyprefix: ch04-` on the
bibliography, `{cite}`ch04-vaswani2017attention`` in the text) keeps per-chapter reference lists
without that clash. Usage: python tools/prefix_citations.py chapters/*.ipynb (idempotent).
"""
import re
import sys
from pathlib import Path

import nbformat


CITE = re.compile(r"\{(cite(?::[a-z]+)?)\}`([^`]+)`")


def prefix_markdown(src: str, prefix: str) -> str:
    """Prefix every citation key in ``src`` and the bibliography directive with ``prefix``."""

    def repl(m: re.Match) -> str:
        keys = [k.strip() for k in m.group(2).split(",")]
        keys = [k if k.startswith(prefix) else prefix + k for k in keys]
        return f"{{{m.group(1)}}}`{','.join(keys)}`"

    new = CITE.sub(repl, src)
    if "```{bibliography}" in new and ":keyprefix:" not in new:
        new = new.replace("```{bibliography}\n", f"```{{bibliography}}\n:keyprefix: {prefix}\n", 1)
    return new


def main(paths: list[str]) -> None:
    for path in map(Path, paths):
        prefix = f"ch{path.name[:2]}-"
        nb = nbformat.read(path, as_version=4)
        changed = False
        for cell in nb.cells:
            if cell.cell_type == "markdown":
                new = prefix_markdown(cell.source, prefix)
                changed |= new != cell.source
                cell.source = new
        if changed:
            nbformat.write(nb, path)
            print("prefixed citations in", path)


if __name__ == "__main__":
    main(sys.argv[1:])
