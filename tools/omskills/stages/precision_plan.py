"""The precision plan checked end to end, and fixed graph-locally when it breaks the main path.

Each graph's ATC precision mode and keep list come from that graph alone (`emulate_precision`:
calibration, the fastest mode, a graph-local keep-list search). Errors that pass one graph's gate
can still add up through the pipeline (a tracker's memory carries them from frame to frame), so
the plan is judged where the user judges the model: the main path, every deployed graph emulated
in its mode, against the PyTorch reference (the study's run of the same inputs: no new PyTorch
run), by the driver's precision checks.

Main-path runs are the expensive unit, so there are at most two: the confirmation, and one after
a fix. When the confirmation fails, no graph is bisected on the main path: each emulated graph's
own error on its recorded fp32 inputs (teacher forcing, from its emulation) against its
graph-local tolerance names the graphs at fault; each must bring its own error under what it was,
divided by how far the end-to-end figure missed its gate, and its keep list is searched again on
its recorded inputs (graph runs, not main-path runs). A graph whose search cannot meet the tighter tolerance keeps
every dtype (must_keep_origin_dtype), the last resort, with the reason in one line. Fallbacks in an
emulated run are reported and left to the shape strategy: they never move a graph to a slower
mode. Emulated, never an NPU result.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from contextvars import copy_context
from dataclasses import dataclass, field
from pathlib import Path

from omskills import progress
from omskills.ascend.compute import cube_ms, cube_rate
from omskills.ascend.emulation import prepared_light, run_reference, write_emulated_graphs
from omskills.ascend.precision_fix import mode_precision, own_choice
from omskills.ascend.precision_modes import UNCHECKED_PRECISION_MODE
from omskills.compare.outputs import expand
from omskills.errors import one_line
from omskills.isolation import ISOLATE_MIN_BYTES, model_bytes, return_freed_memory, run_in_child
from omskills.models.api import MainPathRun, RunHooks, StepOutput, load_run
from omskills.models.registry import bind_intake
from omskills.records.precision import (
    GraphAttribution,
    ModePrecision,
    PlanAttempt,
    PlanTime,
    PrecisionGates,
    PrecisionPlan,
    PrecisionReport,
)
from omskills.records.stage_order import step_key
from omskills.records.task import TaskRecord
from omskills.records.verify import AGREEMENTS, CheckSummary, MainPathParity, OutputCheck, VerifyReport
from omskills.splicing.splice import SpliceHandle, splice
from omskills.stages.model import TaskModel, open_model
from omskills.stages.precision import emulation_runner, first_feeds
from omskills.stages.spliced_runs import (
    Emulation,
    main_path_parity,
    open_spliced,
    page_out_spliced,
    spliceable,
)
from omskills.stages.steps import StepStart, fingerprint
from omskills.stages.verify_report import verification_report, write_verification_report

logger = logging.getLogger(__name__)

STEP = step_key("precision_plan")
# Bumped when the check judges differently, so a recorded plan of an older one is checked again.
PLAN_REVISION = 3
# Main-path runs the check may make: the confirmation, and one after a fix.
DEFAULT_BUDGET = 2
SAFEST = UNCHECKED_PRECISION_MODE
# A graph is at fault with the worst one when its own error used at least this share of what the
# worst one used of its tolerance (errors of one size add up; a graph far below adds little).
AT_FAULT_SHARE = 0.5
# How much a graph at fault's tolerance tightens at least, and at most, after a failed run.
TIGHTEN_MIN, TIGHTEN_MAX = 2.0, 100.0

Plan = dict[str, Emulation]


@dataclass
class _Outcome:
    plan: Plan
    run: MainPathRun
    handle: SpliceHandle
    parity: MainPathParity

    @property
    def passed(self) -> bool:
        """Every gating precision check held on every step; fallbacks are reported, not judged here."""
        return self.parity.steps_equal and all(c.passed for c in self.parity.checks if c.gating)


class _WrittenAhead:
    """The plan's emulated graphs, written by a child process while this one builds the PyTorch
    model: rounding a 2 GB backbone's weights to fp16 and building a full-scale model take tens of
    seconds each, and neither needs the other. Graphs under ISOLATE_MIN_BYTES in all are written
    when they are opened: a child's start-up would cost more than it saves."""

    def __init__(self, record: TaskRecord, workdir: Path, plan: Plan) -> None:
        self.plan = dict(plan)
        self._files: Future[dict[str, Path]] | None = None
        graphs = {g: (record.preferred_model(workdir, g), e.mode, e.keep) for g, e in self.plan.items()}
        if sum(model_bytes(source) for source, _, _ in graphs.values()) < ISOLATE_MIN_BYTES:
            return
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="emulated-graphs")
        # In this call's context, so that a cancelled call ends the child (progress.check_cancelled).
        self._files = pool.submit(copy_context().run, run_in_child, write_emulated_graphs, graphs)
        pool.shutdown(wait=False)  # returns at once; the thread ends with the child

    def file(self, graph: str, emulation: Emulation | None) -> Path | None:
        """The file written for `graph` if `emulation` is still the one it was written for; None when
        it is not, or when writing failed (`open_spliced` then writes it here, raising what failed)."""
        if self._files is None or emulation is None or self.plan.get(graph) != emulation:
            return None
        try:
            return self._files.result().get(graph)
        except progress.Cancelled:
            raise
        except Exception as err:  # noqa: BLE001 - written again in this process, where the error shows
            logger.warning("the emulated graphs were not written ahead (%s): writing them here", one_line(err, 300))
            return None


@dataclass
class _Runner:
    """Spliced runs of the main path, one per plan, each judged against the one reference run."""

    record: TaskRecord
    workdir: Path
    model: TaskModel
    graphs: list[str]
    reference: MainPathRun
    budget: int
    ahead: _WrittenAhead
    attempts: list[PlanAttempt] = field(default_factory=list)

    def run(self, plan: Plan, purpose: str) -> _Outcome:
        """The main path with the graphs of `plan` emulated in their modes and every other in fp32."""
        progress.report(len(self.attempts), self.budget, f"precision plan: {purpose}...")
        started = time.perf_counter()
        backends = [
            (
                self.record.contracts[g],
                open_spliced(self.record, self.workdir, g, "onnxruntime", plan.get(g), self.ahead.file(g, plan.get(g))),
            )
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
        checks = self.model.driver.precision_checks(self.model.bound.verification)
        parity, _ = main_path_parity(
            expand(checks, self.reference.steps[0].outputs) if self.reference.steps else checks,
            self.reference,
            spliced,
            sum(s.fallbacks for s in handle.stats()),
        )
        outcome = _Outcome(dict(plan), spliced, handle, parity)
        self.attempts.append(
            PlanAttempt(
                purpose=purpose,
                emulated={g: e.describe() for g, e in plan.items()},
                verdict="pass" if outcome.passed else "fail",
                summary=parity.summary() + (f"; fallbacks {parity.fallbacks}" if parity.fallbacks else ""),
                seconds=round(time.perf_counter() - started, 3),
            )
        )
        return outcome


def check_precision_plan(task_path: Path, budget: int = DEFAULT_BUDGET) -> PrecisionPlan:
    """The main path with every deployed graph in its chosen ATC precision mode and keep list,
    emulated; when it fails and the budget allows, the graphs at fault get longer keep lists found
    on their recorded inputs, and the plan runs once more."""
    start = StepStart.of(task_path, STEP)
    record, workdir = start.record, start.workdir
    names, _ = spliceable(record)
    graphs = [n for n in names if record.toolchain_of(n).precision is not None]
    start.require_intact(
        {step_key(kind, n): None for n in graphs for kind in ("export", "optimize")},
        "export_onnx / optimize_onnx",
    )
    reports = {g: record.toolchain_of(g).precision for g in graphs}
    bound = bind_intake(record.intake, workdir)
    # The per-graph results, not the chosen modes (this step changes those), and how runs are judged.
    inputs_hash = fingerprint(
        graphs,
        [record.exports[g].sha256 for g in graphs],
        [r.modes for r in reports.values()],
        budget,
        bound.driver.precision_checks(bound.verification),
        PLAN_REVISION,
    )
    if start.done(inputs_hash) and record.precision_plan is not None:
        return record.precision_plan
    started = time.perf_counter()
    # Each graph's own choice, not the recorded `chosen_mode`, which an earlier check may have changed.
    plan = {g: Emulation(mode, tuple(keep)) for g in graphs for mode, keep in [own_choice(reports[g])]}
    with start.running(inputs_hash) as step:
        if not any(_computes_in_fp16(reports[g], plan[g]) for g in graphs):
            summary = _not_judged(plan, budget, time.perf_counter() - started)
            step.update(_stored(summary, None, plan, {}))
            return summary
        ahead = _WrittenAhead(record, workdir, plan)
        model = open_model(record, workdir)
        reference, source = _reference(record, workdir, model)
        runner = _Runner(record, workdir, model, graphs, reference, budget, ahead)
        notes = page_out_spliced(model.loaded.root, record, graphs, workdir)
        return_freed_memory()
        last = runner.run(plan, "every graph in its mode and keep list")
        moved: dict[str, str] = {}
        refined: dict[str, ModePrecision] = {}
        attribution: list[GraphAttribution] = []
        if not last.passed:
            attribution = attribute(graphs, reports, plan)
            if len(runner.attempts) < budget and attribution:
                tighten = _tightening(last.parity.checks, model.driver.precision_checks(model.bound.verification))
                own = {a.graph: a.own_error for a in attribution}
                for graph in at_fault(attribution):
                    refit, refined[graph], why = _refit(
                        record, workdir, graph, plan[graph], reports[graph], min(own[graph], 1.0) / tighten
                    )
                    if refit != plan[graph]:
                        plan[graph], moved[graph] = refit, why
                # A plan no refit changed would fail the same way: the run is not made.
                if moved:
                    last = runner.run(plan, f"after keeping more of {', '.join(moved)}")
        passed = last.passed
        faulty = at_fault(attribution) if attribution else []
        if not passed:
            plan = {g: (Emulation(SAFEST) if g in (faulty or graphs) else e) for g, e in plan.items()}
        summary = _plan_record(
            runner, plan, passed, moved, faulty, attribution, source, last, time.perf_counter() - started, reports
        )
        report = verification_report(
            record, workdir, model, runner.reference, last.run, last.handle, names, dict(runner.attempts[-1].emulated)
        )
        report.notes += notes
        report = write_verification_report(report, record, model, runner.reference, last.run, workdir)
        step.update(_stored(summary, report, plan, refined))
    return summary


def _reference(record: TaskRecord, workdir: Path, model: TaskModel) -> tuple[MainPathRun, str]:
    """The PyTorch outputs the emulated runs are judged against: the study's run of the same inputs
    (seeded like every run), or, when its outputs are gone, a run here."""
    study = record.study
    saved = workdir / "study" / "outputs.npz"
    if study is not None and saved.is_file():
        steps = [StepOutput(index=i, seconds=0.0, outputs=o) for i, o in sorted(load_run(saved).items())]
        if steps:
            return MainPathRun(steps=steps, setup_seconds=0.0, total_seconds=0.0), "the study's run (study/outputs.npz)"
    progress.report(0, None, "precision plan: reference run of the main path in PyTorch...")
    return model.run(), "a PyTorch run of the main path here (the study's outputs were not found)"


def _computes_in_fp16(report: PrecisionReport, emulation: Emulation) -> bool:
    """Whether the graph computes anything in fp16 under its chosen mode and keep list."""
    if emulation.mode == SAFEST:
        return False
    mode = report.mode(emulation.mode)
    result = mode.with_keep or mode.result if mode is not None else None
    return result is None or result.fp16_nodes > 0


def attribute(graphs: list[str], reports: dict[str, PrecisionReport], plan: Plan) -> list[GraphAttribution]:
    """Every graph that computes in fp16, by the share of its graph-local tolerance its own error
    used on its recorded fp32 inputs (teacher forcing), highest first."""
    rows = []
    for graph in graphs:
        report, emulation = reports[graph], plan[graph]
        mode = report.mode(emulation.mode)
        if mode is None or not _computes_in_fp16(report, emulation):
            continue
        result = mode.with_keep or mode.result
        tolerance = max(1e-12, 1.0 - report.gates.output_min_cosine)
        own = 1.0 + result.overflow + result.nan if result.overflow or result.nan else max(0.0, 1.0 - result.cosine)
        rows.append(
            GraphAttribution(
                graph=graph, own_error=own, tolerance=tolerance, score=own / tolerance, fp16_macs=report.macs.fp16
            )
        )
    return sorted(rows, key=lambda a: -a.score)


def at_fault(attribution: list[GraphAttribution]) -> list[str]:
    """The graph whose own error used most of its tolerance, and those within AT_FAULT_SHARE of it."""
    if not attribution:
        return []
    top = attribution[0].score
    return [a.graph for a in attribution if a.score >= AT_FAULT_SHARE * top]


def _tightening(summaries: list[CheckSummary], checks: list[OutputCheck]) -> float:
    """How far the failed gating checks missed their gates, as a factor on the graphs' tolerance:
    an agreement of 0.95 against 0.99 missed by (1 - 0.95) / (1 - 0.99) = 5; a difference by its
    ratio to its threshold; a check with neither figure by TIGHTEN_MIN."""
    gates = {(c.output, c.metric): c.threshold for c in checks}
    ratios = []
    for summary in summaries:
        gate = gates.get((summary.output, summary.metric))
        if not summary.gating or summary.passed or summary.worst is None or not gate:
            continue
        if summary.metric in AGREEMENTS:
            ratios.append((1.0 - summary.worst) / max(1e-12, 1.0 - gate))
        else:
            ratios.append(summary.worst / gate)
    return min(TIGHTEN_MAX, max([TIGHTEN_MIN, *ratios]))


def _refit(
    record: TaskRecord, workdir: Path, graph: str, emulation: Emulation, report: PrecisionReport, tolerance: float
) -> tuple[Emulation, ModePrecision, str]:
    """The graph's keep list searched again on its recorded inputs until its own error is under
    `tolerance` (its error in the failed run, divided by how far the end-to-end figure missed; never
    looser than its own gate); every dtype kept when no keep list meets it."""
    loosest = 1.0 - report.gates.output_min_cosine
    gates = PrecisionGates(
        node_min_cosine=report.gates.node_min_cosine, output_min_cosine=1.0 - min(tolerance, loosest)
    )
    feeds, _ = first_feeds(record, workdir, graph)
    model = record.preferred_model(workdir, graph)
    found = emulation_runner(model, feeds)(_search_tighter, model, feeds, emulation.mode, list(emulation.keep), gates)
    before = emulation.describe()
    if found.with_keep is not None or found.result.passed:
        after = Emulation(emulation.mode, tuple(found.keep))
        why = (
            f"{before} -> {after.describe()}: its own error used most of its tolerance; "
            f"cosine >= {gates.output_min_cosine:.6f} met on its recorded inputs"
        )
        return after, found, why
    why = (
        f"{before} -> {SAFEST}: no keep list within {found.search_runs} graph runs met cosine >= "
        f"{gates.output_min_cosine:.6f} on its recorded inputs (the last resort)"
    )
    return Emulation(SAFEST), found, why


def _search_tighter(model: Path, feeds: dict, mode: str, keep: list[str], gates: PrecisionGates) -> ModePrecision:
    with prepared_light(model) as prepared:
        reference = run_reference(prepared, feeds)
        return mode_precision(prepared, mode, feeds, gates, reference, keep, lenient=False)


def _not_judged(plan: Plan, budget: int, seconds: float) -> PrecisionPlan:
    return PrecisionPlan(
        verdict="not_judged",
        modes={g: e.describe() for g, e in plan.items()},
        fp16_mac_share=0.0,
        runs=0,
        budget=budget,
        seconds=round(seconds, 3),
        why="every graph keeps its dtypes: nothing computes in fp16, and the fp32 verification judges the graphs",
    )


def _plan_record(
    runner: _Runner,
    plan: Plan,
    passed: bool,
    moved: dict[str, str],
    faulty: list[str],
    attribution: list[GraphAttribution],
    source: str,
    last: _Outcome,
    seconds: float,
    reports: dict[str, PrecisionReport],
) -> PrecisionPlan:
    fallbacks = last.parity.fallbacks
    if passed:
        why = (
            "the main path passes the precision checks with every graph in its mode (emulated) after "
            f"{len(runner.attempts)} run(s)" + (f"; keep lists refitted for {', '.join(moved)}" if moved else "")
        )
    else:
        why = (
            f"the main path fails the precision checks after {len(runner.attempts)} run(s); graphs at fault: "
            f"{', '.join(faulty) or 'not named'} (they convert with {SAFEST})"
        )
        if attribution and not moved and runner.budget > 1:
            why += "; no keep list changed under a tighter tolerance, so no second run was made"
    if fallbacks:
        why += f"; {fallbacks} call(s) fell back to PyTorch in the last run (the shape strategy's, not precision's)"
    calls = {s.candidate: s.calls for s in last.handle.stats()}
    return PrecisionPlan(
        verdict="pass" if passed else "fail",
        modes={g: e.describe() for g, e in plan.items()},
        moved=moved,
        at_fault=faulty,
        attribution=attribution,
        attempts=runner.attempts,
        reference=source,
        fallbacks=fallbacks,
        fp16_mac_share=_share(plan, reports),
        predicted=predicted_time(runner.record.intake.target.soc, plan, reports, calls),
        runs=len(runner.attempts),
        budget=runner.budget,
        seconds=round(seconds, 3),
        why=why,
    )


def _fp16_macs(report: PrecisionReport, emulation: Emulation) -> int:
    """The graph's Cube MACs computed in fp16 under `emulation` (its report's count when the plan is its choice)."""
    if emulation.mode == SAFEST:
        return 0
    if (emulation.mode, list(emulation.keep)) == (report.chosen_mode, report.chosen_keep):
        return report.macs.fp16
    kept = set(emulation.keep)
    return sum(m for node, m in report.macs.by_node.items() if node not in kept)


def _share(plan: Plan, reports: dict[str, PrecisionReport]) -> float:
    total = sum(reports[g].macs.total for g in plan)
    return sum(_fp16_macs(reports[g], e) for g, e in plan.items()) / total if total else 1.0


def predicted_time(soc: str, plan: Plan, reports: dict[str, PrecisionReport], calls: dict[str, int]) -> PlanTime | None:
    """The Cube time of one main-path run on `soc` (each graph's MACs on its recorded call times its
    calls in the run): the plan, all fp16, all fp32. Predicted from peak rates, never measured."""
    rate = cube_rate(soc)
    if rate is None:
        return None
    fp32_rate = rate.fp16_tflops * rate.fp32_ratio if rate.fp16_tflops and rate.fp32_ratio else None
    total = sum(reports[g].macs.total * calls.get(g, 1) for g in plan)
    fp16 = sum(_fp16_macs(reports[g], e) * calls.get(g, 1) for g, e in plan.items())
    half, full = cube_ms(fp16, rate.fp16_tflops), cube_ms(total - fp16, fp32_rate)
    return PlanTime(
        soc=soc,
        plan_ms=None if half is None or (full is None and total > fp16) else _rounded(half + (full or 0.0)),
        all_fp16_ms=_rounded(cube_ms(total, rate.fp16_tflops)),
        all_fp32_ms=_rounded(cube_ms(total, fp32_rate)),
        source=f"peak Cube rates, predicted: {rate.source}",
    )


def _rounded(value: float | None) -> float | None:
    """Four significant figures: a small model's Cube time is microseconds."""
    return None if value is None else float(f"{value:.4g}")


def _stored(plan_record: PrecisionPlan, report: VerifyReport | None, plan: Plan, refined: dict[str, ModePrecision]):
    def store(rec: TaskRecord) -> None:
        rec.precision_plan = plan_record
        if report is not None:
            rec.verification_emulated = report
        for graph, emulation in plan.items():
            chosen = rec.toolchain_entry(graph).precision
            if chosen is None:
                continue
            if graph in refined and emulation.mode != SAFEST:
                chosen.modes = [refined[graph] if m.mode == emulation.mode else m for m in chosen.modes]
            if (chosen.chosen_mode, tuple(chosen.chosen_keep)) != (emulation.mode, emulation.keep):
                chosen.why += f"; end to end: {plan_record.moved.get(graph) or 'no plan passed, every dtype kept'}"
                chosen.macs = chosen.macs.model_copy(update={"fp16": _fp16_macs(chosen, emulation)})
                chosen.chosen_mode, chosen.chosen_keep = emulation.mode, list(emulation.keep)
        rec.decide(STEP, f"precision plan end to end: {plan_record.verdict}", plan_record.why)

    return store
