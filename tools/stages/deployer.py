"""om-deployer stage functions over a task record: profile and plan (stage 1)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field

from omskills.errors import StageError
from omskills.source.inventory import locate_source_root, scan_source
from omskills.stages.plan import plan_from_study, render_plan_report
from omskills.records.base import Record
from omskills.records.plan import Plan
from omskills.stages.steps import fingerprint, is_done, running_step
from omskills.stages.study import ensure_study, require_study
from omskills.records.task import TaskRecord, load_record


class ModuleShare(Record):
    path: str
    module_class: str
    share: float
    calls: int
    calls_per_frame: float | None


class ProfileSummary(Record):
    weights: str
    scale: str
    frames: int
    total_seconds: float
    control_plane_seconds: float
    top_modules: list[ModuleShare]
    candidate_shares: dict[str, float] = Field(default_factory=dict)
    main_path_json: str


def profile_main_path(task_path: Path, top: int = 12) -> ProfileSummary:
    record = ensure_study(task_path)
    require_study(record)
    profile = record.profile
    assert profile is not None and record.study is not None
    nodes = sorted((n for n in profile.nodes if n.depth >= 1), key=lambda n: n.inclusive_s, reverse=True)[:top]
    from omskills.models import get_driver

    seeds = get_driver(record.intake.model.family).seed_candidates()
    return ProfileSummary(
        weights=record.intake.model.checkpoint or "random", scale=record.intake.model.scale, frames=profile.frames,
        total_seconds=profile.total_seconds, control_plane_seconds=round(profile.control_plane_seconds, 3),
        top_modules=[ModuleShare(path=n.path, module_class=n.module_class, share=round(n.share, 5), calls=n.calls,
                                 calls_per_frame=n.calls_per_frame) for n in nodes],
        candidate_shares={s.name: round(profile.subtree_share(s.module_path), 5) for s in seeds},
        main_path_json=record.study.main_path_json,
    )


def plan_candidates(task_path: Path) -> Plan:
    record = load_record(task_path)
    require_study(record)
    assert record.profile is not None
    inputs_hash = fingerprint(record.stages["study"].inputs_hash if "study" in record.stages else None,
                              record.intake.target.deploy)
    if is_done(record, "plan", inputs_hash) and record.plan is not None:
        return record.plan
    workdir = TaskRecord.workdir(task_path)
    with running_step(task_path, "plan", inputs_hash) as step:
        inventory = record.inventory
        if inventory is None:
            model = record.intake.model
            inventory = scan_source(locate_source_root(model.source, model.family, workdir), model.family, model.builder, model.source)
        plan = plan_from_study(record.intake.model.family, record.profile, record.contracts,
                               deploy=record.intake.target.deploy)
        report = render_plan_report(plan, inventory, record.profile, workdir / "plan")
        plan.report_path = str(report.relative_to(workdir))
        chart = report.parent / "compute_share.png"
        plan.chart_path = str(chart.relative_to(workdir)) if chart.exists() else None

        def store(rec: TaskRecord) -> None:
            rec.plan = plan
            for cand in plan.candidates:
                rec.decide("plan_candidates", f"{cand.name}: {cand.status}", cand.reason)

        step.update(store)
        step.result.note = plan.rationale
    return plan


def selected_candidates(record: TaskRecord, candidate: str | None) -> list[str]:
    """The plan's first batch, or the one named (which must be in the plan)."""
    if record.plan is None:
        raise StageError("no plan in the task record: run plan_candidates first")
    if candidate is None:
        return list(record.plan.first_batch)
    if record.plan.candidate(candidate) is None:
        known = ", ".join(c.name for c in record.plan.candidates)
        raise StageError(f"candidate {candidate!r} is not in the plan (known: {known})")
    return [candidate]
