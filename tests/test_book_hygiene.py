"""The book holds together: every chapter is in the TOC, setup cells match, figures exist and are generated."""
import json
import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
CHAPTERS = ROOT / "chapters"
SETUP_CELL = (ROOT / "tools" / "setup_cell.py").read_text().rstrip("\n")
NOTEBOOKS = sorted(CHAPTERS.glob("*.ipynb"))
EXPECTED = [
    "01_tokens", "02_embeddings", "03_positional_encoding", "04_attention", "05_rope",
    "06_multi_head_attention", "07_feed_forward", "08_transformer_block", "09_vocabulary_projection",
    "10_loss", "11_training", "12_modern",
]


def _toc_files() -> list[str]:
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    return [c["file"] for part in toc["parts"] for c in part["chapters"]]


def _cells(path: Path) -> list[dict]:
    return json.loads(path.read_text())["cells"]


def _source(cell: dict) -> str:
    src = cell["source"]
    return "".join(src) if isinstance(src, list) else src


def test_toc_lists_all_twelve_chapters_in_order():
    assert _toc_files() == [f"chapters/{stem}" for stem in EXPECTED]


def test_every_chapter_file_exists_once_and_is_in_toc():
    toc = set(_toc_files())
    for stem in EXPECTED:
        found = [p for p in CHAPTERS.glob(f"{stem}.*") if p.suffix in (".ipynb", ".md")]
        assert len(found) == 1, f"{stem}: expected exactly one .ipynb or .md, found {found}"
    for path in CHAPTERS.iterdir():
        if path.suffix in (".ipynb", ".md"):
            assert f"chapters/{path.stem}" in toc, f"{path.name} is not in _toc.yml"


def test_first_three_chapters_are_notebooks():
    for stem in EXPECTED[:3]:
        assert (CHAPTERS / f"{stem}.ipynb").exists()


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_setup_cell_is_first_identical_and_hidden(path: Path):
    first = next(c for c in _cells(path) if c["cell_type"] == "code")
    assert _source(first) == SETUP_CELL, f"{path.name}: setup cell differs from tools/setup_cell.py"
    assert "remove-input" in first.get("metadata", {}).get("tags", [])


def test_setup_cell_repository_matches_config():
    config = yaml.safe_load((ROOT / "_config.yml").read_text())
    url = re.search(r'REPO_URL = "([^"]+)"', SETUP_CELL).group(1)
    assert url == config["repository"]["url"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_was_executed_in_order(path: Path):
    counts = [c.get("execution_count") for c in _cells(path) if c["cell_type"] == "code"]
    assert all(isinstance(n, int) for n in counts), f"{path.name} has unexecuted code cells: run `make execute`"
    assert counts == list(range(1, len(counts) + 1)), f"{path.name} was not executed top to bottom in one run"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_no_errors_in_committed_outputs(path: Path):
    for cell in _cells(path):
        for out in cell.get("outputs", []):
            assert out.get("output_type") != "error", f"{path.name} has an error output"


def _referenced_figures() -> list[tuple[Path, str]]:
    refs = []
    pattern = re.compile(r"(?:\{figure\}|!\[[^\]]*\]\()\s*([^\s)]*figures/[^\s)]+)")
    sources = [(p, _source(c)) for p in NOTEBOOKS for c in _cells(p) if c["cell_type"] == "markdown"]
    sources += [(p, p.read_text()) for p in [ROOT / "intro.md", *CHAPTERS.glob("*.md")]]
    for path, text in sources:
        for ref in pattern.findall(text):
            refs.append((path, ref))
    return refs


def test_every_referenced_figure_exists():
    for path, ref in _referenced_figures():
        assert (path.parent / ref).resolve().exists(), f"{path.name} references missing {ref}"


def test_every_figure_file_is_written_by_a_notebook():
    code = "\n".join(_source(c) for p in NOTEBOOKS for c in _cells(p) if c["cell_type"] == "code")
    for fig in (ROOT / "figures").iterdir():
        if fig.name.startswith("."):
            continue
        assert f'"{fig.stem}"' in code or f"'{fig.stem}'" in code, (
            f"figures/{fig.name} is not written by any chapter (save_figure(..., '{fig.stem}'))")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_citations_use_the_chapter_key_prefix(path: Path):
    """Per-chapter bibliographies need per-chapter key prefixes (tools/prefix_citations.py)."""
    prefix = f"ch{path.name[:2]}-"
    text = "\n".join(_source(c) for c in _cells(path) if c["cell_type"] == "markdown")
    for keys in re.findall(r"\{cite(?::[a-z]+)?\}`([^`]+)`", text):
        for key in keys.split(","):
            assert key.strip().startswith(prefix), f"{path.name}: citation {key!r} lacks prefix {prefix}"
    if "{bibliography}" in text:
        assert f":keyprefix: {prefix}" in text, f"{path.name}: bibliography lacks ':keyprefix: {prefix}'"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_outputs_hold_no_machine_specific_paths(path: Path):
    """A stored output like PosixPath('/home/me/book/figures/x.svg') fails nbval on any other checkout."""
    for cell in _cells(path):
        for out in cell.get("outputs", []):
            text = json.dumps(out.get("data", {}).get("text/plain", "")) + json.dumps(out.get("text", ""))
            assert "PosixPath(" not in text and str(ROOT) not in text, (
                f"{path.name}: an output shows a local path (assign save_figure's result: `_ = save_figure(...)`)")
