"""pipeline-adapter stage functions over a task record: contracts and boundaries (stage 2)."""

from __future__ import annotations

from pathlib import Path

from omskills.boundary.analysis import analyze_boundaries as _analyze
from omskills.boundary.analysis import render_contract_table
from omskills.models.registry import driver_for
from omskills.records.results import BoundariesResult, ContractsResult
from omskills.records.stage_order import step_key
from omskills.records.task import TaskRecord
from omskills.run_folder import RunFolder
from omskills.stages.model import open_model
from omskills.stages.steps import StepStart, fingerprint
from omskills.stages.study import ensure_study


def capture_contracts(task_path: Path, candidate: str | None = None) -> ContractsResult:
    """Contracts of the selected candidates (one per graph of a dispatched candidate), from the study
    run (rerun only if the intake changed)."""
    record = ensure_study(task_path)
    names = record.graphs(candidate)
    contracts = [record.contracts[n] for n in names]
    workdir = TaskRecord.workdir(task_path)
    table = workdir / "contracts" / "contracts.md"
    table.parent.mkdir(parents=True, exist_ok=True)
    table.write_text(render_contract_table(contracts, [record.boundaries[n] for n in names if n in record.boundaries]))
    return ContractsResult(contracts=contracts, table_path=RunFolder(workdir).stored(table))


def analyze_boundaries(task_path: Path, candidate: str | None = None, trial_export: bool = False) -> BoundariesResult:
    start = StepStart.of(task_path, step_key("boundaries", candidate))
    record = start.record
    # With the first batch come the candidates deferred inside it: deployed if their outer one fails.
    names = record.graphs(candidate) + (record.inner_graphs() if candidate is None else [])
    contracts = [record.contracts[n] for n in names]
    study_limits = record.study.source_limits if record.study is not None else {}
    # The driver's limits are per plan candidate; each of its graphs takes them.
    limits = {c.candidate: study_limits[c.plan_candidate] for c in contracts if c.plan_candidate in study_limits}
    inputs_hash = fingerprint(contracts, trial_export, limits)
    workdir = start.workdir
    if start.done(inputs_hash):
        decisions = [record.boundaries[n] for n in names]
    else:
        with start.running(inputs_hash) as step:
            driver = driver_for(record.intake.model, workdir)
            modules = {}
            if trial_export:
                loaded = open_model(record, workdir).loaded
                modules = {c.candidate: loaded.root.get_submodule(c.module_path) for c in contracts}
            decisions = _analyze(contracts, modules, limits, trial_export=trial_export, samples_root=workdir)

            def store(rec: TaskRecord) -> None:
                for note in driver.control_plane_notes():
                    rec.decide("analyze_boundaries", "stays in Python", note)
                for d in decisions:
                    rec.boundaries[d.candidate] = d
                    strategy = d.shape_strategy.kind if d.shape_strategy else "none"
                    rec.decide(
                        "analyze_boundaries",
                        f"{d.candidate}: {'exportable' if d.exportable else 'not exportable'}, strategy {strategy}",
                        (d.shape_strategy.rationale if d.shape_strategy else "; ".join(d.reasons)),
                    )

            step.update(store)
    table = workdir / "contracts" / "boundaries.md"
    table.parent.mkdir(parents=True, exist_ok=True)
    table.write_text(render_contract_table(contracts, decisions))
    control = driver_for(record.intake.model, workdir).control_plane_notes() + sorted(
        {line for d in decisions for line in d.control_plane}
    )
    return BoundariesResult(decisions=decisions, table_path=RunFolder(workdir).stored(table), control_plane=control)
