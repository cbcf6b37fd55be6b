"""Charts for reports, drawn with matplotlib's Agg canvas (no display, no global backend switch)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Patch
from matplotlib.ticker import MaxNLocator
from omskills.records.verify import OutputCheck, VerifyReport

# Colours of the plan's groups in the compute-share chart; other statuses get GROUP_OTHER.
GROUP_COLOURS = {"first batch": "#3b75af", "deferred": "#f0a030", "excluded": "#999999", "failed": "#c03030"}
GROUP_OTHER = "#6a3d9a"


def plan_group(status: str, in_first_batch: bool) -> str:
    """The compute-share chart's group of a plan candidate."""
    if status in ("deferred", "excluded", "failed"):
        return status
    return "first batch" if in_first_batch else status


def bar_chart_compute_share(rows: list[tuple[str, float, str]], path: str | Path) -> Path:
    """Horizontal bars of compute share (0..1) per candidate, largest on top, coloured by group
    (see `plan_group`) with a legend; writes a PNG. Rows: (candidate, share, group)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    ordered = sorted(rows, key=lambda row: row[1])  # barh draws bottom-up: largest ends on top
    names = [name for name, _, _ in ordered]
    shares = [100.0 * share for _, share, _ in ordered]
    groups = [group for _, _, group in ordered]
    figure = Figure(figsize=(7.5, 0.5 * len(ordered) + 1.8), dpi=110)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    bars = axes.barh(names, shares, color=[GROUP_COLOURS.get(g, GROUP_OTHER) for g in groups])
    axes.bar_label(bars, labels=[f"{s:.1f}%" for s in shares], padding=3, fontsize=9)
    # Leave room right of the longest bar for its label; small shares still get visible bars.
    axes.set_xlim(0, min(115.0, max([5.0] + [1.2 * s for s in shares])))
    axes.set_xlabel("share of main-path wall time (%, inclusive, from the profile)")
    axes.set_title("Compute share per candidate")
    axes.spines[["top", "right"]].set_visible(False)
    present = list(dict.fromkeys(reversed(groups)))  # in the order they appear from the top
    axes.legend(
        handles=[Patch(color=GROUP_COLOURS.get(g, GROUP_OTHER), label=g) for g in present],
        loc="lower right",
        fontsize=8,
        title="plan",
        title_fontsize=8,
    )
    figure.tight_layout()
    figure.savefig(path, format="png")
    return path


def integer_ticks(axes: Axes, values: list[int]) -> None:
    """Ticks only at whole numbers on the x axis (steps are frames, images: never 0.5)."""
    if 0 < len(values) <= 12:
        axes.set_xticks(sorted(set(values)))
    else:
        axes.xaxis.set_major_locator(MaxNLocator(integer=True))


def checks_chart(report: VerifyReport, path: str | Path) -> Path:
    """Every check's figure per step against its gate: IoUs (linear, higher is better) and
    differences (log, lower is better) on panels of their own; then the latency per call of each
    spliced candidate, PyTorch against the backend that ran it. Each panel has a legend; writes a PNG."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure = Figure(figsize=(14, 3.9), dpi=90)
    FigureCanvasAgg(figure)
    overlap, difference, latency = figure.subplots(1, 3)
    _per_step_iou(overlap, report)
    _per_step_difference(difference, report)
    _latency(latency, report)
    figure.tight_layout()
    figure.savefig(path, format="png")
    return path


def _series(report: VerifyReport, metrics: tuple[str, ...]) -> list[tuple[OutputCheck, list[float | None]]]:
    """Each check of these metrics with its figure per step (None where a step has none)."""
    found = []
    for check in report.comparison:
        if check.metric not in metrics:
            continue
        values = [
            next((c.value for c in s.checks if c.output == check.output and c.metric == check.metric), None)
            for s in report.per_step
        ]
        if any(v is not None for v in values):
            found.append((check, values))
    return found


def _per_step_iou(axes: Axes, report: VerifyReport) -> None:
    steps = [s.index for s in report.per_step]
    for check, values in _series(report, ("iou",)):
        line = axes.plot(steps, [v if v is not None else 0.0 for v in values], marker="o", label=check.title)[0]
        axes.axhline(
            check.threshold,
            color=line.get_color(),
            linestyle="--",  # type: ignore[arg-type]
            label=f"{check.title}: gate {check.threshold}",
        )
    _finish(axes, report, steps, f"IoU per {report.step_name} (higher is better)", "no IoU check")


def _per_step_difference(axes: Axes, report: VerifyReport) -> None:
    steps = [s.index for s in report.per_step]
    zero = []
    for check, values in _series(report, ("tensor", "max_abs")):
        if not any(values):  # a log axis cannot show 0: named in the legend instead
            zero.append(check.title)
            continue
        line = axes.semilogy(steps, [max(v or 0.0, 1e-12) for v in values], marker=".", label=check.title)[0]
        if check.threshold is not None:
            axes.axhline(
                check.threshold, color=line.get_color(), linestyle="--", label=f"{check.title}: gate {check.threshold}"
            )
    if zero:  # an entry of the legend with no line
        axes.plot([], [], " ", label=f"exactly 0 on every {report.step_name}: {', '.join(zero)}")
    _finish(axes, report, steps, f"max abs difference per {report.step_name}", "no difference check")


def _finish(axes: Axes, report: VerifyReport, steps: list[int], title: str, empty: str) -> None:
    integer_ticks(axes, steps)
    axes.set(title=title, xlabel=report.step_name)
    if axes.get_legend_handles_labels()[0]:
        axes.legend(fontsize=7)
    else:
        axes.text(0.5, 0.5, empty, ha="center", transform=axes.transAxes)


def _latency(axes: Axes, report: VerifyReport) -> None:
    names = [c.name for c in report.candidates]
    x = np.arange(len(names))
    axes.bar(x - 0.2, [c.torch_ms_per_call or 0 for c in report.candidates], 0.4, label="PyTorch (profile)")
    axes.bar(x + 0.2, [c.backend_ms_per_call or 0 for c in report.candidates], 0.4, label=f"spliced ({report.backend})")
    axes.set_xticks(x, names, rotation=30, ha="right", fontsize=8)
    axes.set(title="latency per call (ms)")
    axes.legend(fontsize=8)
