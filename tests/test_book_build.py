"""The HTML build's configuration: MathJax served once and offline, author-year reference lists.

The built pages themselves are checked by tools/check_build.py, which `make book` runs after every
build; the last test here runs it on _build/html when a build is present.
"""
import importlib.util
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
CONFIG = yaml.safe_load((ROOT / "_config.yml").read_text())
SPHINX = CONFIG["sphinx"]["config"]


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


fetch_mathjax = _load("fetch_mathjax", ROOT / "tools" / "fetch_mathjax.py")
check_build = _load("check_build", ROOT / "tools" / "check_build.py")
book_sphinx = _load("book_sphinx", ROOT / "_ext" / "book_sphinx.py")


def test_no_javascript_under_static():
    """jupyter-book 1.x adds a <script> tag for every .js file under _static/ to every page."""
    found = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "_static").rglob("*.js"))
    assert not found, f"move these out of _static/ (every page would load them): {found[:5]}"


def test_mathjax_path_points_at_the_served_copy():
    """mathjax_path (relative to _static/) reaches the entry point that fetch_mathjax unpacks into a
    folder which html_extra_path copies to the build root."""
    extra = SPHINX["html_extra_path"]
    dest = fetch_mathjax.DEST
    assert dest.parent.relative_to(ROOT).as_posix() in extra
    assert "_static" not in dest.relative_to(ROOT).parts
    served = Path("_static") / SPHINX["mathjax_path"]  # where the page's URL points, from the root
    expected = Path(dest.name) / fetch_mathjax.ENTRY
    assert Path(*[p for p in served.parts[2:]]) == expected and served.parts[:2] == ("_static", "..")


def test_fetch_mathjax_keeps_the_entry_point_and_its_runtime_files_only():
    assert fetch_mathjax.wanted("tex-mml-chtml.js")
    assert fetch_mathjax.wanted("input/tex/extensions/boldsymbol.js")
    assert fetch_mathjax.wanted("output/chtml/fonts/woff-v2/MathJax_Main-Regular.woff")
    assert not fetch_mathjax.wanted("tex-svg-full.js")
    assert not fetch_mathjax.wanted("output/svg/fonts/tex.js")


def _write_page(tmp_path: Path, scripts: str, math: bool = True) -> Path:
    (tmp_path / "mathjax").mkdir(exist_ok=True)
    (tmp_path / "mathjax" / "tex-mml-chtml.js").write_text("//")
    (tmp_path / "chapters").mkdir(exist_ok=True)
    page = tmp_path / "chapters" / "x.html"
    body = '<span class="math notranslate">x</span>' if math else ""
    page.write_text(f"<html><head>{scripts}</head><body>{body}</body></html>")
    return page


def test_check_build_accepts_one_mathjax_and_flags_more_or_missing(tmp_path):
    one = '<script defer="defer" src="../_static/../mathjax/tex-mml-chtml.js?v=1"></script>'
    _write_page(tmp_path, one)
    assert check_build.check(tmp_path) == []
    _write_page(tmp_path, one + '<script src="../_static/mathjax/tex-chtml.js"></script>')
    problems = check_build.check(tmp_path)
    assert any("2 MathJax" in p for p in problems) and any("lacks" in p for p in problems)
    _write_page(tmp_path, "")
    assert any("0 MathJax" in p for p in check_build.check(tmp_path))
    _write_page(tmp_path, "", math=False)
    assert check_build.check(tmp_path) == []
    twice = "<script>const A = 1</script>" * 2
    _write_page(tmp_path, one + twice)
    assert any("appears 2 times" in p for p in check_build.check(tmp_path))


@pytest.mark.skipif(not (ROOT / "_build" / "html" / "index.html").exists(), reason="book not built")
def test_built_pages_pass_check_build():
    assert check_build.check(ROOT / "_build" / "html") == []


def _entry(key: str, authors: list[str], year: str = "2017"):
    from pybtex.database import Entry, Person

    return Entry("article", fields={"title": "T", "year": year},
                 persons={"author": [Person(a) for a in authors]}) if authors else \
        Entry("misc", fields={"title": "{GPT} report", "year": year})


def test_reference_list_labels_read_like_the_citations():
    label = book_sphinx.author_year_label
    assert label(_entry("a", ["Ashish Vaswani", "Noam Shazeer", "Niki Parmar"])) == "Vaswani et al., 2017"
    assert label(_entry("b", ["Diederik P. Kingma", "Jimmy Ba"], "2015")) == "Kingma and Ba, 2015"
    assert label(_entry("c", ["Rico Sennrich"], "2016")) == "Sennrich, 2016"
    assert label(_entry("d", ["Laurens van der Maaten", "Geoffrey Hinton"], "2008")) == \
        "van der Maaten and Hinton, 2008"
    assert label(_entry("e", [])) == "GPT report, 2017"
    # Like the in-text citations: "and others" counts as a name, so give two real authors first.
    assert label(_entry("h", ["Aaron Grattafiori", "Abhimanyu Dubey", "others"], "2024")) == \
        "Grattafiori et al., 2024"
    entries = [_entry("f", ["A. Radford", "J. Wu", "R. Child"], "2019"),
               _entry("g", ["A. Radford", "K. Narasimhan", "T. Salimans"], "2019")]
    labels = list(book_sphinx.AuthorYearLabelStyle().format_labels(entries))
    assert labels == ["Radford et al., 2019a", "Radford et al., 2019b"]
    # Labels are checked across pages: two works of references.bib with one label differ.
    from pybtex.database import parse_file
    bib = parse_file(str(ROOT / "references.bib")).entries
    three = [bib["liu2025muon"], bib["liu2025drgrpo"], bib["liu2025rethinking"]]
    labels = [next(book_sphinx.AuthorYearLabelStyle().format_labels([e])) for e in three]
    assert sorted(labels) == ["Liu et al., 2025a", "Liu et al., 2025b", "Liu et al., 2025c"]


def test_in_text_citations_carry_the_same_letter():
    """The patched year node of the in-text citations adds book_suffixes()'s letter."""
    from pybtex.database import parse_file
    from sphinxcontrib.bibtex.style import template

    book_sphinx._use_suffixed_year()
    bib = parse_file(str(ROOT / "references.bib")).entries
    year = lambda key: str(template.year.format_data({"entry": bib[key]}))  # noqa: E731
    assert [year(k) for k in ("liu2025muon", "liu2025rethinking", "liu2025drgrpo")] == \
        ["2025a", "2025b", "2025c"]
    assert year("vaswani2017attention") == "2017"


def test_config_uses_the_author_year_style():
    assert SPHINX["bibtex_reference_style"] == "author_year"
    assert SPHINX["bibtex_default_style"] == book_sphinx.STYLE_NAME
    assert CONFIG["sphinx"]["local_extensions"] == {"book_sphinx": "_ext/"}


def test_math_containers_do_not_clip_glyphs():
    """With the theme's overflow:auto on mjx-container, Chrome paints K^\\top as "K^|" (eq. 4.2);
    _static/book.css lets the equation overflow and scrolls the wrapping div.math instead."""
    css = (ROOT / "_static" / "book.css").read_text()
    rule = css[css.index("div.math mjx-container"):]
    assert "overflow: visible" in rule.split("}")[0]
    assert "overflow-x: auto" in css[css.index("div.math {"):].split("}")[0]


def test_bib_entries_with_others_name_two_authors_first():
    """sphinxcontrib-bibtex cites {A and others} as "A and others, 2024"; with two real authors
    before "others" the citation and the list both read "A et al., 2024"."""
    import re

    for authors in re.findall(r"author\s*=\s*\{(.*)\},", (ROOT / "references.bib").read_text()):
        names = [n.strip() for n in authors.split(" and ")]
        if names[-1] == "others":
            assert len(names) >= 3, f"give two authors before 'others': {authors}"


def _tarball(files: dict[str, str]) -> bytes:
    import io
    import tarfile

    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for name, text in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(text.encode())
            tar.addfile(info, io.BytesIO(text.encode()))
    return buffer.getvalue()


def test_fetch_mathjax_unpacks_once_and_falls_back_to_the_cdn(tmp_path, monkeypatch):
    dest = tmp_path / "_mathjax" / "mathjax"
    monkeypatch.setattr(fetch_mathjax, "cached_tarball", lambda: None)  # offline, nothing cached
    assert "CDN" in fetch_mathjax.ensure(dest)
    assert "cdn.jsdelivr.net" in (dest / fetch_mathjax.ENTRY).read_text()
    assert not list(dest.glob(".version-*"))  # so the next build tries to bundle it again
    package = _tarball({"package/es5/tex-mml-chtml.js": "// mathjax",
                        "package/es5/input/tex/extensions/ams.js": "// ams",
                        "package/es5/tex-svg-full.js": "// unused"})
    monkeypatch.setattr(fetch_mathjax, "cached_tarball", lambda: package)
    assert "unpacked" in fetch_mathjax.ensure(dest)
    assert (dest / fetch_mathjax.ENTRY).read_text() == "// mathjax"
    assert (dest / "input/tex/extensions/ams.js").is_file() and not (dest / "tex-svg-full.js").exists()
    assert sorted(p.name for p in dest.parent.iterdir()) == ["mathjax"]  # no staging folder left
    monkeypatch.setattr(fetch_mathjax, "cached_tarball", lambda: pytest.fail("fetched twice"))
    assert "already" in fetch_mathjax.ensure(dest)


def test_the_extension_fetches_mathjax_before_sphinx_checks_html_extra_path():
    """Sphinx warns about a missing html_extra_path entry from a config-inited handler at priority
    800; the book's extension fills _mathjax/ from an earlier one, so a plain build needs no make."""
    calls = []

    class App:
        def connect(self, event, handler, priority=500):
            calls.append((event, handler, priority))

    book_sphinx.setup(App())
    (fetch,) = [(h, p) for e, h, p in calls if e == "config-inited"]
    assert fetch[0] is book_sphinx._fetch_mathjax and fetch[1] < 800
