"""_ext/appendix_letters.py: the appendix pages are lettered A, B in headings, the table of
contents, figure and equation numbers, while the chapters keep their numbers. Built with
Sphinx on a four-page stand-in for the book (two chapters, two appendix pages) in seconds."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
PAGE = """Title {name}
================

See :numref:`fig-{name}` and :eq:`eq-{name}`.

Section {name}
----------------

.. figure:: x.svg
   :name: fig-{name}

   Caption {name}

.. math::
   :label: eq-{name}

   x = 1
"""
INDEX = """Book
====

.. toctree::
   :numbered:
   :caption: Chapters

   ch1
   ch2

.. toctree::
   :numbered:
   :caption: Appendix

   a1
   a2
"""


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("book")
    (src / "conf.py").write_text(
        f"import sys\nsys.path.insert(0, {str(ROOT / '_ext')!r})\n"
        "extensions = ['sphinx_multitoc_numbering', 'appendix_letters', 'sphinx.ext.mathjax']\n"
        "numfig = True\nnumfig_secnum_depth = 1\nmath_numfig = True\n")
    (src / "index.rst").write_text(INDEX)
    (src / "x.svg").write_text('<svg xmlns="http://www.w3.org/2000/svg" width="4" height="4"/>')
    for name in ("ch1", "ch2", "a1", "a2"):
        (src / f"{name}.rst").write_text(PAGE.format(name=name))
    out = src / "_build"
    subprocess.run([sys.executable, "-m", "sphinx", "-W", "-q", "-b", "html", str(src), str(out)],
                   check=True)
    return out


def _numbers(html: str) -> list[str]:
    return re.findall(r'<span class="section-number">([^<]*)</span>([^<]*)', html)


def test_appendix_pages_are_lettered_and_chapters_keep_numbers(built: Path):
    page = (built / "a2.html").read_text()
    assert ("B. ", "Title a2") in _numbers(page) and ("B.1. ", "Section a2") in _numbers(page)
    assert "Fig. B.1" in page and '<span class="eqno">(B.1)' in page
    every = {n + t for name in ("ch1", "ch2", "a1", "a2")
             for n, t in _numbers((built / f"{name}.html").read_text()) if t.startswith("Title")}
    assert every == {"1. Title ch1", "2. Title ch2", "A. Title a1", "B. Title a2"}
    chapter = (built / "ch2.html").read_text()
    assert "Fig. 2.1" in chapter and '<span class="eqno">(2.1)' in chapter
    assert ("A. ", "Title a1") in _numbers(chapter)  # the sidebar letters it on every page


def test_the_book_uses_the_extension_on_a_numbered_appendix():
    config = yaml.safe_load((ROOT / "_config.yml").read_text())
    assert config["sphinx"]["local_extensions"]["appendix_letters"] == "_ext/"
    last = yaml.safe_load((ROOT / "_toc.yml").read_text())["parts"][-1]
    assert last["caption"] == "Appendix" and last["numbered"] is True
