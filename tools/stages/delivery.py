"""The delivery document of one adaptation, rendered from the task record (Jinja2)."""

from __future__ import annotations

from pathlib import Path

from omskills.errors import StageError
from omskills.models.registry import bind_intake
from omskills.records.contracts import TensorSpec
from omskills.records.task import TaskRecord, load_record
from omskills.report.render import template_environment


def _io(specs: list[TensorSpec]) -> str:
    return ", ".join(f"{s.name} {s.dtype}{s.shape}" for s in specs[:4]) + (f" (+{len(specs) - 4})" if len(specs) > 4 else "")


def known_limits(record: TaskRecord, settings: list[str]) -> list[str]:
    limits = []
    if record.intake.model.checkpoint is None:
        limits.append("random weights: the figures prove parity of the spliced pipeline, not the model's quality")
    if any(tc.atc and tc.atc.status != "converted" for tc in record.toolchain.values()):
        limits.append("no OM was built here (ATC not available); the ATC commands above are ready to run where CANN is installed")
    for cand in record.plan.candidates if record.plan else []:
        if cand.status in ("failed", "excluded", "deferred") and not cand.inside:  # inside: part of a deployed graph
            limits.append(f"{cand.name} stays in PyTorch: {cand.reason}")
    for name, tc in record.toolchain.items():
        if tc.batch_split is not None:
            limits.append(f"{name} ran on ONNX Runtime with the batch in chunks of {tc.batch_split.max_batch} "
                          f"({tc.batch_split.reason}); the OM keeps its batch gears")
    limits += [f"verification setting {line}" for line in settings]
    return limits


def write_delivery_doc(task_path: Path) -> Path:
    record = load_record(task_path)
    if record.plan is None:
        raise StageError("no plan in the task record: the delivery document needs at least plan_candidates")
    workdir = TaskRecord.workdir(task_path)
    bound = bind_intake(record.intake, workdir)
    settings = bound.driver.settings_notes(bound.verification)
    text = template_environment().get_template("delivery.md.j2").render(
        r=record, m=record.intake.model, family=bound.driver.family, inputs=bound.inputs.model_dump(mode="json"),
        plan=record.plan, env=record.environment, v=record.verification, ve=record.verification_emulated, toolchain=record.toolchain,
        task_name=Path(task_path).name,
        strategies={n: b.shape_strategy.kind for n, b in record.boundaries.items() if b.shape_strategy},
        ios={n: (_io(c.inputs), _io(c.outputs)) for n, c in record.contracts.items()},
        graphs={c.name: [g.candidate for g in record.contracts_of(c.name)] for c in record.plan.candidates},
        control_plane=sorted({line for b in record.boundaries.values() for line in b.control_plane})[:8],
        limits=known_limits(record, settings),
    )
    path = workdir / "DELIVERY.md"
    path.write_text(text)
    return path
