"""One figure style for the whole book, ``save_figure``, and the pipeline diagram.

Every figure in ``figures/`` is written by a chapter through :func:`save_figure`; none is drawn by
hand. Files are deterministic (no timestamps, fixed SVG ids), so re-running a chapter rewrites
the same bytes on the same software. The environment variable ``GPTBOOK_FIGURES`` names another
folder to write to (``make devices`` runs chapters on emulated CUDA and keeps its figures out of
the checkout this way).
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Sequence

import matplotlib
import matplotlib.pyplot as plt
from matplotlib.figure import Figure
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

FIGURES_DIR = Path(os.environ.get("GPTBOOK_FIGURES")
                   or Path(__file__).resolve().parent.parent / "figures")

# A small, colour-blind-friendly palette (Okabe–Ito) used by every chapter.
PALETTE = ["#0072B2", "#E69F00", "#009E73", "#D55E00", "#CC79A7", "#56B4E9", "#F0E442", "#000000"]
HIGHLIGHT = "#D55E00"
MUTED = "#DDE3EA"

STYLE: dict[str, Any] = {
    "figure.figsize": (6.4, 3.6),
    "figure.dpi": 110,
    "savefig.dpi": 150,
    "savefig.bbox": "tight",
    "font.size": 10,
    "axes.titlesize": 11,
    "axes.labelsize": 10,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "axes.grid": True,
    "grid.alpha": 0.3,
    "axes.prop_cycle": matplotlib.cycler(color=PALETTE),
    "image.cmap": "viridis",
    "legend.frameon": False,
    "svg.hashsalt": "gpt-from-the-ground-up",  # stable element ids in SVG output
    "svg.fonttype": "path",
}

# One size rule for text in figures. The HTML page shows a figure at most PAGE_WIDTH_IN wide (the
# theme's text column, about 775 px); a wider figure is scaled down to that width, and its text with
# it. save_figure therefore raises every text in a figure (tick labels, axis labels, legends,
# annotations) to at least READABLE_PT as the reader sees it: READABLE_PT * width / PAGE_WIDTH_IN
# in the figure's own points when the figure is wider than the page.
PAGE_WIDTH_IN = 8.0
READABLE_PT = 9.5


def min_font_size(fig_width_in: float) -> float:
    """The smallest font size (in the figure's points) that reads as READABLE_PT on the page."""
    return READABLE_PT * max(1.0, fig_width_in / PAGE_WIDTH_IN)


def make_readable(fig: Figure) -> None:
    """Apply the size rule to ``fig`` in place: no text smaller than :func:`min_font_size`."""
    from matplotlib.text import Text

    floor = min_font_size(fig.get_figwidth())
    for ax in fig.axes:
        for axis, name in ((ax.xaxis, "x"), (ax.yaxis, "y")):
            labels = axis.get_ticklabels(which="both")
            size = labels[0].get_fontsize() if labels else plt.rcParams[f"{name}tick.labelsize"]
            if not isinstance(size, (int, float)) or size < floor:
                ax.tick_params(axis=name, which="both", labelsize=floor)
    for text in fig.findobj(Text):
        if text.get_text() and text.get_fontsize() < floor:
            text.set_fontsize(floor)


# chapter 01-99, a chapter's section such as 12a, or appendix A1-A9
_NAME = re.compile(r"^(?:[0-9]{2}[a-z]?|A[0-9])-[a-z0-9][a-z0-9-]*$")
_FORMATS = ("svg", "png")


def use_style() -> None:
    """Apply the book's figure style to matplotlib."""
    plt.rcParams.update(STYLE)


def save_figure(fig: Figure, name: str, fmt: str = "svg") -> None:
    """Write ``fig`` to ``figures/<name>.<fmt>`` (see :func:`figure_path`).

    ``name`` is ``NN-what`` where NN is the chapter number, e.g. ``"04-attention-heatmap"``; the
    chapter shows the file with a numbered ``{figure}`` directive. Text smaller than the book's size
    rule allows is enlarged first (:func:`make_readable`). The figure stays open so that
    Jupyter and Colab also display it under the cell. Nothing is returned, so a call at the end of a
    cell leaves no machine-specific path in the notebook's stored output.
    """
    if not isinstance(fig, Figure):
        raise TypeError(f"fig must be a matplotlib Figure, got {type(fig).__name__}")
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(f"name must look like 'NN-lowercase-words' (e.g. '04-attention', '12b-window' "
                         f"for a section, or 'A1-lora' in the appendix), got {name!r}")
    if fmt not in _FORMATS:
        raise ValueError(f"fmt must be one of {_FORMATS}, got {fmt!r}")
    make_readable(fig)
    FIGURES_DIR.mkdir(parents=True, exist_ok=True)
    metadata = {"Date": None} if fmt == "svg" else {"Software": None}
    fig.savefig(figure_path(name, fmt), format=fmt, metadata=metadata)


def figure_path(name: str, fmt: str = "svg") -> Path:
    """Where :func:`save_figure` writes the figure ``name``."""
    return FIGURES_DIR / f"{name}.{fmt}"


PIPELINE_STAGES: tuple[str, ...] = (
    "text",
    "tokens",
    "embeddings",
    "positions",
    "blocks",
    "projection",
    "softmax",
    "next token",
)

_STAGE_NOTES = {
    "text": '"To be, or"',
    "tokens": "ids",
    "embeddings": "vectors",
    "positions": "+ order",
    "blocks": "attention\n+ FFN  × L",
    "projection": "logits",
    "softmax": "probabilities",
    "next token": '" not"',
}


def pipeline_figure(highlight: str | Sequence[str] | None = None) -> Figure:
    """Draw text → tokens → embeddings → … → next token, with ``highlight`` stage(s) in colour.

    ``highlight`` is one stage name from :data:`PIPELINE_STAGES`, a sequence of them, or None.
    """
    if highlight is None:
        wanted: set[str] = set()
    elif isinstance(highlight, str):
        wanted = {highlight}
    else:
        wanted = set(highlight)
    unknown = wanted - set(PIPELINE_STAGES)
    if unknown:
        raise ValueError(f"highlight must name stages from {PIPELINE_STAGES}, got {sorted(unknown)}")

    n = len(PIPELINE_STAGES)
    fig, ax = plt.subplots(figsize=(PAGE_WIDTH_IN, 1.5))  # shown at its own size: no scaling
    ax.set_xlim(0, n)
    ax.set_ylim(0, 1)
    ax.axis("off")
    box_w, box_h = 0.94, 0.46
    for i, stage in enumerate(PIPELINE_STAGES):
        on = stage in wanted
        x0 = i + (1 - box_w) / 2
        box = FancyBboxPatch((x0, 0.36), box_w, box_h, boxstyle="round,pad=0.02,rounding_size=0.08",
                             facecolor=HIGHLIGHT if on else MUTED, edgecolor="none")
        ax.add_patch(box)
        ax.text(i + 0.5, 0.59, stage, ha="center", va="center", fontsize=READABLE_PT,
                color="white" if on else "#333333")
        ax.text(i + 0.5, 0.16, _STAGE_NOTES[stage], ha="center", va="center", fontsize=READABLE_PT,
                color=HIGHLIGHT if on else "#666666")
        if i < n - 1:
            ax.add_patch(FancyArrowPatch((x0 + box_w + 0.01, 0.59), (i + 1 + (1 - box_w) / 2 - 0.01, 0.59),
                                         arrowstyle="-|>", mutation_scale=10, color="#888888"))
    fig.tight_layout(pad=0.2)
    return fig


def _cell(value: Any) -> str:
    return str(value).replace("|", "\\|")  # a bare | would end the cell


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> Any:
    """A table for the book's pages: Markdown that Jupyter renders and the HTML build shows as a table."""
    bad = [i for i, row in enumerate(rows) if len(row) != len(headers)]
    if not headers or bad:
        raise ValueError(f"headers must name at least one column and every row must have one cell "
                         f"per header ({len(headers)}); rows {bad} do not")
    lines = [[_cell(x) for x in headers], ["---"] * len(headers),
             *[[_cell(x) for x in row] for row in rows]]
    text = "\n".join("| " + " | ".join(line) + " |" for line in lines)
    try:
        from IPython.display import Markdown
    except ImportError:  # pragma: no cover
        return text
    return Markdown(text)
