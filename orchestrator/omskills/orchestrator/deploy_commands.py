"""`omskills bundle`, `omskills npu-check`: deploying a verified adaptation, thin over the engine."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, get_args

from omskills.errors import InputError
from omskills.records.literals import BundleArtifact

from .command_table import command

if TYPE_CHECKING:
    from omskills.records.results import BundleSummary


def _bundle_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("task", help="the run's task record (runs/<task>/task.yaml), verified")
    p.add_argument("--out", help="bundle folder (default: <run>/bundle); an earlier bundle there is replaced")
    p.add_argument(
        "--artifact",
        choices=get_args(BundleArtifact),
        default="auto",
        help=(
            "auto: the OMs ATC built; om: every graph's OM (each must have one); onnx: none. The ONNX files always come"
        ),
    )
    p.add_argument("--no-weights", action="store_true", help="do not copy the checkpoint (the loader must be given it)")
    p.add_argument(
        "--precompute",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="an input the deployment will meet (a field of intake.inputs, e.g. 'prompt=a red car'; the value "
        "read as JSON when it is JSON); repeatable. The main path runs once on each, and graphs whose inputs "
        "derive from user inputs and the model's constants alone (a text tower) carry their outputs, answered "
        "from memory when deployed; every other graph is named with why",
    )


@command("bundle", _bundle_args)
def _bundle(ns: argparse.Namespace) -> int:
    """Write a self-contained, movable deployment bundle of a verified adaptation."""
    from omskills.deploy.bundle import write_bundle

    summary = write_bundle(
        Path(ns.task),
        Path(ns.out) if ns.out else None,
        artifact=ns.artifact,
        weights=not ns.no_weights,
        precompute=[_input_set(given) for given in ns.precompute],
    )
    print(
        f"{len(summary.graphs)} graph(s), {summary.files} files, {summary.bytes / 1e6:.1f} MB; "
        f"OM for {summary.om_graphs or 'none'}",
        file=sys.stderr,
    )
    for name, why in summary.not_deployed.items():
        print(f"  {name} stays in PyTorch: {why}", file=sys.stderr)
    for what, hint in summary.required.items():
        print(f"  the loader must be given {what}= ({hint})", file=sys.stderr)
    _print_precomputed(summary, asked=bool(ns.precompute))
    print(summary.path)
    return 0


def _print_precomputed(summary: BundleSummary, asked: bool) -> None:
    """What --precompute stored, graph by graph, and why nothing of every other graph."""
    if asked and not summary.remembered:
        print("  --precompute: nothing computed ahead", file=sys.stderr)
    for graph, kept in summary.remembered.items():
        print(
            f"  {graph}: {kept.entries} call(s) computed ahead ({kept.path}, {kept.bytes:,} bytes), "
            "answered from memory",
            file=sys.stderr,
        )
    for graph, why in summary.not_remembered.items():
        print(f"  {graph}: nothing computed ahead: {why}", file=sys.stderr)


def _input_set(given: str) -> dict[str, object]:
    """'FIELD=VALUE' as one input set; VALUE read as JSON when it is JSON ('frames=2'), else as text."""
    field, sep, value = given.partition("=")
    if not sep or not field.strip():
        raise InputError(f"--precompute {given!r}: expected FIELD=VALUE (a field of intake.inputs)")
    try:
        parsed: object = json.loads(value)
    except json.JSONDecodeError:
        parsed = value
    return {field.strip(): parsed}


@command("npu-check", lambda p: p.add_argument("task", help="the run's task record, with every OM built (convert_atc)"))
def _npu_check(ns: argparse.Namespace) -> int:
    """On an Ascend host: verify on the OMs, run the bundle's example, write the figures the NPU produced."""
    from .npu_check import npu_check

    figures = npu_check(Path(ns.task))
    print(
        f"verify --backend om: {figures.verdict} ({figures.summary}); "
        f"example {figures.example.s_per_step:.3f} s per step, "
        f"outputs equal to verify's: {figures.example_matches_verify}",
        file=sys.stderr,
    )
    for name, backend in figures.backend_per_candidate.items():
        print(f"  {name}: {backend}", file=sys.stderr)
    print(Path(ns.task).resolve().parent / figures.figures_md)
    return 0 if figures.verdict == "pass" and figures.example_matches_verify else 1
