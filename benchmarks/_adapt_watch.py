"""Watching a running `omskills adapt` from outside: its console stage lines and the memory of
its whole process tree (the CLI, the MCP server and every child they start).

Used by `benchmarks/adapt_full.py`; nothing here reads the run folder.
"""

from __future__ import annotations

import csv
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Literal, TextIO

import psutil

GB = 1024**3
BEFORE_PLAN = "start-up (CLI, MCP server)"
AFTER_PLAN = "after the plan (summary, exit)"

# The plan runner's lines (omskills.orchestrator.plan_runner, ToolCallDisplay, on a stream that is not a
# terminal): "[i/n] <label>: <tool> ...", "[i/n] <label>: [  6.8 s] <phase>", "[i/n] <label>: ok in 8.6s"
# or "... FAILED in 3.0s — why". The label is matched lazily and the rest by its own shape, so a
# phase with colons in it does not move the split. Not anchored at the start: the MCP server shares
# the stderr pipe, and a tqdm bar of its (redrawn with "\r", no newline) can precede the line.
_STAGE_LINE = re.compile(
    r"\[(?P<index>\d+)/(?P<total>\d+)\] (?P<title>.+?): "
    r"(?:(?P<tool>[A-Za-z_][\w.-]*) \.\.\.$"
    r"|(?P<status>ok|FAILED) in (?P<seconds>\d+(?:\.\d+)?)s(?: — .*)?$"
    r"|\[\s*\d+(?:\.\d+)? s\] (?P<phase>.*)$)"
)


@dataclass(frozen=True)
class StageLine:
    """One console line of the plan runner."""

    index: int
    total: int
    title: str
    event: Literal["start", "progress", "end"]
    tool: str | None = None  # start lines name the tool
    call_seconds: float | None = None  # end lines: the tool call's seconds as the client measured them
    ok: bool | None = None
    phase: str | None = None


def parse_stage_line(line: str) -> StageLine | None:
    """The plan runner's stage line in `line`, or None for any other line."""
    match = _STAGE_LINE.search(line.rstrip("\r\n"))
    if match is None:
        return None
    index, total, title = int(match["index"]), int(match["total"]), match["title"]
    if match["tool"] is not None:
        return StageLine(index, total, title, "start", tool=match["tool"])
    if match["status"] is not None:
        return StageLine(index, total, title, "end", call_seconds=float(match["seconds"]), ok=match["status"] == "ok")
    return StageLine(index, total, title, "progress", phase=match["phase"])


@dataclass
class ConsoleStage:
    """A plan step as the console showed it; times in seconds since the launch."""

    index: int
    total: int
    title: str
    tool: str
    started: float
    ended: float | None = None
    call_seconds: float | None = None
    ok: bool | None = None

    @property
    def label(self) -> str:
        return f"[{self.index}/{self.total}] {self.title}"


@dataclass
class ConsoleTracker:
    """Follows the stage lines of the child's output; `current()` is read by the memory sampler."""

    launched: float = field(default_factory=time.perf_counter)
    stages: list[ConsoleStage] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def elapsed(self) -> float:
        return time.perf_counter() - self.launched

    def feed(self, line: str) -> None:
        parsed = parse_stage_line(line)
        if parsed is None or parsed.event == "progress":
            return
        now = self.elapsed()
        with self._lock:
            if parsed.event == "start":
                self.stages.append(ConsoleStage(parsed.index, parsed.total, parsed.title, parsed.tool or "?", now))
            elif self.stages and self.stages[-1].index == parsed.index and self.stages[-1].ended is None:
                last = self.stages[-1]
                last.ended, last.call_seconds, last.ok = now, parsed.call_seconds, parsed.ok

    def current(self) -> str:
        with self._lock:
            if not self.stages:
                return BEFORE_PLAN
            last = self.stages[-1]
            # The plan stops at its first failed step.
            finished = last.ended is not None and (last.index == last.total or last.ok is False)
            return AFTER_PLAN if finished else last.label


def tee(pipe: BinaryIO, out: TextIO, tracker: ConsoleTracker) -> None:
    """Copy the child's lines to `out` as they come (the user still sees the progress) and feed the tracker."""
    for raw in iter(pipe.readline, b""):
        line = raw.decode("utf-8", errors="replace")
        out.write(line)
        out.flush()
        tracker.feed(line)
    pipe.close()


@dataclass(frozen=True)
class MemorySample:
    seconds: float
    tree_bytes: int  # sum of the RSS of every process of the tree
    largest_bytes: int
    stage: str


@dataclass(frozen=True)
class MemoryPeak:
    seconds: float
    tree_gb: float
    largest_gb: float
    largest_command: str
    processes: int
    stage: str


def short_command(argv: list[str], width: int = 110) -> str:
    """A process's command line, readable: `python -c <code>` loses its code, long lines their middle."""
    if not argv:
        return "?"
    shown = [Path(argv[0]).name]
    rest = argv[1:]
    if len(rest) >= 2 and rest[0] == "-c":
        shown.append("-c …")
        rest = rest[2:]
    text = " ".join(shown + rest)
    return text if len(text) <= width else text[: width // 2 - 1] + " … " + text[-(width // 2 - 2) :]


class TreeSampler(threading.Thread):
    """Every `interval` seconds, the RSS of `pid` and all its descendants, until it exits."""

    def __init__(self, pid: int, tracker: ConsoleTracker, interval: float = 0.5) -> None:
        super().__init__(name="rss-sampler", daemon=True)
        self.root = psutil.Process(pid)
        self.tracker = tracker
        self.interval = interval
        self.samples: list[MemorySample] = []
        self.peak: MemoryPeak | None = None
        self._peak_bytes = -1
        self._halt = threading.Event()

    def stop(self) -> None:
        self._halt.set()

    def run(self) -> None:
        while not self._halt.is_set():
            try:
                members = [self.root, *self.root.children(recursive=True)]
            except psutil.NoSuchProcess:
                return
            self._sample(members)
            self._halt.wait(self.interval)

    def _sample(self, members: list[psutil.Process]) -> None:
        sizes: list[tuple[int, psutil.Process]] = []
        for proc in members:
            try:
                sizes.append((proc.memory_info().rss, proc))
            except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
                continue  # gone between the listing and the reading
        if not sizes:
            return
        tree = sum(rss for rss, _ in sizes)
        largest, largest_proc = max(sizes, key=lambda s: s[0])
        sample = MemorySample(self.tracker.elapsed(), tree, largest, self.tracker.current())
        self.samples.append(sample)
        if tree > self._peak_bytes:
            self._peak_bytes = tree
            try:
                command = short_command(largest_proc.cmdline())
            except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
                command = f"pid {largest_proc.pid} (exited)"
            self.peak = MemoryPeak(
                seconds=sample.seconds,
                tree_gb=tree / GB,
                largest_gb=largest / GB,
                largest_command=command,
                processes=len(sizes),
                stage=sample.stage,
            )


def write_memory_csv(samples: list[MemorySample], path: Path) -> None:
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["seconds", "tree_rss_gb", "largest_process_rss_gb", "stage"])
        for s in samples:
            writer.writerow([f"{s.seconds:.1f}", f"{s.tree_bytes / GB:.3f}", f"{s.largest_bytes / GB:.3f}", s.stage])


def plot_memory(samples: list[MemorySample], stages: list[ConsoleStage], path: Path, title: str) -> None:
    """Tree RSS over time, the largest process under it, a dotted line where each plan step began."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 3.6), dpi=110)
    times = [s.seconds for s in samples]
    ax.plot(times, [s.tree_bytes / GB for s in samples], label="process tree (sum of RSS)", color="tab:blue")
    ax.plot(times, [s.largest_bytes / GB for s in samples], label="largest process", color="tab:orange", lw=0.8)
    top = max((s.tree_bytes / GB for s in samples), default=1.0)
    span = max(times, default=1.0) or 1.0
    level, last = 0, None
    for stage in stages:
        ax.axvline(stage.started, color="grey", ls=":", lw=0.7)
        # Steps a few seconds long would print their numbers on top of each other: stagger them.
        level = (level + 1) % 4 if last is not None and stage.started - last < 0.02 * span else 0
        last = stage.started
        ax.text(
            stage.started,
            top * (1.02 + 0.075 * level),
            str(stage.index),
            fontsize=7,
            ha="center",
            va="bottom",
            color="grey",
            bbox={"facecolor": "white", "edgecolor": "none", "pad": 0.3},
        )
    ax.set_ylim(0, top * 1.32 + 0.01)
    ax.set_xlabel("seconds since launch (numbers: plan step started)")
    ax.set_ylabel("GB")
    ax.set_title(title, fontsize=9)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7, frameon=False)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
