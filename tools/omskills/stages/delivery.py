"""The delivery document of one adaptation, rendered from the task record (Jinja2)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import NamedTuple

from omskills.errors import StageError
from omskills.models.registry import bind_intake
from omskills.records.contracts import TensorSpec
from omskills.records.task import TaskRecord, load_record
from omskills.report.item_table import item_table
from omskills.report.render import shell_line, template_environment
from omskills.report.stage_status import STAGES, stage_notes, stage_status
from omskills.run_folder import RunFolder
from omskills.splicing.memo import why_not_memoisable


def _io(specs: list[TensorSpec]) -> str:
    return ", ".join(f"{s.name} {s.dtype}{s.shape}" for s in specs[:4]) + (
        f" (+{len(specs) - 4})" if len(specs) > 4 else ""
    )


def known_limits(record: TaskRecord, settings: list[str]) -> list[str]:
    limits = []
    if record.weights() == "random":
        limits.append("random weights: the figures prove parity of the spliced pipeline, not the model's quality")
    if any(tc.atc and tc.atc.status != "converted" for tc in record.toolchain.values()):
        limits.append(
            "no OM was built here (ATC not available); the ATC commands above are ready to run where CANN is installed"
        )
    for cand in record.plan.candidates if record.plan else []:
        if cand.status in ("failed", "excluded", "deferred") and not cand.inside:  # inside: part of a deployed graph
            limits.append(f"{cand.name} stays in PyTorch: {cand.reason}")
    for name, tc in record.toolchain.items():
        if tc.batch_split is not None:
            limits.append(
                f"{name} ran on ONNX Runtime with the batch in chunks of {tc.batch_split.max_batch} "
                f"({tc.batch_split.reason}); the OM keeps its batch gears"
            )
    limits += [f"verification setting {line}" for line in settings]
    limits += record.verification.notes if record.verification else []
    if record.precision_plan is not None and record.precision_plan.verdict != "pass":
        limits.append(f"no precision plan passed end to end (emulated): {record.precision_plan.why}")
    return limits


def memo_rule(record: TaskRecord) -> dict[str, str | None]:
    """Each deployed graph -> why its repeated calls are not answered from memory (None: they are,
    and `bundle --precompute` can compute them ahead)."""
    verified = record.verification.candidates if record.verification else []
    deployed = [c.name for c in verified if c.status == "integrated" and c.name in record.contracts]
    return {name: why_not_memoisable(record.contracts[name]) for name in deployed}


class AtcBlock(NamedTuple):
    """One graph's ATC command as DELIVERY.md shows it: a fenced block of its own."""

    graph: str
    status: str
    reason: str | None
    script: str | None  # the ready-to-run script, relative to the run folder, when it is there
    command: str  # one shell line, every argument quoted, paths relative to the run folder


def atc_blocks(record: TaskRecord, workdir: Path) -> list[AtcBlock]:
    """Every graph's recorded ATC command, quoted for the shell, to run from the run folder."""
    blocks = []
    for graph, chain in record.toolchain.items():
        if chain.atc is None or not chain.atc.command:
            continue
        script = RunFolder(workdir).stored_if_inside(chain.atc.script)
        blocks.append(
            AtcBlock(
                graph=graph,
                status=chain.atc.status,
                reason=chain.atc.reason,
                script=script if script and (workdir / script).is_file() else None,
                command=shell_line(RunFolder(workdir).command(chain.atc.command)),
            )
        )
    return blocks


class DocumentLink(NamedTuple):
    title: str
    path: str  # relative to the run folder


def document_links(record: TaskRecord, workdir: Path) -> list[DocumentLink]:
    """The run's reports (verification, inventory) and the planning chart that exist, for DELIVERY.md to link."""
    candidates = []
    for title, report in (
        ("verification report", record.verification),
        ("verification report, Ascend precision emulated", record.verification_emulated),
    ):
        if report is not None:
            candidates += [DocumentLink(title, report.report_html), DocumentLink(f"{title} (JSON)", report.report_json)]
    if record.plan is not None:
        candidates += [
            DocumentLink("inventory report", record.plan.report_path or ""),
            DocumentLink("compute share at planning", record.plan.chart_path or ""),
        ]
    return [link for link in candidates if link.path and (workdir / link.path).is_file()]


def pictures(record: TaskRecord, workdir: Path) -> list[DocumentLink]:
    """The verification report's pictures (charts, both runs side by side) that exist."""
    report = record.verification
    if report is None:
        return []
    prefix = Path(report.report_html).stem + "-"  # figures are named <report>-<what>.png
    return [
        DocumentLink(Path(p).stem.removeprefix(prefix).replace("-", " "), p)
        for p in report.figures
        if (workdir / p).is_file()
    ]


def _seen_from(value: object, workdir: Path) -> object:
    """An absolute path (an input beside the user's record, a checkout) as the document's reader
    sees it from the run folder; anything else as it is."""
    if isinstance(value, str) and os.path.isabs(value):
        return os.path.relpath(value, workdir.resolve())
    return value


def write_delivery_doc(task_path: Path) -> Path:
    record = load_record(task_path)
    if record.plan is None:
        raise StageError("no plan in the task record: the delivery document needs at least plan_candidates")
    workdir = TaskRecord.workdir(task_path)
    bound = bind_intake(record.intake, workdir)
    settings = bound.driver.settings_notes(bound.verification)
    task_name = Path(task_path).name
    stages = stage_status(record, record.verification)
    model = record.intake.model
    model = model.model_copy(
        update={"source": _seen_from(model.source, workdir), "checkpoint": _seen_from(model.checkpoint, workdir)}
    )
    inputs = {key: _seen_from(value, workdir) for key, value in bound.inputs.model_dump(mode="json").items()}
    text = (
        template_environment()
        .get_template("delivery.md.j2")
        .render(
            r=record,
            m=model,
            family=bound.driver.family,
            inputs=inputs,
            weights=record.weights(),  # a label naming its files itself (models.weights), not a path
            plan=record.plan,
            env=record.environment,
            v=record.verification,
            ve=record.verification_emulated,
            toolchain=record.toolchain,
            pp=record.precision_plan,
            task_name=task_name,
            strategies={n: b.shape_strategy.kind for n, b in record.boundaries.items() if b.shape_strategy},
            serves={n: b.shape_strategy.serves() for n, b in record.boundaries.items() if b.shape_strategy},
            ios={n: (_io(c.inputs), _io(c.outputs)) for n, c in record.contracts.items()},
            graphs={c.name: [g.candidate for g in record.contracts_of(c.name)] for c in record.plan.candidates},
            control_plane=sorted({line for b in record.boundaries.values() for line in b.control_plane})[:8],
            adapt_command=shell_line(["omskills", "adapt", task_name, "--out", "."]),
            bundle_command=shell_line(["omskills", "bundle", task_name]),
            npu_check_command=shell_line(["omskills", "npu-check", task_name]),
            compare_layers_command=shell_line(
                [
                    "omskills",
                    "tool",
                    "compare_layers",
                    "--args",
                    json.dumps({"task": task_name, "candidate": "<name>", "against": "npu_dump"}),
                ]
            ),
            limits=known_limits(record, settings),
            memo=memo_rule(record),
            atc=atc_blocks(record, workdir),
            links=document_links(record, workdir),
            pictures=pictures(record, workdir),
            stages=stages,
            stage_names=STAGES,
            stage_notes=stage_notes(stages),
            items=item_table(record.verification.item_figures if record.verification else []),
        )
    )
    path = workdir / "DELIVERY.md"
    path.write_text(RunFolder(workdir).text(text))
    return path
