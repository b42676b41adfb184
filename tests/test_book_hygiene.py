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
# Chapters split into section notebooks, listed under the chapter in _toc.yml (``sections:``).
SECTIONS = {"12_modern": ["12a_architecture_training", "12b_long_context_inference"]}
# The appendix: the TOC's last part, captioned "Appendix", after the twelve chapters.
APPENDIX = ["A1_real_weights", "A2_whole_model", "A3_real_model", "A4_post_training",
            "A5_evaluation", "A6_rl_verifiable_rewards"]


def _toc_files() -> list[str]:
    """Every file of the TOC's parts in reading order: each chapter, then its sections (nested)."""
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())

    def walk(entries: list[dict]) -> list[str]:
        return [f for e in entries for f in [e["file"], *walk(e.get("sections", []))]]

    return [f for part in toc["parts"] for f in walk(part["chapters"])]


def _expected_files() -> list[str]:
    chapters = [f"chapters/{stem}" for chapter in EXPECTED for stem in [chapter, *SECTIONS.get(chapter, [])]]
    return chapters + [f"chapters/{stem}" for stem in APPENDIX]


def _cells(path: Path) -> list[dict]:
    return json.loads(path.read_text())["cells"]


def _source(cell: dict) -> str:
    src = cell["source"]
    return "".join(src) if isinstance(src, list) else src


def test_toc_lists_all_twelve_chapters_in_order():
    """The twelve chapters in order, each followed by its section notebooks, and nothing else."""
    assert _toc_files() == _expected_files()


def test_appendix_is_the_last_part():
    last = yaml.safe_load((ROOT / "_toc.yml").read_text())["parts"][-1]
    assert last["caption"] == "Appendix"
    # Lettered A, B, ... in headings, the sidebar, figure and equation numbers (Fig. A.1, (A.1)):
    # sphinx-external-toc renumbers a numbered part with this style.
    assert last["numbered"] is True and last.get("style") == "alphaupper"
    assert [c["file"] for c in last["chapters"]] == [f"chapters/{stem}" for stem in APPENDIX]


def test_every_chapter_file_exists_once_and_is_in_toc():
    toc = set(_toc_files())
    for stem in [f.removeprefix("chapters/") for f in _expected_files()]:
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
    prefix = f"ch{path.name.split('_', 1)[0]}-"  # 05_rope -> ch05-, 12a_architecture_training -> ch12a-
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


# --- What a reader sees: no test plumbing, lines that fit, one style for references -------------
#
# Visibility in the HTML (myst-nb): tag `remove-cell` drops the whole cell, `remove-input` drops its
# code, `remove-output` drops its outputs. `hide-input`, `hide-output` and `hide-cell` only fold
# things behind a "Show code cell ..." toggle, so for these rules a folded cell counts as shown.

WIDTH = 88  # characters of monospace text the theme's code and output boxes hold without scrolling
PLUMBING_CALL = re.compile(r"(?<![\w.])(?:[A-Za-z_][\w.]*\.)?(glue|save_figure)\s*\(")
NBVAL_COMMENT = re.compile(r"NBVAL_[A-Z_]+")


def _tags(cell: dict) -> set[str]:
    return set(cell.get("metadata", {}).get("tags", []))


def _code_shown(cell: dict) -> bool:
    return not _tags(cell) & {"remove-cell", "remove-input"}


def _outputs_shown(cell: dict) -> bool:
    return not _tags(cell) & {"remove-cell", "remove-output"}


def _where(path: Path, index: int) -> str:
    """'04_attention.ipynb cell 21 (id 3ce9f3db)': the 0-based position among all cells, and the
    cell's id, which stays put when cells are inserted above it."""
    cell_id = _cells(path)[index].get("id") if path.suffix == ".ipynb" else None
    return f"{path.name} cell {index}" + (f" (id {cell_id})" if cell_id else "")


def _report(problems: list[str], header: str) -> None:
    if problems:
        pytest.fail(header + "\n  " + "\n  ".join(problems), pytrace=False)


def _shown_output_text(out: dict) -> str:
    """The plain text the page shows for one output ('' when it shows HTML, an image, Markdown...)."""
    if out.get("output_type") == "stream":
        text = out.get("text", "")
    elif out.get("output_type") in ("execute_result", "display_data"):
        data = out.get("data", {})
        if set(data) != {"text/plain"}:  # a richer format is shown instead, or a glue record
            return ""
        text = data["text/plain"]
    else:
        return ""
    return "".join(text) if isinstance(text, list) else text


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_no_nbval_comments(path: Path):
    """nbval is steered by cell tags (`nbval-ignore-output`, `nbval-skip`), never by comments that
    readers would see: move the marker into the cell's tags and keep any reason as a plain comment."""
    bad = [f"{_where(path, i)}: {m.group(0)}" for i, c in enumerate(_cells(path)) if c["cell_type"] == "code"
           for m in NBVAL_COMMENT.finditer(_source(c))]
    _report(bad, "NBVAL_* comment(s); use the cell tag nbval-ignore-output instead:")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_glue_and_save_figure_only_in_removed_cells(path: Path):
    """`glue(...)` and `save_figure(...)` are book-keeping, not what the chapter teaches. A cell that
    calls either must be one the HTML removes entirely: tagged `remove-cell`, or tagged both
    `remove-input` and `remove-output`. Keep the computation in a visible cell and put the glue and
    figure-saving calls in a `remove-cell` cell right after it."""
    bad = []
    for i, cell in enumerate(_cells(path)):
        if cell["cell_type"] != "code":
            continue
        tags = _tags(cell)
        if "remove-cell" in tags or {"remove-input", "remove-output"} <= tags:
            continue
        for n, line in enumerate(_source(cell).splitlines(), 1):
            m = PLUMBING_CALL.search(line.split("#", 1)[0])
            if m:
                bad.append(f"{_where(path, i)} line {n}: {line.strip()}")
    _report(bad, "glue/save_figure call in a cell the page shows (move it to a cell tagged remove-cell):")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_shown_code_lines_fit_the_page(path: Path):
    """Code the page shows (cells not tagged remove-cell/remove-input; folded cells count) has lines
    of at most 88 characters (WIDTH), the width of the theme's code box."""
    bad = []
    for i, cell in enumerate(_cells(path)):
        if cell["cell_type"] == "code" and _code_shown(cell):
            for n, line in enumerate(_source(cell).splitlines(), 1):
                if len(line) > WIDTH:
                    bad.append(f"{_where(path, i)} line {n} ({len(line)} chars): {line}")
    _report(bad, f"shown code lines longer than {WIDTH} characters:")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_shown_output_lines_fit_the_page(path: Path):
    """Text output the page shows (stream output, and plain-text results with no HTML/image/Markdown
    form; cells tagged remove-cell/remove-output exempt) has lines of at most 88 characters (WIDTH).
    Narrow the printout (fewer columns, shorter labels, torch/numpy linewidth) or wrap it."""
    bad = []
    for i, cell in enumerate(_cells(path)):
        if cell["cell_type"] != "code" or not _outputs_shown(cell):
            continue
        for out in cell.get("outputs", []):
            for line in _shown_output_text(out).splitlines():
                if len(line) > WIDTH:
                    bad.append(f"{_where(path, i)} output ({len(line)} chars): {line}")
    _report(bad, f"shown output lines longer than {WIDTH} characters:")


LISTING_CALL = re.compile(r"^show_source\(([\w.]+)\)\s*$")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_shown_listings_fit_the_page(path: Path):
    """Library listings (a cell whose last line is `show_source(obj)`) are shown as
    highlighted code, not plain text, so the output-width test above skips them; their
    lines must fit too. Checked on the listing stored in the notebook (the text the page
    shows); shorten the library code (the listing is `inspect.getsource`) and re-execute."""
    bad = []
    for i, cell in enumerate(_cells(path)):
        lines = _source(cell).strip().splitlines() if cell["cell_type"] == "code" else []
        match = LISTING_CALL.match(lines[-1]) if lines else None
        if not match or not _outputs_shown(cell):
            continue
        for out in cell.get("outputs", []):
            text = out.get("data", {}).get("text/plain", "")
            for line in ("".join(text) if isinstance(text, list) else text).splitlines():
                if len(line) > WIDTH:
                    bad.append(f"{_where(path, i)} show_source({match.group(1)}) "
                               f"({len(line)} chars): {line}")
    _report(bad, f"library listing lines longer than {WIDTH} characters:")


def _chapter_markdown(path: Path) -> list[tuple[int, str]]:
    """(cell index, text) of a chapter's markdown: the markdown cells of a notebook, or a .md file."""
    if path.suffix == ".md":
        return [(0, path.read_text())]
    return [(i, _source(c)) for i, c in enumerate(_cells(path)) if c["cell_type"] == "markdown"]


CHAPTER_FILES = sorted(p for p in CHAPTERS.iterdir() if p.suffix in (".ipynb", ".md"))


@pytest.mark.parametrize("path", CHAPTER_FILES, ids=lambda p: p.name)
def test_equation_references_are_not_in_parentheses(path: Path):
    """{eq}`label` already prints "(4.2)"; writing ({eq}`label`) shows "((4.2))"."""
    bad = [f"{_where(path, i)}: {line.strip()}" for i, text in _chapter_markdown(path)
           for line in text.splitlines() if re.search(r"\(\s*\{eq\}", line)]
    _report(bad, "doubled parentheses around {eq} references (drop the outer ones):")


HEADING = re.compile(r"^#{1,6}\s+\S.*$", re.M)


@pytest.mark.parametrize("path", CHAPTER_FILES, ids=lambda p: p.name)
def test_references_heading_before_bibliography(path: Path):
    """Every chapter notebook (and any .md chapter with a bibliography) has exactly one
    ```{bibliography} directive, and the last heading before it is "## References"."""
    markdown = _chapter_markdown(path)
    found = [(i, text.split("{bibliography}", 1)[0]) for i, text in markdown if "{bibliography}" in text]
    if not found:
        if path.suffix == ".ipynb":
            _report([f"{path.name}: no ```{{bibliography}} directive"], "missing bibliography:")
        return
    if len(found) > 1:
        _report([_where(path, i) for i, _ in found], "more than one bibliography directive:")
    i, before = found[0]
    text_before = "\n".join(t for j, t in markdown if j < i) + "\n" + before
    headings = [h.strip() for h in HEADING.findall(text_before)]
    last = headings[-1] if headings else None
    if last != "## References":
        _report([f"{_where(path, i)}: last heading before the directive is {last!r}"],
                "the bibliography directive needs a '## References' heading right before it:")


EXERCISE_ITEM = re.compile(r"^(\d+)[.)]\s")  # a top-level numbered list item
EXERCISE_BOLD = re.compile(r"\*\*Exercise\s+(\d+)\b")
SOLUTION_LABEL = re.compile(r"Solution to exercise\s+(\d+)", re.IGNORECASE)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_each_solution_sits_under_its_own_exercise(path: Path):
    """In the "## Exercises" section (up to the next "## " heading), every code cell tagged
    `hide-cell` is a solution (one cell per solution). Each must be immediately preceded by a
    markdown cell containing "Solution to exercise N" (e.g. "**Solution to exercise 3**"; the
    exercise's own text may share that cell), and N must be the number of the last exercise stated
    above it, so no solution is parked after later exercises. Exercises are numbered either as
    top-level list items ("3. **Title.** ...") or as "**Exercise 3: ...**" (when a chapter uses the
    bold form anywhere in the section, only that form counts); each N gets at most one solution."""
    cells = _cells(path)
    start = next((i for i, c in enumerate(cells) if c["cell_type"] == "markdown"
                  and re.search(r"^## Exercises\s*$", _source(c), re.M)), None)
    if start is None:
        return
    bold_style = any(EXERCISE_BOLD.search(_source(c)) for c in cells[start:] if c["cell_type"] == "markdown")
    problems, solved = [], set()
    last_exercise = None
    for i in range(start, len(cells)):
        cell, text = cells[i], _source(cells[i])
        if cell["cell_type"] == "markdown":
            lines = text.splitlines()
            if i > start and any(line.startswith("## ") for line in lines):
                lines = lines[: next(n for n, line in enumerate(lines) if line.startswith("## "))]
                end = True
            else:
                end = False
            for line in lines:
                if SOLUTION_LABEL.search(line):
                    continue
                m = EXERCISE_BOLD.search(line) if bold_style else EXERCISE_ITEM.match(line)
                if m:
                    last_exercise = int(m.group(1))
            if end:
                break
            continue
        if "hide-cell" not in _tags(cell):
            continue
        prev = cells[i - 1]
        label = SOLUTION_LABEL.findall(_source(prev)) if prev["cell_type"] == "markdown" else []
        first_line = text.splitlines()[0] if text else ""
        if not label:
            problems.append(f"{_where(path, i)}: solution has no 'Solution to exercise N' markdown cell "
                            f"right above it (exercise last stated: {last_exercise}; cell starts: {first_line})")
        elif int(label[-1]) != last_exercise:
            problems.append(f"{_where(path, i)}: labelled 'Solution to exercise {label[-1]}' but the last "
                            f"exercise stated above it is {last_exercise} (put it right under its exercise)")
        elif last_exercise in solved:
            problems.append(f"{_where(path, i)}: a second solution for exercise {last_exercise}")
        else:
            solved.add(last_exercise)
    _report(problems, "exercise solutions out of place:")


# A bare boolean verdict in printed output: a line that is only True/False (or tensor(True)), a
# bool after a label's colon or question mark ("rows sum to one: True", "changed? False"), or
# after `==` / `is`. Such a line is a claim nobody checks: it printed False under prose saying
# True once (issue 32). Not counted: `name=True` (reprs, keyword arguments), a dict's
# `'key': False` (the quote before the colon), a bool followed by more words ("True where ...",
# docstrings), and boolean tensors or lists (data, e.g. a causal mask).
BARE_BOOL = re.compile(r"^\s*(?:tensor\()?(?:True|False)\)?\s*$")
LABELLED_BOOL = re.compile(r"""(?<!['"])(?:[:?]|==|\bis)\s*(True|False)\s*(?:[;,.()]|$)""")


def verdict_lines(path: Path) -> list[tuple[int, str]]:
    """(cell index, line) for every stored output line of `path` that prints a boolean verdict:
    stdout and plain-text results, in every code cell (hidden ones too), and Markdown tables
    with a cell that is just True or False."""
    found = []
    for i, cell in enumerate(_cells(path)):
        for out in cell.get("outputs", []) if cell["cell_type"] == "code" else []:
            if out.get("output_type") == "stream" and out.get("name") != "stdout":
                continue
            for line in _shown_output_text(out).splitlines():
                if BARE_BOOL.match(line) or LABELLED_BOOL.search(line):
                    found.append((i, line))
            table = out.get("data", {}).get("text/markdown", "")
            for line in ("".join(table) if isinstance(table, list) else table).splitlines():
                if line.startswith("|") and any(BARE_BOOL.match(c) for c in line.split("|")[1:-1]):
                    found.append((i, line))
    return found


def test_verdict_pattern_catches_verdicts_and_spares_data():
    verdicts = ["True", "tensor(False)", "rows sum to one: True", "x == y: False (max 0.1)",
                "earlier outputs change? False", "LN(5x) == LN(x): True;  RMS: True",
                "tied head: True; 812 parameters", "a == b == True", "the mask is False."]
    data = ["    verbose: bool = False) -> None:", "GELU(approximate='none', fused=True)",
            "{'bias': False, 'n_heads': 4}", "rotate values = False: max change 0.00",
            "tensor([[ True, False],", "inputs: [True, False, False]", "    True where i may attend",
            "self.fused = True  # False: the formula", "causal=True  max abs diff 2.4e-07",
            "nothing here is False or True in a sentence about them"]
    assert [v for v in verdicts if not (BARE_BOOL.match(v) or LABELLED_BOOL.search(v))] == []
    assert [d for d in data if BARE_BOOL.match(d) or LABELLED_BOOL.search(d)] == []


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_no_printed_boolean_verdicts(path: Path):
    """A check the chapter makes is an `assert` (which can fail), not a printed True/False that
    nobody reads (issue 32). Print the numbers behind it if they teach something ("max |diff|
    2.4e-07"), and assert the verdict in the same cell."""
    bad = [f"{_where(path, i)} output: {line.strip()}" for i, line in verdict_lines(path)]
    _report(bad, "printed boolean verdicts (assert them instead; print the numbers if useful):")
