"""`omskills fleet`: many adaptations at once on Ray (omskills.orchestrator.fleet)."""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from .command_table import command


def _fleet_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("records", nargs="*", help="task records (YAML) to adapt")
    p.add_argument(
        "--zoo", nargs="*", metavar="NAME", help="the checkout's zoo (examples/zoo): every model, or those named"
    )
    p.add_argument("--address", help="an existing Ray cluster (default: a local Ray instance for this run)")
    p.add_argument("--cpus", type=int, help="CPUs of the local Ray instance (default: the machine's); one per task")
    p.add_argument("--out", default="runs/fleet", help="parent of the run folders, on a path every worker reaches")
    p.add_argument("--scale", choices=["tiny", "full"], help="override intake.model.scale of every record")
    p.add_argument("--soc", nargs="+", default=[], help="adapt each record for these SoCs (the study shared)")
    p.add_argument(
        "--memory-gb",
        type=float,
        help="what a task asks Ray for when no run of it was measured (default: the driver's figure for "
        "the scale, or its model built and measured in a fresh process, with a margin)",
    )


@command("fleet", _fleet_args)
def _fleet(ns: argparse.Namespace) -> int:
    """Adapt many records at once as Ray tasks (local Ray, or a cluster with --address); a rerun resumes.
    Ctrl-C stops the tasks and still writes fleet.md and fleet.json, the unfinished marked interrupted."""
    from omskills.errors import InputError
    from omskills.host.toolkit import repo_root

    from .fleet import plan_adaptations, require_ray, run_fleet, write_report, zoo_records

    require_ray()  # says how to install Ray before any record is read
    records = [Path(r) for r in ns.records]
    if ns.zoo is not None:
        records += zoo_records(ns.zoo, repo_root() / "examples" / "zoo" / "index.yaml")
    if not records:
        raise InputError("name task records, or --zoo")
    out = Path(ns.out).resolve()
    if ns.memory_gb is not None and not (math.isfinite(ns.memory_gb) and ns.memory_gb > 0):
        raise InputError(f"--memory-gb: {ns.memory_gb} is not a positive number of GB")
    if ns.cpus is not None and ns.cpus < 1:
        raise InputError(f"--cpus: {ns.cpus}: a fleet runs one task per CPU, it needs at least 1")
    adaptations = plan_adaptations(records, out, ns.scale, ns.soc, ns.memory_gb)
    report = run_fleet(adaptations, address=ns.address, local_cpus=ns.cpus)
    data, table = write_report(report, out)
    print(table.read_text())
    print(f"omskills fleet: {data}", file=sys.stderr)
    if report.interrupted:
        return 130  # as the shell reports a command SIGINT ended
    return 0 if all(result.passed for result in report.results) else 1
