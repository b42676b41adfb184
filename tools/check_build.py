"""Check the built HTML book (run by `make book` after the build; exits non-zero on a problem).

Every page with math must load MathJax exactly once (others at most once), from a file that exists in the build (served offline),
no <script> may appear twice on a page, and no page may reference a script or stylesheet under _static/ that the build lacks.

Usage: python tools/check_build.py [_build/html]
"""
from __future__ import annotations

import re
import sys
from collections import Counter
from pathlib import Path
from urllib.parse import urlsplit

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = re.compile(r"<script\b[^>]*\bsrc=\"([^\"]+)\"", re.I)


def page_problems(page: Path, html_root: Path) -> list[str]:
    """What is wrong with one built page (empty list when nothing is)."""
    text = page.read_text(encoding="utf-8")
    name = page.relative_to(html_root).as_posix()
    sources = SCRIPT.findall(text)
    mathjax = [s for s in sources if "mathjax" in s.lower()]
    problems = []
    has_math = 'class="math' in text
    if len(mathjax) > 1 or (has_math and not mathjax):
        problems.append(f"{name}: {len(mathjax)} MathJax <script> tags (want exactly one on a page with "
                        f"math, at most one elsewhere): {mathjax[:5]}")
    inline = re.findall(r"<script\b[^>]*>[^<]+</script>", text)
    for block, n in Counter(inline).items():
        if n > 1:
            problems.append(f"{name}: the same <script> appears {n} times: {block[:80]}...")
    for src in sources:
        if "://" in src or src.startswith("//"):
            continue
        target = (page.parent / urlsplit(src).path).resolve()
        if not target.is_file():
            problems.append(f"{name}: <script src={src!r}> points at a file the build lacks")
    return problems


def check(html_root: Path) -> list[str]:
    pages = sorted(p for p in html_root.rglob("*.html") if "_static" not in p.parts)
    if not pages:
        return [f"no HTML pages under {html_root}"]
    return [problem for page in pages for problem in page_problems(page, html_root)]


def main(argv: list[str]) -> int:
    html_root = Path(argv[0]) if argv else ROOT / "_build" / "html"
    problems = check(html_root)
    for problem in problems:
        print(f"check_build: {problem}", file=sys.stderr)
    if not problems:
        print(f"check_build: {html_root} OK (MathJax loaded once per page with math)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
