"""Put MathJax 3 into _mathjax/mathjax so the built book renders math without a CDN.

Downloads the mathjax package from the npm registry once (SHA-256 verified, cached under
GPTBOOK_CACHE), and unpacks the one entry point the book uses (tex-mml-chtml.js) plus what it
loads at run time (TeX extensions, CommonHTML fonts, accessibility and menu parts). If the package
cannot be fetched (offline, nothing cached), it writes a small loader that takes MathJax from its
public CDN instead, so the build still succeeds and math renders wherever the reader is online.

The book's Sphinx extension (_ext/book_sphinx.py) calls :func:`ensure` when a build starts, so
`jupyter-book build .` and `make book` serve the same MathJax; run this file to fetch it by hand.

Not under _static/: jupyter-book adds a <script> tag for every .js file there to every page.
_config.yml copies _mathjax/ into the build root (html_extra_path) and points mathjax_path at it.
"""
from __future__ import annotations

import hashlib
import io
import os
import shutil
import sys
import tarfile
import tempfile
import urllib.request
from pathlib import Path

VERSION = "3.2.2"
URL = f"https://registry.npmjs.org/mathjax/-/mathjax-{VERSION}.tgz"
SHA256 = "1b9c0a1c44df864e915690558e72adb9cc5203360daefd385084ced3b6c64c09"
ROOT = Path(__file__).resolve().parent.parent
DEST = ROOT / "_mathjax" / "mathjax"
ENTRY = "tex-mml-chtml.js"
CDN_LOADER = f"""// MathJax could not be bundled when this book was built; load it from the CDN.
(function () {{
  var s = document.createElement("script");
  s.src = "https://cdn.jsdelivr.net/npm/mathjax@{VERSION}/es5/{ENTRY}";
  s.async = true;
  document.head.appendChild(s);
}})();
"""


def cached_tarball() -> bytes | None:
    cache = Path(os.environ.get("GPTBOOK_CACHE", Path.home() / ".cache" / "gpt-from-the-ground-up"))
    path = cache / f"mathjax-{VERSION}.tgz"
    if path.exists() and hashlib.sha256(path.read_bytes()).hexdigest() == SHA256:
        return path.read_bytes()
    try:
        data = urllib.request.urlopen(URL, timeout=60).read()
    except OSError as exc:
        print(f"fetch_mathjax: could not download {URL} ({exc})", file=sys.stderr)
        return None
    if hashlib.sha256(data).hexdigest() != SHA256:
        print(f"fetch_mathjax: {URL} failed its SHA-256 check; not using it", file=sys.stderr)
        return None
    cache.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".part")
    tmp.write_bytes(data)
    os.replace(tmp, path)
    return data


# What tex-mml-chtml.js may load at run time, below package/es5/ (the other entry points, the SVG
# output and the Node adaptors are never used by the book's pages).
RUNTIME_DIRS = ("input/", "output/chtml/", "output/chtml.js", "a11y/", "ui/", "sre/")


def wanted(relative: str) -> bool:
    """True for the files of package/es5/ the book serves."""
    return relative == ENTRY or relative.startswith(RUNTIME_DIRS)


def ensure(dest: Path = DEST) -> str:
    """Make ``dest`` hold MathJax (or the CDN loader when it cannot be fetched); say what was done.

    Idempotent and cheap once done: a marker file records the unpacked version. The files are
    unpacked into a sibling folder first and moved into place, so an interrupted run leaves no
    half-unpacked copy behind.
    """
    legacy = ROOT / "_static" / "mathjax"  # where older versions of this script unpacked it
    if legacy.exists():
        shutil.rmtree(legacy)
    if (dest / f".version-{VERSION}").exists():
        return f"MathJax {VERSION} already in {dest}"
    data = cached_tarball()
    dest.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".mathjax-", dir=dest.parent))
    try:
        if data is None:
            (staging / ENTRY).write_text(CDN_LOADER)
            message = f"MathJax could not be bundled; {dest / ENTRY} loads it from the CDN"
        else:
            with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
                for member in tar.getmembers():
                    relative = member.name.removeprefix("package/es5/")
                    if member.isfile() and member.name.startswith("package/es5/") and wanted(relative):
                        target = staging / relative
                        target.parent.mkdir(parents=True, exist_ok=True)
                        target.write_bytes(tar.extractfile(member).read())
            (staging / f".version-{VERSION}").touch()  # no marker for the CDN loader: retry next time
            message = f"MathJax {VERSION} unpacked into {dest}"
        if dest.exists():  # an older version, a CDN loader from an offline build
            shutil.rmtree(dest)
        staging.chmod(0o755)
        os.replace(staging, dest)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return message


def main() -> None:
    print(f"fetch_mathjax: {ensure()}")


if __name__ == "__main__":
    main()
