"""The built book read in a real browser: headless Chromium, driven by Playwright for Python.

Every page of _build/html (which `make book`, CI's first step, writes) is served from a local HTTP
server and opened at a laptop width (1280 x 900) and a phone width (390 x 844). On each page:

- no console error, no uncaught script error, no failed request for a file of the book (its
  favicon included) and no request to another host (the book reads offline);
- every math element typeset by MathJax, and no raw TeX (``$...$``, ``\\[``, ``\\(``) left in the text;
- the page itself no wider than the window (long listings scroll inside their own boxes);
- at 1280 px, no code listing or printed output wider than its box (``scrollWidth > clientWidth``,
  measured in the page), except the blocks named in WIDE_BY_NATURE, and no display equation
  reaching outside its ``div.math`` box (the theme lays that box out right to left, so a wide
  equation opens scrolled to its end, its start hidden off the left until the reader scrolls);
- (once, at 1280 px) every internal link reaches a page or file of the build and, where it names
  an anchor, an element with that id; figure and equation references ({numref}, {eq}) among them;
  every image loads; each chapter's Colab launch link opens that chapter's own notebook.

And the search page finds the RoPE chapter for "rotary". One browser is shared by the whole
module; the book's crawl takes about half a minute.

Needs the `playwright` package (requirements-dev.txt) and a Chromium executable: Debian's
`chromium` package (.ci/run installs it) or the one named by GPTBOOK_CHROMIUM. Playwright's own
browser download (`playwright install`) is never used. Where either is missing the tests skip,
saying why, except in CI (CI=true), where they fail.
"""
from __future__ import annotations

import functools
import http.server
import json
import os
import re
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
HTML = ROOT / "_build" / "html"
IN_CI = os.environ.get("CI", "").lower() == "true"
WIDTHS = {"laptop": (1280, 900), "phone": (390, 844)}
# Chromium's flags for a quiet, offline, sandbox-free headless run (CI containers run as root).
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]
# Blocks allowed to be wider than their box at 1280 px because they are wide by nature (a table of
# numbers that wrapping would garble): "page stem:cell id" -> why. Each entry must still be wide
# (an entry that fits again is reported, so the list cannot rot).
WIDE_BY_NATURE: dict[str, str] = {
    "A4_post_training:4bbb556b output": "page D's 13-column DPO table: its bold headers hold "
                                        "words that cannot break (p(<|im_end|>), "
                                        "'(teacher-forced)'); it scrolls inside its box",
}
RAW_TEX = re.compile(r"\$[^$\s][^$\n]{0,200}?\$|\\\[|\\\(|\\begin\{")


def _chromium() -> str | None:
    named = os.environ.get("GPTBOOK_CHROMIUM")
    if named:
        return named if Path(named).is_file() else None
    return shutil.which("chromium") or shutil.which("chromium-browser")


def _unavailable(why: str):
    """Fail in CI (where .ci/run installs the browser), skip with the reason elsewhere."""
    if IN_CI:
        pytest.fail(f"CI=true but {why}")
    pytest.skip(why)


@pytest.fixture(scope="module")
def browser():
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _unavailable("the playwright package is not installed (pip install -r requirements-dev.txt)")
    executable = _chromium()
    if executable is None:
        _unavailable("no Chromium executable (apt-get install chromium, or set GPTBOOK_CHROMIUM)")
    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=executable, args=FLAGS)
        yield chromium
        chromium.close()


# --- serving a build --------------------------------------------------------------------------


class _Handler(http.server.SimpleHTTPRequestHandler):
    failures: list  # (path, status), set per server

    def log_message(self, fmt, *args):  # quiet; failed requests are recorded instead
        pass

    def send_error(self, code, message=None, explain=None):
        self.failures.append((self.path, code))
        super().send_error(code, message, explain)


@dataclass
class Server:
    root: Path
    failures: list = field(default_factory=list)

    def __enter__(self):
        handler = type("Handler", (_Handler,), {"failures": self.failures})
        self.httpd = http.server.ThreadingHTTPServer(
            ("127.0.0.1", 0), functools.partial(handler, directory=str(self.root)))
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        self.base = f"http://127.0.0.1:{self.httpd.server_port}/"
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


def built_pages(root: Path) -> list[str]:
    """Every HTML page of a build, relative to its root, less redirects (index.html)."""
    pages = []
    for path in sorted(root.rglob("*.html")):
        rel = path.relative_to(root)
        if rel.parts[0] in ("_static", "_sources", "_images"):
            continue
        if 'http-equiv="refresh"' in path.read_text(encoding="utf-8")[:1000].lower():
            continue
        pages.append(rel.as_posix())
    return pages


# --- measuring one page -----------------------------------------------------------------------

# Run in the page after it loads: waits for MathJax's first typeset and every image, then returns
# what the checks need. `cells` are the notebook cells the page shows, in order (div.cell).
MEASURE = """async (layout) => {
  if (window.MathJax && MathJax.startup && MathJax.startup.promise) await MathJax.startup.promise;
  const article = document.querySelector('article.bd-article') || document.body;
  const maths = [...article.querySelectorAll('.math')];
  const untypeset = maths.filter(m => !m.querySelector('mjx-container'))
                         .map(m => m.textContent.trim().slice(0, 60));
  const prose = article.cloneNode(true);
  prose.querySelectorAll('pre, code, script, style, textarea, .math, mjx-container')
       .forEach(e => e.remove());
  const out = {maths: maths.length, untypeset, prose: prose.textContent,
               pageOverflow: document.documentElement.scrollWidth - window.innerWidth};
  if (!layout) return out;
  const cells = [...article.querySelectorAll('div.cell')];
  const where = (e) => {
    const cell = e.closest('div.cell');
    const part = e.closest('.cell_input') ? 'input' : 'output';
    if (cell) return {cell: cells.indexOf(cell), part};
    const section = e.closest('section[id]');
    return {cell: -1, part: 'section ' + (section ? section.id : '?')};
  };
  const scrolls = (e) => ['auto', 'scroll'].includes(getComputedStyle(e).overflowX);
  out.blocks = [...article.querySelectorAll('pre, .cell_output *, table, .pst-scrollable-table-container')]
    .filter(e => e.tagName === 'PRE' || scrolls(e));
  out.wide = out.blocks.filter(e => e.scrollWidth > e.clientWidth).map(e => ({
    ...where(e), tag: e.tagName, scroll: e.scrollWidth, client: e.clientWidth,
    text: e.textContent.trim().slice(0, 50)}));
  out.blocks = out.blocks.length;
  // display maths that reach outside their div.math (the theme lays that box out right to left,
  // so a wide equation opens scrolled to its end, its start hidden off the box's left edge)
  const displays = [...article.querySelectorAll('mjx-container[display="true"]')];
  out.displays = displays.length;
  out.wideMath = displays.map(m => {
    const inner = m.getBoundingClientRect();
    const box = (m.closest('div.math') || m.parentElement).getBoundingClientRect();
    return {over: Math.round(Math.max(box.left - inner.left, inner.right - box.right)),
            inner: Math.round(inner.width), box: Math.round(box.width),
            where: where(m).part, text: (m.getAttribute('aria-label') || m.textContent).slice(0, 50)};
  }).filter(d => d.over > 1);
  out.articleOverflow = article.scrollWidth - article.clientWidth;
  out.ids = [...document.querySelectorAll('[id]')].map(e => e.id);
  out.links = [...document.querySelectorAll('a[href]')].map(a => ({
    href: a.href, text: a.textContent.trim().slice(0, 40),
    numref: !!a.querySelector('.std-numref') || a.getAttribute('href').includes('#equation-')}));
  for (const img of document.images) img.loading = 'eager';
  await Promise.all([...document.images].map(i => i.decode().catch(() => null)));
  out.images = [...document.images].map(i => ({src: i.currentSrc || i.src, width: i.naturalWidth}));
  out.colab = [...document.querySelectorAll('a[href*="colab.research.google.com"]')].map(a => a.href);
  return out;
}"""


@dataclass
class Crawl:
    """What a crawl of a build found: problems by kind, and counts that show the checks ran."""

    problems: dict[str, list[str]] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)
    wide: dict[str, str] = field(default_factory=dict)  # block name -> "scroll/client px"
    seconds: float = 0.0

    def add(self, kind: str, message: str) -> None:
        self.problems.setdefault(kind, []).append(message)

    def count(self, kind: str, n: int) -> None:
        self.counts[kind] = self.counts.get(kind, 0) + n


def shown_cell_ids(source: Path) -> list[str] | None:
    """Ids of a notebook's code cells that its page shows (div.cell order); None for Markdown pages."""
    if source.suffix != ".ipynb" or not source.is_file():
        return None
    cells = json.loads(source.read_text(encoding="utf-8"))["cells"]
    return [c.get("id", "?") for c in cells if c["cell_type"] == "code"
            and "remove-cell" not in c.get("metadata", {}).get("tags", [])]


def block_name(page: str, block: dict, cell_ids: list[str] | None) -> str:
    stem = Path(page).stem
    if block["cell"] < 0:
        return f"{stem}:{block['part']}"
    if cell_ids is not None and block["cell"] < len(cell_ids):
        return f"{stem}:{cell_ids[block['cell']]} {block['part']}"
    return f"{stem}:cell #{block['cell']} {block['part']}"


def crawl(browser, root: Path, source_root: Path | None = None,
          wide_by_nature: dict[str, str] | None = None) -> Crawl:
    """Open every page of the build under ``root`` at both widths and check it (see the module
    docstring). ``source_root`` holds the pages' sources (notebook cell ids name wide blocks)."""
    result, start = Crawl(), time.perf_counter()
    wide_by_nature = wide_by_nature or {}
    pages = built_pages(root)
    with Server(root) as server:
        base = server.base
        ids: dict[str, set[str]] = {}
        links: list[tuple[str, dict]] = []
        for width_name, (width, height) in WIDTHS.items():
            context = browser.new_context(viewport={"width": width, "height": height})
            page = context.new_page()
            events: list[tuple[str, str]] = []
            page.on("console", lambda m: events.append(("console error", m.text))
                    if m.type == "error" else None)
            page.on("pageerror", lambda e: events.append(("script error", str(e))))
            # (ERR_ABORTED: cut off by the next navigation, e.g. a favicon still loading; a file
            # the build lacks is caught by the server's own record of what it could not answer.)
            page.on("requestfailed", lambda r: events.append(("failed request",
                                                               f"{r.url} ({r.failure})"))
                    if r.url.startswith(base) and "ERR_ABORTED" not in (r.failure or "") else None)
            page.on("request", lambda r: events.append(("request to another host", r.url))
                    if not r.url.startswith((base, "data:", "blob:")) else None)
            for name in pages:
                events.clear()
                page.goto(base + name, wait_until="load")
                layout = width_name == "laptop"
                m = page.evaluate(MEASURE, layout)
                page.goto("about:blank")  # the page's late messages arrive before we read them
                where = f"{name} at {width}px"
                for kind, text in events:
                    result.add(kind, f"{where}: {text}")
                result.count("pages", 1)
                result.count("math elements", m["maths"])
                for tex in m["untypeset"]:
                    result.add("math not typeset", f"{where}: {tex!r}")
                for raw in RAW_TEX.findall(m["prose"]):
                    result.add("raw TeX in the text", f"{where}: {raw!r}")
                if m["pageOverflow"] > 0:
                    result.add("page scrolls sideways",
                               f"{where}: {m['pageOverflow']} px wider than the window")
                if not layout:
                    continue
                source = (source_root / name).with_suffix(".ipynb") if source_root else None
                cell_ids = shown_cell_ids(source) if source else None
                result.count("code and output blocks", m["blocks"])
                for block in m["wide"]:
                    label = block_name(name, block, cell_ids)
                    result.wide[label] = f"{block['scroll']}/{block['client']} px"
                    if label not in wide_by_nature:
                        result.add("wider than its box at 1280 px",
                                   f"{label} ({block['tag']}, {block['scroll']} px of content in "
                                   f"{block['client']} px): {block['text']!r}")
                result.count("display equations", m["displays"])
                for maths in m["wideMath"]:
                    result.add("wider than its box at 1280 px",
                               f"{name}: display maths in {maths['where']} ({maths['inner']} px in "
                               f"{maths['box']} px, {maths['over']} px outside): {maths['text']!r}")
                if m["articleOverflow"] > 0:
                    result.add("wider than its box at 1280 px",
                               f"{name}: the article itself overflows by {m['articleOverflow']} px")
                ids[name] = set(m["ids"])
                links += [(name, link) for link in m["links"]]
                for image in m["images"]:
                    result.count("images", 1)
                    if image["width"] == 0:
                        result.add("image does not load", f"{name}: {image['src']}")
                if name.startswith("chapters/") and source is not None and source.is_file():
                    check_colab(result, name, m["colab"])
            context.close()
        check_links(result, root, base, ids, links)
        for path, status in server.failures:
            result.add("failed request", f"{path} answered {status}")
    for label in wide_by_nature:
        if label not in result.wide:
            result.add("WIDE_BY_NATURE entry that fits now (drop it)", label)
    result.seconds = time.perf_counter() - start
    return result


def check_links(result: Crawl, root: Path, base: str, ids: dict[str, set[str]],
                links: list[tuple[str, dict]]) -> None:
    for page, link in links:
        if not link["href"].startswith(base):
            continue
        result.count("internal links", 1)
        result.count("figure and equation references", int(link["numref"]))
        parts = urlsplit(link["href"])
        target = unquote(parts.path[len(urlsplit(base).path):]) or "index.html"
        if target.endswith("/"):
            target += "index.html"
        if not (root / target).is_file():
            result.add("broken internal link", f"{page}: {link['text']!r} -> {target} (no such file)")
        elif parts.fragment and target in ids and unquote(parts.fragment) not in ids[target]:
            kind = "reference to a missing element" if link["numref"] else "broken internal link"
            result.add(kind, f"{page}: {link['text']!r} -> {target}#{parts.fragment} (no such id)")


def check_colab(result: Crawl, page: str, colab_links: list[str]) -> None:
    config = yaml.safe_load((ROOT / "_config.yml").read_text(encoding="utf-8"))
    repo = config["repository"]
    owner_name = urlsplit(repo["url"]).path.strip("/")
    expected = (f"{config['launch_buttons']['colab_url'].rstrip('/')}/github/{owner_name}/blob/"
                f"{repo.get('branch', 'main')}/{Path(page).with_suffix('.ipynb').as_posix()}")
    result.count("Colab links", len(colab_links))
    if colab_links != [expected]:
        result.add("Colab link", f"{page}: {colab_links} (want [{expected!r}])")


def report(problems: dict[str, list[str]]) -> str:
    lines = []
    for kind, messages in problems.items():
        if not messages:
            continue
        lines.append(f"{kind}: {len(messages)}")
        lines += [f"  {m}" for m in messages[:25]]
        if len(messages) > 25:
            lines.append(f"  ... and {len(messages) - 25} more")
    return "\n".join(lines)


# --- the tests --------------------------------------------------------------------------------


def test_the_built_book_in_a_browser(browser):
    """Every page at both widths: see the module docstring. One crawl, every problem reported."""
    if not (HTML / "intro.html").is_file():
        _unavailable("no _build/html: run `make book` (CI's first step) first")
    result = crawl(browser, HTML, source_root=ROOT, wide_by_nature=WIDE_BY_NATURE)
    print(f"browser crawl: {result.seconds:.1f} s, {result.counts}")
    assert not result.problems, "\n" + report(result.problems)
    # The checks ran over something: pages at both widths, math, listings, links, references.
    chapters = len(list((ROOT / "chapters").glob("*.ipynb")))
    # the build the crawl read has every chapter's page and the front page (from the sources,
    # not from the crawl's own list)
    expected = {"intro.html", *(f"chapters/{p.stem}.html" for p in (ROOT / "chapters").iterdir()
                                if p.suffix in (".ipynb", ".md"))}
    missing = expected - set(built_pages(HTML))
    assert not missing, sorted(missing)
    assert result.counts["Colab links"] == chapters
    for kind in ("math elements", "display equations", "code and output blocks", "internal links",
                 "figure and equation references", "images"):
        assert result.counts.get(kind, 0) > 0, f"no {kind} found: the page structure changed?"


def test_search_finds_the_rope_chapter(browser):
    if not (HTML / "search.html").is_file():
        _unavailable("no _build/html: run `make book` (CI's first step) first")
    with Server(HTML) as server:
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        page.goto(server.base + "search.html?q=rotary")
        page.wait_for_selector("#search-results ul.search li a", timeout=30_000)
        found = page.eval_on_selector_all("#search-results ul.search li a",
                                          "links => links.map(a => a.href)")
        page.close()
    assert any("chapters/05_rope.html" in href for href in found), found


def test_each_check_can_fail(browser, tmp_path):
    """A small site with one of each fault: the crawl must report every one of them."""
    long_line = "x = " + "1 + " * 24  # 100 characters
    assert len(long_line) == 100
    (tmp_path / "_static").mkdir()
    (tmp_path / "_static" / "favicon.svg").write_text(
        '<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 1 1"/>')
    head = '<head><link rel="icon" href="_static/favicon.svg"></head>'
    (tmp_path / "good.html").write_text(f'<html>{head}<body><article class="bd-article">'
                                        '<p id="here">fine</p></article></body></html>')
    (tmp_path / "bad.html").write_text(
        f'<html>{head}<body><article class="bd-article" style="width: 600px">'
        '<div class="cell"><div class="cell_input"><pre style="overflow: auto; width: 500px">'
        f'{long_line}</pre></div></div>'
        '<a href="missing.html">gone</a> <a href="good.html#nowhere">no anchor</a>'
        '<a class="reference internal" href="good.html#equation-x">(1.1)</a>'
        '<img src="_images/missing.png"> <p>left as typed: $x^2$</p>'
        '<span class="math">\\(y\\)</span>'
        '<img src="https://example.invalid/off-host.png">'
        '<div class="math" style="display: flex; flex-direction: row-reverse; width: 300px">'
        '<mjx-container display="true" aria-label="too wide" style="display: block; '
        'flex-shrink: 0; overflow: visible"><svg width="800" height="10"></svg></mjx-container>'
        '</div>'
        '<script>console.error("boom")</script><script>throw new Error("uncaught")</script>'
        '</article>'
        '<div style="width: 2000px">a page wider than any window</div></body></html>')
    result = crawl(browser, tmp_path, wide_by_nature={"good:cell #0 input": "stale"})
    kinds = set(result.problems)
    assert {"wider than its box at 1280 px", "broken internal link",
            "reference to a missing element", "image does not load", "console error",
            "failed request", "raw TeX in the text", "math not typeset", "page scrolls sideways",
            "WIDE_BY_NATURE entry that fits now (drop it)", "script error",
            "request to another host"} <= kinds, report(result.problems)
    assert any("bad:cell #0 input" in m for m in result.problems["wider than its box at 1280 px"])
    assert any("display maths" in m and "too wide" in m
               for m in result.problems["wider than its box at 1280 px"])
    assert any("missing.html" in m for m in result.problems["broken internal link"])
    assert any("good.html#nowhere" in m for m in result.problems["broken internal link"])
    good_only = {k: [m for m in v if m.startswith("good.html")] for k, v in result.problems.items()}
    assert not any(good_only.values()), report(good_only)
    # a chapter page whose launch button points elsewhere, or is missing
    colab = Crawl()
    check_colab(colab, "chapters/01_tokens.html", [])
    check_colab(colab, "chapters/01_tokens.html", ["https://colab.research.google.com/x.ipynb"])
    assert len(colab.problems.get("Colab link", [])) == 2
