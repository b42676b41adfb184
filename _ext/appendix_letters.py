"""Letter the appendix: its pages are A, B, ... rather than chapters 13 and 14.

The appendix is a numbered part of the table of contents (``_toc.yml``, caption
"Appendix"), so Sphinx numbers its pages like the chapters before it. Right after Sphinx
assigns the section numbers, this extension swaps each appendix page's leading number for
a letter, in the table of contents and in the page's own headings. Figure and equation
numbers are assigned from the section numbers afterwards, so they follow: "Fig. A.1",
"(A.2)", section "B.3".
"""
from __future__ import annotations

import string
from typing import Any

from docutils import nodes
from sphinx import addnodes
from sphinx.environment.collectors.toctree import TocTreeCollector


def _appendix_docs(env: Any, caption: str) -> list[str]:
    """The documents of the numbered toctree captioned ``caption``, in order."""
    docs: list[str] = []
    for docname in env.numbered_toctrees:
        for toctree in env.get_doctree(docname).findall(addnodes.toctree):
            if toctree.get("caption") == caption and toctree.get("numbered"):
                docs += [ref for _title, ref in toctree["entries"] if ref in env.tocs]
    return docs


def _relabel(number: Any, old: int, letter: str) -> Any:
    """(13, 2) -> ('A', 2) when ``old`` is 13; anything else unchanged."""
    if isinstance(number, (tuple, list)) and number and number[0] == old:
        return type(number)([letter, *number[1:]])
    return number


def letter_appendix(env: Any, caption: str) -> None:
    """Replace the leading section number of every appendix page by a letter."""
    for index, docname in enumerate(_appendix_docs(env, caption)):
        secnums = env.toc_secnumbers.get(docname)
        if not secnums or not secnums.get(""):
            continue
        old, letter = secnums[""][0], string.ascii_uppercase[index]
        if not isinstance(old, int):
            continue  # lettered already
        env.toc_secnumbers[docname] = {k: _relabel(v, old, letter) for k, v in secnums.items()}
        for node in [*env.tocs[docname].findall(nodes.reference), env.titles.get(docname)]:
            if node is not None and node.get("secnumber"):
                node["secnumber"] = _relabel(node["secnumber"], old, letter)


def _install(app: Any) -> None:
    """Wrap section numbering (after every extension has patched it, e.g. the multi-toctree
    numbering jupyter-book uses) so that the appendix is lettered each time it runs."""
    numbering = TocTreeCollector.assign_section_numbers
    if getattr(numbering, "letters_appendix", False):
        return

    def assign_section_numbers(self: TocTreeCollector, env: Any) -> list[str]:
        changed = numbering(self, env)
        letter_appendix(env, app.config.appendix_caption)
        return changed

    assign_section_numbers.letters_appendix = True  # type: ignore[attr-defined]
    TocTreeCollector.assign_section_numbers = assign_section_numbers


def setup(app: Any) -> dict[str, Any]:
    app.add_config_value("appendix_caption", "Appendix", "env")
    app.connect("builder-inited", _install)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
