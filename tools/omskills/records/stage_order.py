"""The order of an adaptation, declared once: the skill tools the built-in plan calls, each with its
stage and, for the steps run per graph, its column in the reports' stage table. The plan
(`omskills adapt`), the reports and `omskills validate` (the order the skills' text gives) read it
from here."""

from __future__ import annotations

from omskills.records.base import Record


class AdaptationStep(Record):
    tool: str  # the skill tool that runs the step
    stage: str  # the stage it belongs to, as the plan's progress shows it
    label: str  # what it does, in a few words
    column: str | None = None  # its column in the per-graph stage table (None: not a per-graph step)


def _steps(stage: str, *steps: tuple[str, str, str | None]) -> list[AdaptationStep]:
    return [AdaptationStep(tool=tool, stage=stage, label=label, column=column) for tool, label, column in steps]


ADAPTATION_STEPS: tuple[AdaptationStep, ...] = (
    *_steps(
        "1 inventory & plan",
        ("check_environment", "environment gate", None),
        ("inventory_entries", "static inventory of the model source", None),
        ("profile_main_path", "instrumented main-path run (profile + contracts)", None),
        ("plan_candidates", "rank candidates, choose the first batch", None),
    ),
    *_steps(
        "2 contracts & boundaries",
        ("capture_contracts", "contracts of the selected candidates", None),
        ("analyze_boundaries", "exportability and ATC shape strategy", None),
    ),
    *_steps(
        "3 ONNX -> OM",
        ("export_onnx", "export to ONNX", "export"),
        ("probe_onnx", "probe ONNX Runtime against PyTorch", "probe"),
        ("optimize_onnx", "onnxslim / auto_optimizer variants", "optimise"),
        ("emulate_precision", "ATC precision modes emulated on CPU, keep lists", "precision emulation"),
        ("check_precision_plan", "precision plan checked end to end (emulated), fixed if it fails", None),
        ("precheck_ops", "operator precheck and known precision pitfalls", "precheck"),
        ("convert_atc", "ATC command (run where CANN exists)", "ATC"),
    ),
    *_steps(
        "4 splice & verify",
        ("verify_main_path", "spliced vs PyTorch main path", "verify"),
        ("write_delivery_doc", "delivery document", None),
    ),
)

# The per-graph stage table's columns, in the plan's order.
STAGE_COLUMNS: tuple[str, ...] = tuple(step.column for step in ADAPTATION_STEPS if step.column is not None)
