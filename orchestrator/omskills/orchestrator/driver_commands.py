"""`omskills drivers`, `omskills new-driver`, `omskills validate-driver`: adding a model, thin over the engine."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .command_table import command


@command("drivers", lambda p: None)
def _drivers(ns: argparse.Namespace) -> int:
    """List the installed model drivers (the omskills.drivers entry points)."""
    from omskills.models.registry import installed_drivers

    for listed in installed_drivers():
        what = listed.description if listed.error is None else f"cannot load: {listed.error}"
        print(f"{listed.family:24s} {listed.reference:48s} {what}  [{listed.origin}]")
    return 0


def _new_driver_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", help="driver name: lowercase letters, digits, underscores (e.g. resnet18)")
    p.add_argument(
        "--entry",
        required=True,
        help="what builds the model, as package.module:callable (e.g. torchvision.models:resnet18)",
    )
    p.add_argument(
        "--shape", default="1,3,224,224", help="shape of the random input run_main_path feeds (default 1,3,224,224)"
    )
    p.add_argument("--dir", default=".", help="where to write the driver file, task record and test (default: cwd)")


@command("new-driver", _new_driver_args)
def _new_driver(ns: argparse.Namespace) -> int:
    """Write a two-function driver, its task record and a test for an entry callable."""
    from omskills.errors import InputError
    from omskills.models.scaffold import new_driver

    try:
        shape = [int(d) for d in ns.shape.split(",")]
    except ValueError:
        raise InputError(f"--shape {ns.shape!r}: expected sizes separated by commas, e.g. 1,3,224,224") from None
    made = new_driver(ns.name, ns.entry, Path(ns.dir), shape)
    for path in (made.driver, made.task, made.test):
        print(f"wrote {path}")
    for step in made.next_steps:
        print(f"next: {step}")
    return 0


@command("validate-driver", lambda p: p.add_argument("task", help="task record (YAML) naming the driver"))
def _validate_driver(ns: argparse.Namespace) -> int:
    """Run a task's driver once at tiny size and report what is missing."""
    from omskills.records.task import load_record
    from omskills.stages.driver_check import check_driver

    load_record(Path(ns.task))  # a record that cannot be read names no driver to check: one line, exit 2
    report = check_driver(Path(ns.task))
    print(
        f"driver {report.driver} (family {report.family}): {report.steps} {report.step_name}(s), "
        f"{report.modules} modules, {report.parameters:,} parameters",
        file=sys.stderr,
    )
    for output in report.outputs:
        print(f"  output {output.name}: {output.dtype}{output.shape}", file=sys.stderr)
    if report.comparison:
        print(f"  compared by: {'; '.join(report.comparison)}", file=sys.stderr)
    for cand in report.candidates:
        verdict = "exportable" if cand.exportable else "not exportable"
        print(
            f"  candidate {cand.name} ({cand.module_path}): {cand.share:.1%} of the main path, {cand.calls} calls, "
            f"{cand.graphs} graph(s), {verdict}: {cand.reason}",
            file=sys.stderr,
        )
    for note in report.notes:
        print(f"  note: {note}", file=sys.stderr)
    for problem in report.problems:
        print(f"  problem: {problem}", file=sys.stderr)
    print("ok" if report.ok else f"FAILED: {len(report.problems)} problem(s)")
    return 0 if report.ok else 1
