"""`omskills main-path` and `omskills adapt`: the main jobs, thin over the engine."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .cli import command


def _main_path_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("task", help="task record (YAML)")
    p.add_argument("--scale", choices=["tiny", "full"], help="override intake.model.scale")
    p.add_argument("--frames", type=int, help="override intake.inputs.frames")
    p.add_argument("--out", help="output folder (default: runs/<task id>-<scale>/main_path)")


@command("main-path", _main_path_args)
def _main_path(ns: argparse.Namespace) -> int:
    """Run the text-prompted video main path once and write main_path.json, masks and overlays."""
    from omskills.errors import InputError
    from omskills.main_path import run_and_report
    from omskills.task_record import load_record

    task_path = Path(ns.task)
    record = load_record(task_path)
    if ns.scale:
        record.intake.model.scale = ns.scale
    if ns.frames is not None:
        if ns.frames < 1:
            raise InputError("--frames must be at least 1")
        record.intake.inputs.frames = ns.frames
    out = Path(ns.out) if ns.out else Path("runs") / f"{record.id}-{record.intake.model.scale}" / "main_path"
    report, _ = run_and_report(record, task_path.resolve().parent, out)
    print(f"{report.model_family} {report.scale} | weights: {report.weights} | {report.num_frames} frames "
          f"in {report.total_seconds:.1f} s ({report.seconds_per_frame:.2f} s/frame) | load {report.load_seconds:.1f} s "
          f"| peak RSS {report.peak_rss_mb / 1024:.2f} GB", file=sys.stderr)
    for line in report.verification:
        print(f"  verification: {line}", file=sys.stderr)
    for f in report.frames:
        print(f"  frame {f.frame}: ids {f.obj_ids} scores {[round(s, 3) for s in f.scores]} areas {f.mask_areas}", file=sys.stderr)
    print(f"  {len(report.portability_findings)} portability sites touched; outputs in {out}", file=sys.stderr)
    print(str(out / "main_path.json"))
    return 0
