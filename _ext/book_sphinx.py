"""The book's small Sphinx extension (registered in _config.yml under sphinx.local_extensions).

1. Bibliography style ``book_author_year``: the reference lists show the same "Vaswani et al., 2017"
   labels that the author-year citations in the text show (pybtex's default alpha labels would show
   "[VSP+17]"), sorted by author, year and title. Works of references.bib that share a label get
   a letter (2025a, 2025b) in the lists and, through a patched ``year`` node, in the text.
2. No duplicate <script> tags: sphinx-thebe adds its inline configuration script once through the
   app and once through the builder's registry, and the page then declares ``THEBE_JS_URL`` twice,
   a JavaScript error in every page's console. Identical scripts are kept once.
3. MathJax served by the build: when a build starts, tools/fetch_mathjax.py puts MathJax into
   _mathjax/ (SHA-256 checked, cached, a CDN loader when offline), which _config.yml's
   html_extra_path copies into the built book. So a plain ``jupyter-book build .`` on a fresh clone
   and ``make book`` produce the same book.
"""
from __future__ import annotations

import importlib.util
from collections import Counter, defaultdict
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterable

from pybtex.plugin import register_plugin
from pybtex.style.formatting.unsrt import Style as UnsrtStyle
from pybtex.style.labels import BaseLabelStyle
from sphinx.util import logging

logger = logging.getLogger(__name__)

STYLE_NAME = "book_author_year"


def _surname(person: Any) -> str:
    """'van der Maaten' for Laurens van der Maaten; braces protecting case are dropped."""
    parts = [*person.prelast_names, *person.last_names]
    return " ".join(parts).replace("{", "").replace("}", "")


def author_year_label(entry: Any) -> str:
    """'Vaswani et al., 2017', 'Kingma and Ba, 2015', 'Sennrich, 2016': as the in-text citations read."""
    people = entry.persons.get("author") or entry.persons.get("editor") or []
    if not people:
        names = entry.fields.get("organization") or entry.fields.get("title") or entry.key
        names = str(names).replace("{", "").replace("}", "")
    elif len(people) == 1:
        names = _surname(people[0])
    elif len(people) == 2:
        names = f"{_surname(people[0])} and {_surname(people[1])}"
    else:
        names = f"{_surname(people[0])} et al."
    year = entry.fields.get("year", "n.d.")
    return f"{names}, {year}"


BIBFILE = Path(__file__).resolve().parent.parent / "references.bib"


@lru_cache(maxsize=1)
def book_suffixes() -> dict[str, str]:
    """Key -> letter for the works of references.bib that share a label with another one, in
    sorted order. sphinxcontrib-bibtex checks labels across all pages: two pages citing two
    different "Liu et al., 2025" would otherwise warn "duplicate label" (an error in `make book`)."""
    from pybtex.database import parse_file
    from pybtex.plugin import find_plugin

    entries = list(parse_file(str(BIBFILE)).entries.values())
    groups: defaultdict[str, list[str]] = defaultdict(list)
    for entry in find_plugin("pybtex.style.sorting", "author_year_title")().sort(entries):
        groups[author_year_label(entry)].append(entry.key.lower())
    return {key: "abcdefghijklmnopqrstuvwxyz"[i] for keys in groups.values() if len(keys) > 1
            for i, key in enumerate(keys)}


class AuthorYearLabelStyle(BaseLabelStyle):
    """Author-year labels; two works with the same label, in one list or anywhere in
    references.bib, get 2017a, 2017b (in sorted order)."""

    def format_labels(self, sorted_entries: Iterable[Any]):
        entries = list(sorted_entries)
        labels = [author_year_label(e) for e in entries]
        counts, seen = Counter(labels), Counter()
        for entry, label in zip(entries, labels):
            key = (entry.key or "").lower()
            if key in book_suffixes():
                yield label + book_suffixes()[key]
            elif counts[label] > 1:
                yield label + "abcdefghijklmnopqrstuvwxyz"[seen[label]]
                seen[label] += 1
            else:
                yield label


class AuthorYearStyle(UnsrtStyle):
    default_label_style = "book_author_year"
    default_sorting_style = "author_year_title"


def _dedupe_scripts(app, pagename, templatename, context, doctree) -> None:
    scripts = context.get("script_files")
    if not isinstance(scripts, list):
        return
    unique, seen = [], set()
    for js in scripts:
        attributes = getattr(js, "attributes", {})
        key = (getattr(js, "filename", js) or "", tuple(sorted(attributes.items())))
        if key not in seen:
            seen.add(key)
            unique.append(js)
    scripts[:] = unique


def _fetch_mathjax(app, config) -> None:
    """Before Sphinx checks html_extra_path (its own config-inited handlers run at priority 800)."""
    path = Path(__file__).resolve().parent.parent / "tools" / "fetch_mathjax.py"
    spec = importlib.util.spec_from_file_location("fetch_mathjax", path)
    fetch_mathjax = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fetch_mathjax)
    logger.info(f"[book_sphinx] {fetch_mathjax.ensure()}")


def _suffixed_year(children, data: dict[str, Any]):
    """sphinxcontrib-bibtex's ``year`` node for in-text citations, plus the letter that
    :func:`book_suffixes` gives the work, so "Liu et al., 2025b" reads the same in the text
    and in the reference list."""
    year = _PLAIN_YEAR(children, data)
    return year + book_suffixes().get((data["entry"].key or "").lower(), "")


def _use_suffixed_year() -> None:
    global _PLAIN_YEAR
    from sphinxcontrib.bibtex.style import template

    if template.year.f is not _suffixed_year:
        _PLAIN_YEAR = template.year.f
        template.year.f = _suffixed_year


_PLAIN_YEAR = None


def setup(app) -> dict[str, Any]:
    _use_suffixed_year()
    register_plugin("pybtex.style.labels", STYLE_NAME, AuthorYearLabelStyle)
    register_plugin("pybtex.style.formatting", STYLE_NAME, AuthorYearStyle)
    app.connect("config-inited", _fetch_mathjax, priority=100)
    app.connect("html-page-context", _dedupe_scripts)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
