import matplotlib.pyplot as plt
import pytest

from lib import plotting


@pytest.fixture()
def figdir(tmp_path, monkeypatch):
    monkeypatch.setattr(plotting, "FIGURES_DIR", tmp_path)
    return tmp_path


def test_save_figure_is_deterministic(figdir):
    plotting.use_style()
    paths = []
    for _ in range(2):
        fig, ax = plt.subplots()
        ax.plot([0, 1, 2], [1, 0, 1])
        assert plotting.save_figure(fig, "99-test") is None  # no path in a notebook's output
        paths.append(plotting.figure_path("99-test").read_bytes())
        plt.close(fig)
    assert paths[0] == paths[1]
    assert b"<svg" in paths[0]


def test_save_figure_png(figdir):
    fig, _ = plt.subplots()
    plotting.save_figure(fig, "99-test-png", fmt="png")
    assert plotting.figure_path("99-test-png", "png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    plt.close(fig)


@pytest.mark.parametrize("name", ["figure", "4-x", "04_x", "04-", "04-Upper", ""])
def test_save_figure_rejects_bad_names(figdir, name):
    fig, _ = plt.subplots()
    with pytest.raises(ValueError, match="name"):
        plotting.save_figure(fig, name)
    plt.close(fig)


def test_save_figure_rejects_bad_arguments(figdir):
    with pytest.raises(TypeError, match="fig"):
        plotting.save_figure("not a figure", "99-x")
    fig, _ = plt.subplots()
    with pytest.raises(ValueError, match="fmt"):
        plotting.save_figure(fig, "99-x", fmt="jpg")
    plt.close(fig)


def test_pipeline_figure_highlights_stages():
    for highlight in (None, "blocks", ["tokens", "embeddings"]):
        fig = plotting.pipeline_figure(highlight)
        texts = [t.get_text() for t in fig.axes[0].texts]
        assert all(stage in texts for stage in plotting.PIPELINE_STAGES)
        plt.close(fig)
    fig = plotting.pipeline_figure("blocks")
    colours = [p.get_facecolor() for p in fig.axes[0].patches if hasattr(p, "get_boxstyle")]
    assert len({c for c in colours}) == 2  # one highlighted, the rest muted
    plt.close(fig)


def test_pipeline_figure_rejects_unknown_stage():
    with pytest.raises(ValueError, match="highlight"):
        plotting.pipeline_figure("attention")


def test_markdown_table():
    table = plotting.markdown_table(["a", "b"], [[1, "x"], [2.5, "y"]])
    assert getattr(table, "data", table) == "| a | b |\n| --- | --- |\n| 1 | x |\n| 2.5 | y |"
    with pytest.raises(ValueError, match=r"one cell per header \(2\); rows \[0\] do not"):
        plotting.markdown_table(["a", "b"], [[1]])
    with pytest.raises(ValueError, match="headers"):
        plotting.markdown_table([], [])


def test_markdown_table_renders_a_pipe_in_a_cell():
    """A '|' inside a cell (p(<|im_end|>)) is escaped, so the table stays a table."""
    from markdown_it import MarkdownIt

    table = plotting.markdown_table(["token", "p(<|im_end|>)"], [["a|b", 0.5]])
    html = MarkdownIt("commonmark").enable("table").render(getattr(table, "data", table))
    assert html.count("<th>") == 2 and html.count("<td>") == 2
    assert "<th>p(&lt;|im_end|&gt;)</th>" in html and "<td>a|b</td>" in html


def test_size_rule_scales_with_figure_width():
    assert plotting.min_font_size(6.4) == plotting.READABLE_PT  # narrower than the page: shown as is
    assert plotting.min_font_size(2 * plotting.PAGE_WIDTH_IN) == 2 * plotting.READABLE_PT


def test_save_figure_makes_every_text_readable_at_page_width(figdir):
    plotting.use_style()
    fig, ax = plt.subplots(figsize=(12, 3))
    ax.plot([0, 1], [0, 1], label="line")
    ax.set(xlabel="x", ylabel="y", title="t")
    ax.legend(fontsize=6)
    ax.text(0.5, 0.5, "note", fontsize=5)
    plotting.save_figure(fig, "99-wide")
    floor = plotting.min_font_size(12)
    fig.canvas.draw()
    sizes = [t.get_fontsize() for t in fig.findobj(plt.Text) if t.get_text()]
    sizes += [t.get_fontsize() for t in ax.get_xticklabels() + ax.get_yticklabels()]
    assert min(sizes) >= floor > plotting.READABLE_PT
    plt.close(fig)


def test_pipeline_labels_are_readable_and_fit_their_boxes():
    fig = plotting.pipeline_figure("embeddings")
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    ax = fig.axes[0]
    assert fig.get_figwidth() <= plotting.PAGE_WIDTH_IN  # shown at its own size, not scaled down
    box = [p for p in ax.patches if hasattr(p, "get_boxstyle")][0]
    box_px = box.get_window_extent(renderer).width
    for text in ax.texts:
        assert text.get_fontsize() >= plotting.READABLE_PT
        if text.get_text() in plotting.PIPELINE_STAGES:
            assert text.get_window_extent(renderer).width < box_px, text.get_text()
    plt.close(fig)


def test_figures_folder_from_environment(tmp_path):
    """GPTBOOK_FIGURES sends a run's figures elsewhere (make devices keeps them out of figures/)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    code = ("import matplotlib.pyplot as plt; from lib import plotting; "
            "fig, _ = plt.subplots(); plotting.save_figure(fig, '99-elsewhere')")
    root = Path(plotting.__file__).resolve().parent.parent
    env = dict(os.environ, GPTBOOK_FIGURES=str(tmp_path), MPLBACKEND="Agg")
    subprocess.run([sys.executable, "-c", code], cwd=root, env=env, check=True)
    assert (tmp_path / "99-elsewhere.svg").exists()
    assert not (root / "figures" / "99-elsewhere.svg").exists()
