"""The two commands a reader of any Jupyter Book knows, run the way a reader runs them: from the
repository's root, with the virtual environment's tools on PATH and without any variable the
Makefile sets.

- `jupyter-book build .` must succeed without a warning and serve MathJax from the build: every page
  with math loads it exactly once, from a file that exists. CI builds the book once (`make book`,
  the first step of .ci/run); these tests check what that build left in _build/html rather than
  build a second time, and they check that `make book` *is* the bare command plus strictness
  (warnings are errors, tools/check_build.py), so its passing means the bare command passes too.
  Without a build they skip (run `make book` first).
- `pytest --nbval <chapter>` must pass on a fresh copy of the repository (what `git clone` gives):
  pytest.ini and conftest.py supply what `make test` used to pass on its command line (sanitizer,
  kernel, matplotlib backend, hash seed, the data copies in ../shared). A small notebook in
  chapters/, written here with the outputs `make execute` would store, stands for the chapters (CI
  runs every chapter through `make test`): it starts with the chapters' setup cell and prints what
  each of those settings decides, so a setting the bare command lacks fails it, in seconds.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent  # the virtual environment a reader would have activated
READER_NOTEBOOK = "chapters/zz_reader_check.ipynb"
# What the Makefile exports (and what pytest, pytest-xdist and make put into a child's environment).
MAKEFILE_VARIABLES = ("MPLBACKEND", "PYTHONHASHSEED", "GPTBOOK_DATA", "TIKTOKEN_CACHE_DIR")
CHILD_PREFIXES = ("PYTEST_", "MAKE", "MFLAGS")


def reader_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in MAKEFILE_VARIABLES and not k.startswith(CHILD_PREFIXES)}
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    return env


def run(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=cwd, env=reader_env(), capture_output=True, text=True,
                          timeout=900)


@pytest.fixture(scope="module")
def fresh_copy(tmp_path_factory) -> Path:
    """The working tree's files as a clone would have them (tracked, plus new files not ignored:
    work in progress counts), in <tmp>/book, with <tmp>/shared the data copies when they exist."""
    work = tmp_path_factory.mktemp("reader")
    repo = work / "book"
    try:
        listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                                cwd=ROOT, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"needs a git checkout to know which files a clone has ({exc})")
    for name in filter(None, listed.split("\0")):
        source = ROOT / name
        if source.is_file():  # a tracked file deleted in the working tree is not copied
            (repo / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, repo / name)
    if (ROOT.parent / "shared").is_dir():
        (work / "shared").symlink_to(ROOT.parent / "shared")
    assert not (repo / "_build").exists() and not (repo / "_mathjax").exists()
    return repo


def test_reader_env_has_no_makefile_variables():
    env = reader_env()
    assert not set(MAKEFILE_VARIABLES) & set(env)
    assert env["PATH"].split(os.pathsep)[0] == str(BIN)


HTML = ROOT / "_build" / "html"
built = pytest.mark.skipif(not (HTML / "index.html").is_file(),
                           reason="no _build/html: run `make book` (CI's first step) first")
STRICTNESS = {"--warningiserror", "-W", "--nitpick", "-n", "--keep-going"}


def test_make_book_is_the_bare_build_plus_strictness():
    """`make book` runs `jupyter-book build .` with flags that only make it stricter, and nothing
    the build reads comes from the Makefile: notebooks are not executed (the committed outputs are
    shown), so the variables the Makefile exports cannot change what gets built."""
    recipe = re.search(r"^book:.*\n((?:\t.*\n)+)", (ROOT / "Makefile").read_text(), re.M).group(1)
    builds = [line.split() for line in recipe.splitlines() if "jupyter-book" in line]
    assert len(builds) == 1, recipe
    command, flags = builds[0][:3], builds[0][3:]
    assert command[0].endswith("jupyter-book") and command[1:] == ["build", "."], builds
    assert set(flags) <= STRICTNESS, f"make book passes more than strictness flags: {flags}"
    assert "--warningiserror" in flags or "-W" in flags
    assert "tools/check_build.py _build/html" in recipe
    config = yaml.safe_load((ROOT / "_config.yml").read_text())
    assert config["execute"]["execute_notebooks"] == "off"


@built
def test_built_book_serves_mathjax():
    """Every page: tests/test_book_build.py runs tools/check_build.py on the build. Here the
    chapter a reader opens first for equations, in detail."""
    # The chapter a reader opens first for equations: one MathJax script, and it is there to load.
    page = HTML / "chapters" / "04_attention.html"
    text = page.read_text(encoding="utf-8")
    assert 'class="math' in text
    (src,) = re.findall(r'<script[^>]*src="([^"]*mathjax[^"]*)"', text, re.I)
    served = (page.parent / src.split("?")[0]).resolve()
    assert served.is_file() and served.stat().st_size > 0, src
    assert served.is_relative_to(HTML.resolve()), src


def _reader_notebook() -> "nbformat.NotebookNode":
    """The chapters' setup cell, then one cell per setting, each with the output it must print."""
    nbformat = pytest.importorskip("nbformat")
    seeded = subprocess.run([sys.executable, "-c", "print(hash('gpt'))"], capture_output=True,
                            text=True, env={**os.environ, "PYTHONHASHSEED": "0"}, check=True).stdout
    checks = [  # (code, what it prints under make test's settings)
        ("import matplotlib\nprint(matplotlib.get_backend().lower())", "agg\n"),  # MPLBACKEND
        ("print(hash('gpt'))", seeded),                                            # PYTHONHASHSEED
        ("from lib.data import load_text\nprint(len(load_text(download=False)))",  # GPTBOOK_DATA
         "1115394\n"),
        ("from lib.tokenizers import tiktoken_encoding\n"                           # TIKTOKEN_CACHE_DIR
         "print(tiktoken_encoding('cl100k_base').encode('hello world'))", "[15339, 1917]\n"),
        ("print(object())", "<object object at 0x1>\n"),                          # the sanitizer
    ]
    setup = nbformat.v4.new_code_cell((ROOT / "tools" / "setup_cell.py").read_text().rstrip("\n"),
                                      execution_count=1)
    cells = [setup] + [nbformat.v4.new_code_cell(code, execution_count=n, outputs=[
        nbformat.v4.new_output("stream", name="stdout", text=text)])
        for n, (code, text) in enumerate(checks, start=2)]
    return nbformat.v4.new_notebook(cells=cells, metadata={"kernelspec": {
        "name": "python3", "display_name": "Python 3", "language": "python"}})


def test_bare_nbval_passes(fresh_copy):
    import nbformat

    nbformat.write(_reader_notebook(), fresh_copy / READER_NOTEBOOK)
    done = run(["pytest", "--nbval", READER_NOTEBOOK], fresh_copy)
    assert done.returncode == 0, (done.stdout + done.stderr)[-5000:]
    assert re.search(r"\b6 passed", done.stdout) and "failed" not in done.stdout
