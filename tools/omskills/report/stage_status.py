"""Every candidate of the plan through every stage, as the reports show it.

One row per graph (a candidate dispatched on a non-tensor argument has one graph per value; a
candidate that never reached a contract has one row under its own name). Each stage cell says
whether the stage ran (`done`), failed, or did not run, and why: a deferred or excluded
candidate's cells carry the plan's reason, a stage after a failed one names the failure.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

from omskills.records.base import Record
from omskills.records.stage_order import STAGE_COLUMNS, step_key
from omskills.records.task import TaskRecord
from omskills.records.toolchain_stage import CandidateToolchain
from omskills.records.verify import VerifyReport
from omskills.report.wording import counted

CellStatus = Literal["done", "failed", "not_run"]
STAGES = STAGE_COLUMNS


class StageCell(Record):
    """One stage of one graph: its status and what it produced, or why it did not run."""

    stage: str
    status: CellStatus
    detail: str


class CandidateStages(Record):
    candidate: str  # the plan candidate
    graph: str  # the graph the stages ran on (the candidate's name when it has no contract)
    plan_status: str
    plan_reason: str
    share: float  # inclusive share of main-path time, from the profile
    cells: list[StageCell]


def stage_status(record: TaskRecord, verification: VerifyReport | None) -> list[CandidateStages]:
    """Every plan candidate (selected, deferred, excluded) with its cells through every stage."""
    rows = []
    for cand in record.plan.candidates if record.plan else []:
        graphs = [c.candidate for c in record.contracts_of(cand.name)] or [cand.name]
        selected = record.plan is not None and cand.name in record.plan.first_batch
        for graph in graphs:
            if selected:
                cells = _cells(record, graph, cand.name, verification)
            else:
                why = f"{cand.status}: {cand.reason}" + (f" (runs inside {cand.inside})" if cand.inside else "")
                cells = [StageCell(stage=s, status="not_run", detail=why) for s in STAGES]
            rows.append(
                CandidateStages(
                    candidate=cand.name,
                    graph=graph,
                    plan_status=cand.status,
                    plan_reason=cand.reason,
                    share=cand.share,
                    cells=cells,
                )
            )
    return rows


def _cells(record: TaskRecord, graph: str, candidate: str, verification: VerifyReport | None) -> list[StageCell]:
    """One cell per column of the declared stage table: a step's status in the record, with what
    its results say (`_PRODUCED`), or the column's own rule (`_SPECIAL`)."""
    chain = record.toolchain_of(graph)
    cells = []
    for column in STAGES:
        if column == "verify":
            cells.append(_verify_cell(record, graph, candidate, verification))
        elif column in _SPECIAL:
            cells.append(_SPECIAL[column](record, graph, chain))
        else:
            cells.append(_step_cell(record, column, step_key(column, graph), _PRODUCED[column](record, graph, chain)))
    return _after_failures(cells)


def _after_failures(cells: list[StageCell]) -> list[StageCell]:
    """A stage that never ran after a failed one says which one stopped it."""
    failed = None
    out = []
    for cell in cells:
        if cell.status == "not_run" and failed is not None and cell.detail == "not reached":
            cell = cell.model_copy(update={"detail": f"not reached: {failed} failed"})
        if cell.status == "failed" and failed is None:
            failed = cell.stage
        out.append(cell)
    return out


def _step_cell(record: TaskRecord, stage: str, key: str, produced: str | None) -> StageCell:
    """The cell of a stage that keeps a step result in the record under `key`."""
    step = record.stages.get(key)
    if step is not None and step.status == "running":  # its process runs it now (the loader tells: step_owner)
        where = f" on {step.host}" if step.host else ""
        return StageCell(stage=stage, status="not_run", detail=f"running now (pid {step.pid}{where})")
    if step is None or step.status == "pending":
        if produced is not None:  # a result written by an older run that did not keep the step
            return StageCell(stage=stage, status="done", detail=produced)
        return StageCell(stage=stage, status="not_run", detail="not reached")
    if step.status == "failed":
        return StageCell(stage=stage, status="failed", detail=step.error or "failed")
    if step.status == "not_run":
        return StageCell(stage=stage, status="not_run", detail=step.note or produced or "not run")
    return StageCell(stage=stage, status="done", detail=produced or step.note or "done")


def _export_detail(record: TaskRecord, graph: str, _chain: CandidateToolchain) -> str | None:
    export = record.exports.get(graph)
    if export is None:
        return None
    return f"{export.exporter} exporter, opset {export.opset}, {export.bytes / 1e6:.1f} MB"


def _probe_cell(record: TaskRecord, graph: str, chain: CandidateToolchain) -> StageCell:
    """The probe ran, but a graph whose outputs fail the gates is not one to deploy: failed."""
    cell = _step_cell(record, "probe", step_key("probe", graph, "original"), _probe_detail(chain))
    probe = chain.probes.get("original")
    if cell.status == "done" and probe is not None and probe.verdict == "fail":
        return cell.model_copy(update={"status": "failed", "detail": f"outputs differ from PyTorch: {cell.detail}"})
    return cell


def _probe_detail(chain: CandidateToolchain) -> str | None:
    probe = chain.probes.get("original")
    if probe is None:
        return None
    cosine = f", cosine {probe.worst_cosine:.6f}" if probe.worst_cosine is not None else ""
    max_abs = f", max abs {probe.worst_max_abs:.2e}" if probe.worst_max_abs is not None else ""
    return f"{probe.verdict}{cosine}{max_abs}"


def _optimize_detail(_record: TaskRecord, _graph: str, chain: CandidateToolchain) -> str | None:
    opt = chain.optimize
    if opt is None:
        return None
    variants = ", ".join(f"{v.name} {v.status}" for v in opt.variants)
    return f"preferred {opt.preferred or 'none'} ({variants})"


def _precision_detail(_record: TaskRecord, _graph: str, chain: CandidateToolchain) -> str | None:
    report = chain.precision
    if report is None:
        return None
    keep = f" keeping {len(report.chosen_keep)} node(s)" if report.chosen_keep else ""
    return f"chosen {report.chosen_mode}{keep} (CPU emulation, not an NPU result)"


def _precheck_cell(_record: TaskRecord, _graph: str, chain: CandidateToolchain) -> StageCell:
    check = chain.precheck
    if check is None:
        return StageCell(stage="precheck", status="not_run", detail="not reached")
    counts = ", ".join(f"{n} {status}" for status, n in check.counts.items() if n)
    pitfalls = f"; known pitfalls: {', '.join(h.id for h in check.pitfalls)}" if check.pitfalls else ""
    return StageCell(stage="precheck", status="done", detail=f"{check.verdict} on {check.soc} ({counts}){pitfalls}")


def _atc_detail(_record: TaskRecord, _graph: str, chain: CandidateToolchain) -> str | None:
    atc = chain.atc
    if atc is None:
        return None
    return f"{atc.status}" + (f": {atc.reason}" if atc.reason else "") + (f", OM {atc.om_path}" if atc.om_path else "")


def _verify_cell(record: TaskRecord, graph: str, candidate: str, verification: VerifyReport | None) -> StageCell:
    if verification is None:
        step = record.stages.get(step_key("verify"))
        if step is not None and step.status == "failed":  # the whole spliced run stopped
            return StageCell(stage="verify", status="failed", detail=step.error or "failed")
        return StageCell(stage="verify", status="not_run", detail="not reached")
    if candidate in verification.not_spliced:
        return StageCell(
            stage="verify", status="not_run", detail=f"stayed in PyTorch: {verification.not_spliced[candidate]}"
        )
    found = next((c for c in verification.candidates if c.name == graph), None)
    if found is None:
        return StageCell(stage="verify", status="not_run", detail="not spliced in this verification")
    status = "done" if found.status == "integrated" else "failed"
    run = counted(verification.main_path.steps, verification.step_name)
    return StageCell(
        stage="verify",
        status=status,
        detail=f"{found.status} on {found.backend}, {counted(found.calls, 'call')} over the {run} verified, "
        f"{counted(found.fallbacks, 'fallback')}",
    )


# What a step's results say, for the cell of a step that records a status of its own.
_PRODUCED: dict[str, Callable[[TaskRecord, str, CandidateToolchain], str | None]] = {
    "export": _export_detail,
    "optimize": _optimize_detail,
    "precision": _precision_detail,
    "atc": _atc_detail,
}
# The cells with a rule of their own: a probe that ran but failed its gates, a precheck that
# records no step (its result is the whole story).
_SPECIAL: dict[str, Callable[[TaskRecord, str, CandidateToolchain], StageCell]] = {
    "probe": _probe_cell,
    "precheck": _precheck_cell,
}


def stage_notes(rows: list[CandidateStages]) -> list[str]:
    """Why stages failed or did not run, one line per stage and reason with the graphs it concerns:
    a candidate left out of the plan gets one line for all its stages."""
    notes: dict[str, list[str]] = {}
    for row in rows:
        missing = [c for c in row.cells if c.status != "done"]
        if len(missing) == len(row.cells) and len({c.detail for c in missing}) == 1:
            notes.setdefault(f"every stage not_run: {missing[0].detail}", []).append(row.graph)
            continue
        for cell in missing:
            notes.setdefault(f"{cell.stage} {cell.status}: {cell.detail}", []).append(row.graph)
    return [f"{why} ({', '.join(graphs)})" for why, graphs in notes.items()]
