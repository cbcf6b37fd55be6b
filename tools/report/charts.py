"""Charts for reports, drawn with matplotlib's Agg canvas (no display, no global backend switch)."""

from __future__ import annotations

from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure


def bar_chart_compute_share(rows: list[tuple[str, float]], path: str | Path) -> Path:
    """Horizontal bars of compute share (0..1) per candidate, largest on top; writes a PNG."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    ordered = sorted(rows, key=lambda row: row[1])  # barh draws bottom-up: largest ends on top
    names = [name for name, _ in ordered]
    shares = [100.0 * share for _, share in ordered]
    figure = Figure(figsize=(7.5, 0.5 * len(ordered) + 1.4), dpi=110)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    bars = axes.barh(names, shares, color="#3b75af")
    axes.bar_label(bars, labels=[f"{s:.1f}%" for s in shares], padding=3, fontsize=9)
    # Leave room right of the longest bar for its label; small shares still get visible bars.
    axes.set_xlim(0, min(115.0, max([5.0] + [1.2 * s for s in shares])))
    axes.set_xlabel("share of main-path wall time (%)")
    axes.set_title("Compute share per candidate")
    axes.spines[["top", "right"]].set_visible(False)
    figure.tight_layout()
    figure.savefig(path, format="png")
    return path
