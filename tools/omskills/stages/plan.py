"""Stage 1 plan: rank the study's seed candidates by what the study run measured.

Score = compute share x boundary clarity x state factor. Clarity comes from the captured
contracts (tensor-only I/O, constant non-tensor arguments, one call structure; a candidate
dispatched on a non-tensor argument is clear when each of its graphs is); candidates reading
session state across steps keep their rank but carry the flag, since their inputs must be
bridged from Python every step. The first batch is every candidate with a clear boundary, a
share of at least MIN_SHARE or a name in intake.target.deploy, and no name in
intake.target.defer; a candidate that runs inside another selected one is deferred (the outer
graph holds it).
"""

from __future__ import annotations

from pathlib import Path

from omskills.boundary.analysis import analyze_boundary
from omskills.errors import StageError, TaskRecordError
from omskills.records.contracts import ContractSpec, is_ancestor
from omskills.records.inventory import Inventory
from omskills.records.plan import Candidate, Plan, Seed
from omskills.records.profile import ProfileReport
from omskills.records.stage_order import step_key
from omskills.records.task import TaskRecord
from omskills.report.inventory import render_inventory_report
from omskills.report.wording import counted
from omskills.run_folder import RunFolder
from omskills.stages.steps import StepStart, fingerprint
from omskills.stages.study import require_study

MIN_SHARE = 0.005
STATE_FACTOR = 0.9


def _clarity(contracts: list[ContractSpec]) -> tuple[float, bool, list[str]]:
    reasons: list[str] = []
    for contract in contracts:
        decision = analyze_boundary(contract)
        where = f"{contract.dispatch.label()}: " if contract.dispatch else ""
        reasons += [where + r for r in decision.reasons]
        if not decision.exportable:
            return 0.0, False, reasons
    constants = max(sum(1 for a in c.non_tensor_args if a.constant) for c in contracts)
    # Many baked-in constants mean more Python state crossing the boundary.
    return round(1.0 / (1.0 + 0.05 * constants), 3), True, reasons


def _state_dependent(contracts: list[ContractSpec]) -> bool:
    return any(s.provenance is not None and s.provenance.kind == "session" for c in contracts for s in c.inputs)


def _candidate(seed: Seed, profile: ProfileReport, contracts: list[ContractSpec]) -> tuple[Candidate, bool, list[str]]:
    node = profile.node(seed.module_path)
    share = profile.subtree_share(seed.module_path)
    if not contracts:
        clarity, exportable, reasons = 0.0, False, ["never called on the main path"]
    else:
        clarity, exportable, reasons = _clarity(contracts)
    state = _state_dependent(contracts)
    score = share * clarity * (STATE_FACTOR if state else 1.0)
    dispatched = [c.dispatch.label() for c in contracts if c.dispatch]
    description = seed.description + (f" (one graph per value: {'; '.join(dispatched)})" if dispatched else "")
    return (
        Candidate(
            name=seed.name,
            module_path=seed.module_path,
            module_class=node.module_class if node else "?",
            description=description,
            group=seed.group,
            share=round(share, 5),
            calls=node.calls if node else 0,
            calls_per_frame=node.calls_per_frame if node else None,
            params=node.params_total if node else 0,
            boundary_clarity=clarity,
            state_dependent=state,
            score=round(score, 6),
            rank=0,
            status="pending",
            reason="",
        ),
        exportable,
        reasons,
    )


def _calls(cand: Candidate, profile: ProfileReport) -> str:
    """Its calls, said to be the study run's (a verification may run another number of steps)."""
    calls = f"{counted(cand.calls, 'call')} in the study run"
    if not profile.frames or cand.calls_per_frame is None:
        return calls
    return f"{calls} of {counted(profile.frames, 'step')} ({cand.calls_per_frame:.2f} per step)"


def plan_from_study(
    seeds: list[Seed],
    profile: ProfileReport,
    contracts: dict[str, ContractSpec],
    deploy: list[str] | None = None,
    defer: list[str] | None = None,
) -> Plan:
    """Rank the seeds; `deploy` (intake.target.deploy) names candidates selected whatever their
    share, `defer` (intake.target.defer) candidates deferred whatever their share."""
    deploy, defer = deploy or [], defer or []
    for field, names in (("deploy", deploy), ("defer", defer)):
        unknown = sorted(set(names) - {seed.name for seed in seeds})
        if unknown:
            raise TaskRecordError(
                f"intake.target.{field}: {unknown} are not candidates of this model "
                f"({', '.join(seed.name for seed in seeds)})"
            )
    both = sorted(set(deploy) & set(defer))
    if both:
        raise TaskRecordError(f"intake.target.defer: {both} are named in intake.target.deploy too")
    by_seed = {seed.name: [c for c in contracts.values() if c.plan_candidate == seed.name] for seed in seeds}
    rows = [_candidate(seed, profile, by_seed[seed.name]) for seed in seeds]
    rows.sort(key=lambda r: r[0].score, reverse=True)
    batch = []
    for rank, (cand, exportable, reasons) in enumerate(rows, start=1):
        cand.rank = rank
        if not exportable:
            cand.status, cand.reason = "excluded", "boundary not exportable: " + "; ".join(reasons)
        elif cand.name in defer:
            cand.status, cand.reason = "deferred", f"named in intake.target.defer (share {cand.share:.2%})"
        elif cand.share < MIN_SHARE and cand.name not in deploy:
            cand.status, cand.reason = "deferred", f"share {cand.share:.2%} < {MIN_SHARE:.1%} of the main path"
        else:
            cand.status = "selected"
            cand.reason = (
                f"{cand.share:.1%} of main-path time, {_calls(cand, profile)}; clear tensor boundary"
                + ("; reads session state (bridged from Python each step)" if cand.state_dependent else "")
                + ("; named in intake.target.deploy" if cand.name in deploy else "")
            )
            batch.append(cand.name)
    batch = _outermost(rows, batch)
    covered = sum(c.share for c, _, _ in rows if c.name in batch)
    rationale = (
        f"first batch = every candidate with an exportable boundary and >= {MIN_SHARE:.1%} share "
        f"or named in intake.target.deploy, the outermost of nested ones, "
        f"ranked by share x clarity x state factor; together {covered:.1%} of main-path wall time "
        f"(the rest is Python control plane, post-processing and small modules)"
    )
    return Plan(candidates=[r[0] for r in rows], first_batch=batch, rationale=rationale)


def _outermost(rows: list[tuple[Candidate, bool, list[str]]], batch: list[str]) -> list[str]:
    """Selected candidates that run inside another selected one are deferred: the outer graph holds them."""
    selected = {c.name: c for c, _, _ in rows if c.name in batch}
    kept = []
    for name in batch:
        cand = selected[name]
        outer = next((o for o in selected.values() if is_ancestor(o.module_path, cand.module_path)), None)
        if outer is None:
            kept.append(name)
        else:
            cand.status, cand.reason = (
                "deferred",
                f"runs inside {outer.name} ({outer.module_path}), which is deployed whole",
            )
            cand.inside = outer.name
    return kept


def render_plan_report(plan: Plan, inventory: Inventory | None, profile: ProfileReport, out_dir: Path) -> Path:
    rows = [(c.name, c.share, c.status, c.reason) for c in plan.candidates]
    return render_inventory_report(inventory, profile, rows, out_dir)


def plan_candidates(task_path: Path) -> Plan:
    start = StepStart.of(task_path, step_key("plan"))
    record = start.record
    require_study(record)
    assert record.profile is not None and record.study is not None
    inputs_hash = fingerprint(
        record.stages["study"].inputs_hash if "study" in record.stages else None,
        record.intake.target.deploy,
        record.intake.target.defer,
    )
    workdir = start.workdir
    if start.done(inputs_hash):
        if record.plan is None:  # is_done checks the step's results; a record edited by hand may still lack them
            raise StageError(
                f"{task_path}: stage plan is marked done but the record has no plan: rerun plan_candidates"
            )
        return record.plan
    with start.running(inputs_hash) as step:
        target = record.intake.target
        plan = plan_from_study(
            record.study.seeds, record.profile, record.contracts, deploy=target.deploy, defer=target.defer
        )
        report = render_plan_report(plan, record.inventory, record.profile, workdir / "plan")
        plan.report_path = RunFolder(workdir).stored(report)
        chart = report.parent / "compute_share.png"
        plan.chart_path = RunFolder(workdir).stored(chart) if chart.exists() else None

        def store(rec: TaskRecord) -> None:
            rec.plan = plan
            for cand in plan.candidates:
                rec.decide("plan_candidates", f"{cand.name}: {cand.status}", cand.reason)

        step.update(store)
        step.result.note = plan.rationale
    return plan
