"""The benchmarks' pure helpers (the benchmarks themselves are scripts, run by hand)."""

from __future__ import annotations

from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture()
def watch(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import _adapt_watch

    return _adapt_watch


def test_stage_lines_of_the_plan_runner_are_parsed(watch):
    start = watch.parse_stage_line("[10/14] ATC precision modes emulated on CPU, keep lists: emulate_precision ...\n")
    assert (start.index, start.total, start.title, start.event, start.tool) == (
        10,
        14,
        "ATC precision modes emulated on CPU, keep lists",
        "start",
        "emulate_precision",
    )
    # A phase with colons of its own does not move the title's end.
    phase = watch.parse_stage_line(
        "[10/14] ATC precision modes emulated on CPU, keep lists: [   6.8 s] "
        "emulate_precision: vision_backbone: mode force_fp16"
    )
    assert (phase.title, phase.event, phase.phase) == (
        "ATC precision modes emulated on CPU, keep lists",
        "progress",
        "emulate_precision: vision_backbone: mode force_fp16",
    )
    end = watch.parse_stage_line("[3/14] instrumented main-path run (profile + contracts): ok in 43.9s")
    assert (end.title, end.event, end.call_seconds, end.ok) == (
        "instrumented main-path run (profile + contracts)",
        "end",
        43.9,
        True,
    )
    # The server's tqdm bar shares the stderr pipe and can run into the line.
    glued = watch.parse_stage_line(
        "propagate_in_video:  50%|#####     | 1/2 [00:02<00:02,  2.59s/it]"
        "[3/14] instrumented main-path run (profile + contracts): [  47.6 s] study run: 1 steps"
    )
    assert (glued.index, glued.title, glued.phase) == (
        3,
        "instrumented main-path run (profile + contracts)",
        "study run: 1 steps",
    )
    failed = watch.parse_stage_line(
        "[13/14] spliced vs PyTorch main path: FAILED in 0.0s — the tool server stopped: x: y"
    )
    assert (failed.index, failed.title, failed.event, failed.ok) == (13, "spliced vs PyTorch main path", "end", False)


@pytest.mark.parametrize(
    "line",
    [
        "[   6.8 s] study: frame 1/2",  # `omskills main-path` phase line: no [i/n]
        "[1/14] environment gate",  # no colon
        "[1/14] environment gate: something else",  # neither a start, a phase nor an end
        "INFO [1/2] loading: ok",
    ],
)
def test_other_lines_are_not_stage_lines(watch, line):
    assert watch.parse_stage_line(line) is None


def test_the_tracker_times_steps_and_names_the_current_one(watch):
    tracker = watch.ConsoleTracker()
    assert tracker.current() == watch.BEFORE_PLAN
    tracker.feed("[1/2] environment gate: check_environment ...")
    tracker.feed("[1/2] environment gate: [   0.4 s] probing")
    assert tracker.current() == "[1/2] environment gate"
    tracker.feed("[1/2] environment gate: ok in 0.5s")
    tracker.feed("[2/2] delivery document: write_delivery_doc ...")
    assert tracker.current() == "[2/2] delivery document"
    tracker.feed("[2/2] delivery document: ok in 0.1s")
    assert tracker.current() == watch.AFTER_PLAN
    first, second = tracker.stages
    assert (first.tool, first.call_seconds, first.ok) == ("check_environment", 0.5, True)
    assert first.started <= first.ended <= second.started <= second.ended


def test_short_command_drops_inline_code(watch):
    argv = [
        "/work/.venv/bin/python",
        "-c",
        "import sys; from omskills.orchestrator.cli import main; sys.exit(main())",
        "serve",
        "--workspace",
        "/tmp/run",
    ]
    assert watch.short_command(argv) == "python -c … serve --workspace /tmp/run"
    assert len(watch.short_command(["python", "x" * 500], width=60)) <= 60
