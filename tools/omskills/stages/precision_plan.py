"""The precision plan checked end to end, and fixed when it breaks the main path.

Each graph's ATC precision mode is chosen from that graph alone: the fastest mode whose emulated
output passes the graph's own gate on one sample. Errors that pass one graph's gate can still add
up through the pipeline (the memory of a tracker carries them from frame to frame), so the plan
is judged where the user judges the model: the main path, every deployed graph emulated in its
mode, against the PyTorch reference, by the driver's own checks.

When that fails, the graphs at fault are found by bisection (a half of them emulated, the rest in
fp32, cheapest to settle first), each moved one step down the ladder of safer modes (its own
keep list for that mode when its emulation found one), and the plan checked again, within a
budget of spliced runs. The ATC commands then carry the plan that passed; when none did, the
graphs at fault convert with must_keep_origin_dtype and the record says so. Emulated, never an
NPU result.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from omskills import progress
from omskills.ascend.precision_modes import DEFAULT_MODES
from omskills.compare.outputs import expand
from omskills.isolation import return_freed_memory
from omskills.models.api import MainPathRun, RunHooks
from omskills.records.precision import PlanAttempt, PrecisionPlan, PrecisionReport
from omskills.records.task import TaskRecord, load_record
from omskills.records.verify import MainPathParity, VerifyReport
from omskills.runtime.splice import SpliceHandle, splice
from omskills.stages.model import TaskModel, open_model
from omskills.stages.spliced_runs import (
    Emulation,
    chosen_emulation,
    main_path_parity,
    open_spliced,
    page_out_spliced,
    spliceable,
)
from omskills.stages.steps import fingerprint, is_done, require_intact, running_step
from omskills.stages.verify_report import verification_report, write_verification_report

STEP = "precision_plan"
# Spliced runs of the main path the check may make, attribution included (a full-scale video
# model's run is minutes).
DEFAULT_BUDGET = 8
# Safer and safer: each step keeps more of the graph in fp32 (the last keeps all of it).
LADDER: tuple[str, ...] = DEFAULT_MODES
SAFEST = LADDER[-1]

Plan = dict[str, Emulation]


class OutOfBudget(Exception):
    """The budget of runs is spent before the check could settle."""


@dataclass
class _Outcome:
    plan: Plan
    run: MainPathRun
    handle: SpliceHandle
    parity: MainPathParity

    @property
    def passed(self) -> bool:
        return self.parity.verdict == "pass"


@dataclass
class _Runner:
    """Spliced runs of the main path, one per plan, each judged against the one reference run."""

    record: TaskRecord
    workdir: Path
    model: TaskModel
    graphs: list[str]
    reference: MainPathRun
    budget: int
    attempts: list[PlanAttempt] = field(default_factory=list)

    def run(self, plan: Plan, purpose: str) -> _Outcome:
        """The main path with the graphs of `plan` emulated in their modes and every other in fp32."""
        if len(self.attempts) >= self.budget:
            raise OutOfBudget
        progress.report(len(self.attempts), self.budget, f"precision plan: {purpose}...")
        started = time.perf_counter()
        backends = [
            (self.record.contracts[g], open_spliced(self.record, self.workdir, g, "onnxruntime", plan.get(g)))
            for g in self.graphs
        ]
        strategies = {g: s for g in self.graphs if (s := self.record.boundaries[g].shape_strategy)}
        try:
            with splice(self.model.loaded.root, backends, strategies=strategies) as handle:
                spliced = self.model.run(RunHooks(on_step=handle.traffic.step_done))
        finally:
            for _, backend in backends:
                close = getattr(backend, "close", None)
                if callable(close):
                    close()
            del backends
            # The sessions and the emulated models built for them are gone: their memory goes back
            # before the next run builds its own (a full-scale video model peaked in this step).
            return_freed_memory()
        checks = self.model.driver.comparison(self.model.bound.verification)
        parity, _ = main_path_parity(
            expand(checks, self.reference.steps[0].outputs) if self.reference.steps else checks,
            self.reference,
            spliced,
            sum(s.fallbacks for s in handle.stats()),
        )
        self.attempts.append(
            PlanAttempt(
                purpose=purpose,
                emulated={g: e.describe() for g, e in plan.items()},
                verdict=parity.verdict,
                summary=parity.summary(),
                seconds=round(time.perf_counter() - started, 3),
            )
        )
        return _Outcome(dict(plan), spliced, handle, parity)

    def fails(self, plan: Plan, purpose: str) -> bool:
        return not self.run(plan, purpose).passed


def check_precision_plan(task_path: Path, budget: int = DEFAULT_BUDGET) -> PrecisionPlan:
    """The main path with every deployed graph in its chosen ATC precision mode, emulated; when it
    fails, the graphs at fault moved to safer modes until it passes or `budget` runs are spent."""
    record = load_record(task_path)
    workdir = TaskRecord.workdir(task_path)
    names, _ = spliceable(record)
    graphs = [n for n in names if record.toolchain_of(n).precision is not None]
    require_intact(
        record,
        workdir,
        {f"{kind}:{n}": None for n in graphs for kind in ("export", "optimize")},
        "export_onnx / optimize_onnx",
    )
    reports = {g: record.toolchain_of(g).precision for g in graphs}
    # The per-graph results, not the chosen modes: this step changes those.
    inputs_hash = fingerprint(
        graphs, [record.exports[g].sha256 for g in graphs], [r.modes for r in reports.values()], budget
    )
    if is_done(record, STEP, inputs_hash, workdir) and record.precision_plan is not None:
        return record.precision_plan
    model = open_model(record, workdir)
    started = time.perf_counter()
    with running_step(task_path, STEP, inputs_hash) as step:
        progress.report(0, budget, "precision plan: reference run of the main path in PyTorch...")
        runner = _Runner(record, workdir, model, graphs, model.run(), budget)
        notes = page_out_spliced(model.loaded.root, record, graphs, workdir)
        return_freed_memory()
        last, plan, moved, at_fault = _settle(runner, {g: chosen_emulation(record, g) for g in graphs}, reports)
        passed = last is not None and last.passed and last.plan == plan
        if not passed:
            plan = _safest(plan, at_fault)
        summary = _plan_record(runner, plan, passed, moved, at_fault, budget, time.perf_counter() - started)
        if not passed and not at_fault:
            summary.narrowed_to = narrowed_to(runner.attempts, graphs)
            if summary.narrowed_to:
                summary.why += f"; the runs made narrowed the fault to {', '.join(summary.narrowed_to)}"
        report = None
        if last is not None:  # the last run of a whole plan: the report shows it, passed or not
            report = verification_report(
                record,
                workdir,
                model,
                runner.reference,
                last.run,
                last.handle,
                names,
                {g: e.describe() for g, e in last.plan.items()},
            )
            report.notes += notes
            report = write_verification_report(report, record, model, runner.reference, last.run, workdir)
        step.update(_stored(summary, report, plan))
    return summary


def _settle(
    runner: _Runner, plan: Plan, reports: dict[str, PrecisionReport]
) -> tuple[_Outcome | None, Plan, dict[str, str], list[str]]:
    """Run the plan; while it fails and the budget lasts, move the graphs at fault one step safer.
    When the graphs fail only together (each half passes alone: their errors add up), bisection
    cannot name one, and the graph whose own emulation strays furthest is moved, one at a time.
    Returns the last run of a whole plan, the plan as it stands, the moves and the graphs at fault."""
    moved: dict[str, str] = {}
    at_fault: list[str] = []
    last, together = None, False
    try:
        last = runner.run(plan, "every graph in the mode its own emulation chose")
        while not last.passed:
            emulated = {g: e for g, e in plan.items() if e.mode != SAFEST}
            if not emulated:
                break  # every graph keeps its dtype: what fails is not precision (see the fp32 verification)
            found = [] if together else _at_fault(runner, emulated)
            together = together or (len(found) > 1 and set(found) == set(emulated))
            if together:
                found = [max(emulated, key=lambda g: _stray(reports[g], plan[g]))]
            why = (
                "the graphs fail only together; its own emulation strays furthest"
                if together
                else "emulated with the rest in fp32, it broke the main path"
            )
            at_fault += [g for g in found if g not in at_fault]
            for graph in found:
                safer = _safer(plan[graph], reports[graph])
                moved[graph] = (
                    f"{moved[graph].split(' -> ')[0] if graph in moved else plan[graph].describe()} "
                    f"-> {safer.describe()}: {why}"
                )
                plan[graph] = safer
            last = runner.run(plan, f"after moving {', '.join(found)} to safer modes")
    except OutOfBudget:
        pass
    return last, plan, moved, at_fault


def _stray(report: PrecisionReport, emulation: Emulation) -> float:
    """How far the graph's own emulation in this mode strayed from fp32 (1 - cosine; 0 unknown)."""
    emulated = report.mode(emulation.mode)
    if emulated is None:
        return 0.0
    result = emulated.with_keep if emulation.keep and emulated.with_keep is not None else emulated.result
    return 1.0 - result.cosine


def _at_fault(runner: _Runner, failing: Plan) -> list[str]:
    """The graphs whose emulation breaks the main path, by bisection over `failing` (a plan known
    to fail): a half emulated with the rest in fp32. A group whose halves pass alone fails only
    together: all of it is at fault."""
    graphs = list(failing)
    if len(graphs) == 1:
        return graphs
    half = len(graphs) // 2
    found = []
    for part in (graphs[:half], graphs[half:]):
        sub = {g: failing[g] for g in part}
        if runner.fails(sub, f"finding the graphs at fault: {', '.join(part)} emulated, the rest in fp32"):
            found += _at_fault(runner, sub)
    return found or graphs


def _safer(current: Emulation, report: PrecisionReport) -> Emulation:
    """The next mode down the ladder, with the keep list the graph's own emulation proposed for it."""
    index = LADDER.index(current.mode) if current.mode in LADDER else len(LADDER) - 2
    mode = LADDER[min(index + 1, len(LADDER) - 1)]
    emulated = report.mode(mode)
    keep = tuple(emulated.keep) if emulated and emulated.with_keep is not None and emulated.with_keep.passed else ()
    return Emulation(mode, keep if mode != SAFEST else ())


def narrowed_to(attempts: list[PlanAttempt], graphs: list[str]) -> list[str]:
    """Where a bisection the budget cut short left the fault: the fewest graphs a failed run
    emulated (the rest in fp32), when fewer than all of them."""
    failed = [a for a in attempts if a.verdict == "fail" and len(a.emulated) < len(graphs)]
    return list(min(failed, key=lambda a: len(a.emulated)).emulated) if failed else []


def _safest(plan: Plan, at_fault: list[str]) -> Plan:
    """No plan passed within the budget: the graphs at fault (or, unknown, every one) keep their dtypes."""
    suspects = at_fault or list(plan)
    return {g: (Emulation(SAFEST) if g in suspects else e) for g, e in plan.items()}


def _plan_record(
    runner: _Runner, plan: Plan, passed: bool, moved: dict[str, str], at_fault: list[str], budget: int, seconds: float
) -> PrecisionPlan:
    if passed:
        why = f"the main path passes with every graph in its mode (emulated) after {len(runner.attempts)} run(s)" + (
            f"; moved {', '.join(moved)}" if moved else ""
        )
    else:
        why = (
            f"no plan passed within {budget} run(s); graphs at fault: {', '.join(at_fault) or 'not found'} "
            f"(they convert with {SAFEST}, unchecked end to end)"
        )
    return PrecisionPlan(
        verdict="pass" if passed else "fail",
        modes={g: e.describe() for g, e in plan.items()},
        moved=moved,
        at_fault=at_fault,
        attempts=runner.attempts,
        runs=len(runner.attempts),
        budget=budget,
        seconds=round(seconds, 3),
        why=why,
    )


def _stored(plan_record: PrecisionPlan, report: VerifyReport | None, plan: Plan):
    def store(rec: TaskRecord) -> None:
        rec.precision_plan = plan_record
        if report is not None:
            rec.verification_emulated = report
        for graph, emulation in plan.items():
            chosen = rec.chain(graph).precision
            if chosen is not None and (chosen.chosen_mode, tuple(chosen.chosen_keep)) != (
                emulation.mode,
                emulation.keep,
            ):
                chosen.why += f"; end to end: {plan_record.moved.get(graph) or 'no plan passed, kept in its dtype'}"
                chosen.chosen_mode, chosen.chosen_keep = emulation.mode, list(emulation.keep)
        rec.decide(STEP, f"precision plan end to end: {plan_record.verdict}", plan_record.why)

    return store
