"""Settings shared by every pytest run in this repository (unit tests and nbval on the chapters),
so that `pytest --nbval chapters/` behaves like `make test` without the Makefile's variables.

nbval starts each notebook's kernel with this process's environment, so what is set here reaches the
chapters too.
"""
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent

# The committed outputs were made with matplotlib's Agg backend (`make execute`). In a Jupyter
# kernel without MPLBACKEND, ipykernel picks the inline backend, which also shows every open figure
# under its cell (what a reader running a chapter wants), an output the committed notebooks lack.
os.environ["MPLBACKEND"] = "Agg"
# Set and printed iteration order, as `make execute` ran the chapters (the Makefile exports it too).
os.environ["PYTHONHASHSEED"] = "0"

# Like the Makefile: use the data copies beside the checkout (../shared, on CI and offline machines)
# when they exist and the variables are unset; otherwise lib.data and tiktoken download and cache.
_SHARED = ROOT.parent / "shared"
if (_SHARED / "data" / "tinyshakespeare.txt").is_file():
    os.environ.setdefault("GPTBOOK_DATA", str(_SHARED / "data"))
if (_SHARED / "tiktoken_cache").is_dir():
    os.environ.setdefault("TIKTOKEN_CACHE_DIR", str(_SHARED / "tiktoken_cache"))
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def pytest_configure(config):
    """pytest.ini names the nbval sanitizer relative to the repository root; find it from any folder."""
    sanitize = getattr(config.option, "nbval_sanitize_with", None)
    if sanitize and not os.path.isabs(sanitize) and not os.path.exists(sanitize):
        config.option.nbval_sanitize_with = str(ROOT / sanitize)


_NOTEBOOK_SECONDS: dict[str, float] = {}


def pytest_runtest_logreport(report):
    """Add up each notebook's cell times (setup, call and teardown), for the summary below."""
    if str(report.nodeid).split("::")[0].endswith(".ipynb"):
        name = report.nodeid.split("::")[0]
        _NOTEBOOK_SECONDS[name] = _NOTEBOOK_SECONDS.get(name, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter):
    """Each notebook's seconds under nbval (kernel start and stop included), slowest first:
    where CI's 40-minute budget goes (the per-chapter budgets are in the chapter guide)."""
    if _NOTEBOOK_SECONDS:
        terminalreporter.section("seconds per notebook")
        for name, seconds in sorted(_NOTEBOOK_SECONDS.items(), key=lambda kv: -kv[1]):
            terminalreporter.write_line(f"{seconds:8.1f} s  {name}")
        terminalreporter.write_line(f"{sum(_NOTEBOOK_SECONDS.values()):8.1f} s  in all")
