"""The steps of an adaptation, each declared once and completely.

A step's declaration says everything the rest of the engine needs to know of it: the skill tool
that runs it and the plan's stage it belongs to, its key in the record's `stages` (and so the
one word that names it in reports and messages), the record slots its results fill, whether it
runs once per graph and what a graph's failure in it means. The plan (`omskills adapt`), the
step runner's per-graph loop, `TaskRecord.missing_results`, the reports' stage table and
`omskills validate` (the order the skills' text gives) read it from here: a new per-graph step
is a declaration here, its stage function, its skill script and the report's cell detail.
"""

from __future__ import annotations

import shlex
from typing import Literal

from omskills.records.base import Record

# What a graph's failure in a per-graph step means for the rest of the batch:
# fail_graph: the graph is marked failed, the others go on;
# promote_inner: as fail_graph, and the candidates deferred inside it join the batch and take the step;
# advisory: the result only informs, so the failure is a decision and the graph's status stays.
FailurePolicy = Literal["fail_graph", "promote_inner", "advisory"]


class AdaptationStep(Record):
    tool: str  # the skill tool that runs the step
    stage: str  # the stage it belongs to, as the plan's progress shows it
    label: str  # what it does, in a few words
    # Its key in the record's `stages`: "<key>", or "<key>:<graph>[:<variant>]" for a per-graph
    # step. The same word heads its column in the reports' stage table. None: the tool records
    # no step of its own (it reads or checks what others wrote).
    key: str | None = None
    per_graph: bool = False
    in_stage_table: bool = False  # it has a column in the per-graph stage table
    # The record slots its results fill, as dotted paths with `{graph}` and `{variant}` filled in
    # from the step key: a step the record says is done whose slot is empty runs again.
    results: tuple[str, ...] = ()
    # A step run again on the same graph in another form (`verify:emulated`): the slots that form fills.
    results_of_variant: dict[str, tuple[str, ...]] = {}
    # The tool's argument naming the variant of a step key ("probe:<graph>:<variant>"); without
    # one, what follows the key of a step run once names the candidate it ran on ("boundaries:<name>").
    variant_argument: str | None = None
    on_failure: FailurePolicy = "fail_graph"
    needs_export: bool = False  # a graph whose export failed is skipped, with why

    def step_key(self, graph: str | None = None, variant: str | None = None) -> str:
        if self.key is None:
            raise ValueError(f"{self.tool} records no step")
        return ":".join(part for part in (self.key, graph, variant) if part)


def _steps(stage: str, *steps: AdaptationStep) -> list[AdaptationStep]:
    return [step.model_copy(update={"stage": stage}) for step in steps]


def _step(tool: str, label: str, key: str | None = None, *results: str, **more: object) -> AdaptationStep:
    """A step run once for the whole record (its stage is set by `_steps`)."""
    return AdaptationStep(tool=tool, stage="", label=label, key=key, results=results, **more)


def _graph_step(tool: str, label: str, key: str, *results: str, **more: object) -> AdaptationStep:
    """A step run on each graph, with a column in the stage table."""
    return _step(tool, label, key, *results, per_graph=True, in_stage_table=True, **more)


ADAPTATION_STEPS: tuple[AdaptationStep, ...] = (
    *_steps(
        "1 inventory & plan",
        _step("check_environment", "environment gate", "environment", "environment"),
        _step("inventory_entries", "static inventory of the model source", "inventory", "inventory"),
        _step("profile_main_path", "instrumented main-path run (profile + contracts)", "study", "profile", "study"),
        _step("plan_candidates", "rank candidates, choose the first batch", "plan", "plan"),
    ),
    *_steps(
        "2 contracts & boundaries",
        _step("capture_contracts", "contracts of the selected candidates"),
        _step("analyze_boundaries", "exportability and ATC shape strategy", "boundaries"),
    ),
    *_steps(
        "3 ONNX -> OM",
        _graph_step("export_onnx", "export to ONNX", "export", "exports.{graph}", on_failure="promote_inner"),
        _graph_step(
            "probe_onnx",
            "probe ONNX Runtime against PyTorch",
            "probe",
            "toolchain.{graph}.probes.{variant}",
            needs_export=True,
            variant_argument="variant",
        ),
        _graph_step(
            "optimize_onnx",
            "onnxslim / auto_optimizer variants",
            "optimize",
            "toolchain.{graph}.optimize",
            needs_export=True,
        ),
        _graph_step(
            "emulate_precision",
            "ATC precision modes emulated on CPU, keep lists",
            "precision",
            "toolchain.{graph}.precision",
            on_failure="advisory",
            needs_export=True,
        ),
        _step(
            "check_precision_plan",
            "precision plan checked end to end (emulated), fixed if it fails",
            "precision_plan",
            "precision_plan",
        ),
        _graph_step(
            "precheck_ops",
            "operator precheck and known precision pitfalls",
            "precheck",
            "toolchain.{graph}.precheck",
            needs_export=True,
        ),
        _graph_step(
            "convert_atc", "ATC command (run where CANN exists)", "atc", "toolchain.{graph}.atc", needs_export=True
        ),
    ),
    *_steps(
        "4 splice & verify",
        _step(
            "verify_main_path",
            "spliced vs PyTorch main path",
            "verify",
            "verification",
            in_stage_table=True,
            results_of_variant={"emulated": ("verification_emulated",)},
            variant_argument="precision",
        ),
        _step("write_delivery_doc", "delivery document"),
    ),
)

STEPS_BY_KEY: dict[str, AdaptationStep] = {step.key: step for step in ADAPTATION_STEPS if step.key is not None}

# The per-graph stage table's columns, in the plan's order: each step's key.
STAGE_COLUMNS: tuple[str, ...] = tuple(step.key for step in ADAPTATION_STEPS if step.in_stage_table and step.key)

# The steps whose results live in a graph's `toolchain` entry: a new export of the graph voids them.
TOOLCHAIN_STEPS: tuple[str, ...] = tuple(
    step.key for step in ADAPTATION_STEPS if step.key and any(r.startswith("toolchain.") for r in step.results)
)


def step(key: str) -> AdaptationStep:
    """The declaration of the step with this key."""
    return STEPS_BY_KEY[key]


def result_slots(step_key: str) -> list[str]:
    """The record slots (dotted paths) the step recorded under `step_key` fills."""
    kind, _, rest = step_key.partition(":")
    declared = STEPS_BY_KEY.get(kind)
    if declared is None:
        return []
    graph, variant = rest.partition(":")[::2] if declared.per_graph else ("", rest)
    templates = declared.results_of_variant.get(variant, declared.results)
    return [template.format(graph=graph, variant=variant) for template in templates]


def step_key(key: str, graph: str | None = None, variant: str | None = None) -> str:
    """The record's key of a declared step ("probe", "x", "original" -> "probe:x:original")."""
    return STEPS_BY_KEY[key].step_key(graph, variant)


def rerun_command(step_key: str, task: str) -> str | None:
    """The command that redoes the step recorded under `step_key` in the record at `task` (None: no
    declared step has that key)."""
    kind, _, rest = step_key.partition(":")
    declared = STEPS_BY_KEY.get(kind)
    if declared is None:
        return None
    graph, variant = rest.partition(":")[::2] if declared.per_graph else ("", rest)
    if declared.variant_argument is None:
        graph, variant = graph or variant, ""
    command = ["omskills", "tool", declared.tool, "--task", task]
    command += ["--candidate", graph] if graph else []
    command += [f"--{declared.variant_argument}", variant] if variant and declared.variant_argument else []
    return shlex.join(command)
