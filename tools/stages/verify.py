"""Stage 4: splice the compiled candidates into the live model and verify the main path.

The same inputs go through the PyTorch reference and the spliced pipeline in one process. Per
step every output check of the driver is applied (ids, region IoU, coordinates, tensors), and
the report says which backend really ran each graph.
"""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
from omskills import progress
from omskills.ascend.emulation import precisions_for, prepare, save_emulated
from omskills.compare.outputs import compare_step, expand, worse
from omskills.deploy.manifest import graph_from_record
from omskills.errors import InputError, StageError, one_line
from omskills.isolation import return_freed_memory
from omskills.models.api import MainPathRun, ModelDriver, save_run
from omskills.records.export import SpliceStats
from omskills.records.parity import ParityReport
from omskills.records.task import TaskRecord, load_record
from omskills.records.verify import (
    CandidateVerification,
    CheckSummary,
    ItemFigure,
    MainPathParity,
    OutputCheck,
    StepParity,
    VerifyReport,
)
from omskills.report.charts import bar_chart_compute_share, checks_chart, plan_group
from omskills.report.item_table import item_table
from omskills.report.pictures import save_png, side_by_side
from omskills.report.render import template_environment
from omskills.report.stage_status import STAGES, stage_status
from omskills.runtime import BACKENDS, open_backend
from omskills.runtime.paged_weights import page_out
from omskills.runtime.serving import SERVING_BACKENDS, open_graph
from omskills.runtime.splice import SpliceBackend, SpliceHandle, splice
from omskills.stages.model import TaskModel, open_model
from omskills.stages.steps import fingerprint, require_intact, running_step


def spliceable(record: TaskRecord) -> tuple[list[str], dict[str, str]]:
    """Graphs with an export whose probe did not fail; the others stay in PyTorch, with why. A
    dispatched candidate is spliced whole or not at all (a call to a graph left out would fall back)."""
    if record.plan is None:
        raise StageError("no plan in the task record: run plan_candidates first")
    chosen, skipped = [], {}
    for name in record.plan.first_batch:
        graphs = [c.candidate for c in record.contracts_of(name)] or [name]
        why = [f"{g}: {reason}" if g != name else reason for g in graphs if (reason := _not_spliceable(record, g))]
        if why:
            skipped[name] = "; ".join(why)
        else:
            chosen += graphs
    return chosen, skipped


def _not_spliceable(record: TaskRecord, graph: str) -> str | None:
    probe = record.toolchain_of(graph).probes.get("original")
    if graph not in record.exports:
        cand = record.plan.candidate(record.contracts[graph].plan_candidate if graph in record.contracts else graph)  # type: ignore[union-attr]
        return f"not exported ({cand.reason if cand else 'no export'})"
    if probe is None:
        return "never probed: run probe_onnx first"
    if probe.verdict == "fail":
        return f"probe failed (cosine {probe.worst_cosine:.5f}, max abs {probe.worst_max_abs:.2e})"
    return None


def _probe_summary(report: ParityReport | None) -> dict[str, float | str | None]:
    if report is None:
        return {"verdict": None, "cosine": None, "max_abs": None}
    return {"verdict": report.verdict, "cosine": round(report.worst_cosine, 7), "max_abs": float(f"{report.worst_max_abs:.3e}")}


class Emulation(NamedTuple):
    """An ATC precision mode to emulate a graph in, and the nodes kept in fp32."""

    mode: str
    keep: tuple[str, ...] = ()

    def describe(self) -> str:
        return self.mode + (f" keeping {len(self.keep)} node(s)" if self.keep else "")


def chosen_emulation(record: TaskRecord, name: str) -> Emulation:
    report = record.toolchain_of(name).precision
    if report is None:
        raise StageError(f"{name}: no precision emulation recorded: run emulate_precision first")
    return Emulation(report.chosen_mode, tuple(report.chosen_keep))


def open_spliced(record: TaskRecord, workdir: Path, name: str, backend: str,
                 emulation: Emulation | None = None) -> SpliceBackend:
    """The graph's backend, opened as a deployment opens it (runtime.serving): on ONNX Runtime's CPU
    the batch in chunks where probe_onnx found it must be; an OM in the mode of its shape strategy,
    its batch gears serving other sizes. `emulation`: the graph rewritten to compute as that ATC
    precision mode would, on ONNX Runtime CPU."""
    if backend not in SERVING_BACKENDS:  # a third party's backend: opened on the preferred model as it is
        return open_backend(record.preferred_model(workdir, name), backend)
    model = _emulated_model(record, workdir, name, emulation) if emulation is not None else None
    return open_graph(graph_from_record(record, workdir, name), workdir, backend,
                      device_id=record.intake.target.device_id, model=model)


def _emulated_model(record: TaskRecord, workdir: Path, name: str, emulation: Emulation) -> Path:
    source = record.preferred_model(workdir, name)
    kept = f"-keep{fingerprint(sorted(emulation.keep))[:8]}" if emulation.keep else ""
    out = source.with_name(f"{source.stem}.emulated-{emulation.mode}{kept}.onnx")
    prepared = prepare(source)
    return save_emulated(prepared, precisions_for(prepared, emulation.mode, list(emulation.keep)), out)


def _modes(record: TaskRecord, names: list[str]) -> dict[str, str]:
    return {name: chosen_emulation(record, name).describe() for name in names if record.toolchain_of(name).precision}


def verify_main_path(task_path: Path, backend: str = "onnxruntime", precision: str = "fp32") -> VerifyReport:
    """The main path through PyTorch and through the spliced pipeline. `precision`: "fp32" (the
    graphs as exported), or "emulated" (each in its chosen ATC precision mode, emulated on
    ONNX Runtime CPU: the parity to expect on Ascend from the numerics alone)."""
    if backend not in BACKENDS:
        raise InputError(f"backend: no runtime backend named {backend!r}; installed: {', '.join(BACKENDS.names())}")
    if precision not in ("fp32", "emulated"):
        raise InputError(f"precision: {precision!r} is not one of 'fp32', 'emulated'")
    emulated = precision == "emulated"
    if emulated and backend != "onnxruntime":
        raise InputError(f"precision 'emulated' runs on onnxruntime (CPU), not on {backend!r}")
    record = load_record(task_path)
    workdir = TaskRecord.workdir(task_path)
    names, skipped = spliceable(record)
    require_intact(record, workdir, {f"{kind}:{n}": None for n in names for kind in ("export", "optimize")},
                   "export_onnx / optimize_onnx")
    modes = _modes(record, names) if emulated else {}
    model = open_model(record, workdir)
    driver, loaded = model.driver, model.loaded
    inputs_hash = fingerprint(names, [record.exports[n].sha256 for n in names], backend, *([modes] if emulated else []))
    with running_step(task_path, "verify:emulated" if emulated else "verify", inputs_hash) as step:
        progress.report(0, 3, f"verify: reference run of the main path in PyTorch ({driver.step_name}s)...")
        reference = model.run()
        notes = page_out_spliced(loaded.root, record, names, workdir)
        return_freed_memory()  # the reference run's activations go back too
        replacements = [(record.contracts[n], open_spliced(record, workdir, n, backend,
                                                           chosen_emulation(record, n) if emulated else None))
                        for n in names]
        strategies = {n: record.boundaries[n].shape_strategy for n in names if record.boundaries[n].shape_strategy}
        progress.report(1, 3, f"verify: spliced run, {len(names)} graph(s) on {backend}...")
        with splice(loaded.root, replacements, strategies=strategies) as handle:
            spliced = model.run()
        progress.report(2, 3, "verify: comparing outputs, writing the report and pictures...")
        report = verification_report(record, workdir, model, reference, spliced, handle, names, modes, backend)
        report.notes += notes
        report = write_verification_report(report, record, model, reference, spliced, workdir)
        step.update(_stored(report))
    return report


def verification_report(record: TaskRecord, workdir: Path, model: TaskModel, reference: MainPathRun,
                        spliced: MainPathRun, handle: SpliceHandle, names: list[str], modes: dict[str, str] | None = None,
                        backend: str = "onnxruntime") -> VerifyReport:
    """The report of one spliced run of the main path against the reference (`modes`: the ATC
    precision mode each graph was emulated in; empty for the graphs as exported)."""
    driver, verification = model.driver, model.bound.verification
    return _report(record, driver, driver.comparison(verification), driver.settings_notes(verification), workdir,
                   backend, names, spliceable(record)[1], reference, spliced, handle, modes, model.loaded.weights)


def write_verification_report(report: VerifyReport, record: TaskRecord, model: TaskModel, reference: MainPathRun,
                              spliced: MainPathRun, workdir: Path) -> VerifyReport:
    """The report's JSON, its HTML and its pictures written; the report with its figures listed."""
    return _write_reports(report, record, model.driver, reference, spliced, model.data, workdir)


def page_out_spliced(root: Any, record: TaskRecord, names: list[str], workdir: Path) -> list[str]:
    """From here the spliced candidates' PyTorch weights only serve fallbacks: out of memory
    (`page_out`) before the sessions load the same weights again. A memory optimisation, so when
    it cannot apply the run goes on with the weights in memory, and the report says why."""
    try:
        page_out([root.get_submodule(record.contracts[n].module_path) for n in names], workdir / "verify")
    except Exception as err:  # noqa: BLE001 - best effort: any failure leaves the weights where they were
        return [f"the spliced candidates' PyTorch weights stayed in memory (paging them out failed: {one_line(err, 300)})"]
    return []


def _stored(report: VerifyReport):
    def store(rec: TaskRecord) -> None:
        summary = (f"{report.main_path.summary()}; fallbacks {report.main_path.fallbacks}, "
                   f"spliced/torch latency {report.main_path.latency_ratio:.2f}")
        if report.precision == "emulated":  # expected parity on Ascend; statuses stay those of fp32
            rec.verification_emulated = report
            rec.decide("verify_main_path", f"main path with Ascend precision emulated: {report.verdict}", summary)
            return
        rec.verification = report
        # A candidate with several graphs is integrated when every one of them is.
        for c in sorted(report.candidates, key=lambda c: c.status == "fallback"):
            rec.set_status(c.name, c.status)
        rec.decide("verify_main_path", f"main path {report.verdict}", summary)

    return store


def _backend_label(record: TaskRecord, name: str, stats: SpliceStats) -> str:
    label = f"{stats.backend_kind}:{stats.backend_device}"
    split = record.batch_split_of(name)
    if split is not None and stats.backend_kind == "onnxruntime":
        label += f" (batch in chunks of {split.max_batch})"
    return label


def _candidates(record: TaskRecord, names: list[str], stats: dict[str, SpliceStats]) -> list[CandidateVerification]:
    profile = record.profile
    rows = []
    for name in names:
        st = stats[name]
        node = profile.node(record.contracts[name].module_path) if profile else None
        rows.append(CandidateVerification(
            name=name, status="integrated" if st.fallbacks == 0 else "fallback", backend=_backend_label(record, name, st),
            probe=_probe_summary(record.toolchain_of(name).probes.get("original")),
            torch_ms_per_call=round(1000 * node.inclusive_s / node.calls, 3) if node and node.calls else None,
            backend_ms_per_call=round(1000 * st.mean_backend_seconds, 3) if st.backend_calls else None,
            calls=st.calls, fallbacks=st.fallbacks))
    return rows


def _summaries(checks: list[OutputCheck], per_step: list[StepParity]) -> list[CheckSummary]:
    summaries = []
    for check in checks:
        results = [c for s in per_step for c in s.checks if c.output == check.output and c.metric == check.metric]
        worst = None
        for result in results:
            if worst is None or worse(check.metric, result.value, worst):
                worst = result.value
        summaries.append(CheckSummary(output=check.output, metric=check.metric, title=check.title, worst=worst,
                                      passed=all(r.passed for r in results), gating=check.gating))
    return summaries


def main_path_parity(checks: list[OutputCheck], reference: MainPathRun, spliced: MainPathRun,
                     fallbacks: int) -> tuple[MainPathParity, list[StepParity]]:
    """Two runs of the main path judged by the (expanded) checks, step by step and as a whole."""
    per_step = [StepParity(index=r.index, checks=compare_step(checks, r.outputs, s.outputs),
                           torch_seconds=round(r.seconds, 3), spliced_seconds=round(s.seconds, 3))
                for r, s in zip(reference.steps, spliced.steps)]
    n = max(len(per_step), 1)
    torch_s = sum(s.torch_seconds for s in per_step) / n
    spliced_s = sum(s.spliced_seconds for s in per_step) / n
    steps_equal = [s.index for s in reference.steps] == [s.index for s in spliced.steps]
    main = MainPathParity(steps=len(per_step), steps_equal=steps_equal, checks=_summaries(checks, per_step),
                          fallbacks=fallbacks, torch_s_per_step=round(torch_s, 3), spliced_s_per_step=round(spliced_s, 3),
                          latency_ratio=round(spliced_s / torch_s, 3) if torch_s else 0.0,
                          torch_pass_s=round(reference.total_seconds, 3), spliced_pass_s=round(spliced.total_seconds, 3))
    return main, per_step


def _report(record: TaskRecord, driver: ModelDriver, declared: list[OutputCheck], settings: list[str], workdir: Path,
            backend: str, names: list[str], skipped: dict[str, str], reference: MainPathRun, spliced: MainPathRun,
            handle: SpliceHandle, modes: dict[str, str] | None = None, weights: str = "random") -> VerifyReport:
    checks = expand(declared, reference.steps[0].outputs) if reference.steps else declared
    stats = {s.candidate: s for s in handle.stats()}
    candidates = _candidates(record, names, stats)
    main, per_step = main_path_parity(checks, reference, spliced, sum(s.fallbacks for s in stats.values()))
    out = workdir / "verify"
    out.mkdir(parents=True, exist_ok=True)
    stem = "report-emulated" if modes else "report"
    runs = "outputs-emulated" if modes else "outputs"
    save_run(reference, out / f"{runs}-pytorch.npz")
    save_run(spliced, out / f"{runs}-spliced.npz")
    if modes:
        candidates = [c.model_copy(update={"backend": f"{c.backend} (Ascend {modes.get(c.name, 'fp32')} emulated, not an NPU)"})
                      for c in candidates]
    report = VerifyReport(
        task_id=record.id, weights=weights, scale=record.intake.model.scale,
        backend=backend, step_name=driver.step_name,
        backend_per_candidate={c.name: c.backend for c in candidates} | {n: "pytorch (not spliced)" for n in skipped},
        not_spliced=skipped, candidates=candidates, comparison=checks, main_path=main, per_step=per_step,
        splice_stats=list(stats.values()), fallback_events=handle.fallbacks(),
        verification_settings=settings, precision="emulated" if modes else "fp32", precision_modes=modes or {},
        report_json=f"verify/{stem}.json", report_html=f"verify/{stem}.html",
        outputs_pytorch=f"verify/{runs}-pytorch.npz", outputs_spliced=f"verify/{runs}-spliced.npz",
        item_figures=_item_figures(checks, reference, spliced), verdict=main.verdict)
    return report


def _item_figures(checks: list[OutputCheck], reference: MainPathRun, spliced: MainPathRun) -> list[ItemFigure]:
    """Each keyed check per item and step: the check's own comparator on the one reference item
    against the spliced run (which it matches by key, a missing item counting as the worst)."""
    figures = []
    for check in checks:
        if check.key is None or check.key == check.output:
            continue
        for ref, got in zip(reference.steps, spliced.steps):
            if check.output not in ref.outputs or check.key not in ref.outputs:
                continue
            keys = np.asarray(ref.outputs[check.key]).reshape(-1)
            values = np.asarray(ref.outputs[check.output])
            for i, key in enumerate(keys.tolist()):
                one = {check.output: values[i:i + 1], check.key: keys[i:i + 1]}
                [result] = compare_step([check], one, got.outputs)
                figures.append(ItemFigure(output=check.output, metric=check.metric, title=check.title, key=check.key,
                                          item=str(key), step=ref.index, value=result.value, passed=result.passed))
    return figures


def _write_reports(report: VerifyReport, record: TaskRecord, driver: ModelDriver, reference: MainPathRun,
                   spliced: MainPathRun, data: Any, workdir: Path) -> VerifyReport:
    """The report's pictures as PNG files (verify/figures/), the self-contained HTML that embeds
    them, and the JSON; returns the report with its figures listed."""
    stem = Path(report.report_html).stem
    folder = workdir / "verify" / "figures"
    charts = ReportCharts(checks=checks_chart(report, folder / f"{stem}-checks.png"),
                          compute_share=_compute_share(record, folder / f"{stem}-compute-share.png"))
    pictures = _pictures(driver, reference, spliced, data, folder, stem)
    files = [p for p in (charts.compute_share, charts.checks) if p is not None] + [p for _, p in pictures]
    report = report.model_copy(update={"figures": [p.relative_to(workdir).as_posix() for p in files]})
    html = template_environment(html=True).get_template("report.html.j2").render(
        r=report, m=report.main_path, stages=stage_status(record, report), stage_names=STAGES,
        items=item_table(report.item_figures), compute_share=_b64(charts.compute_share), checks=_b64(charts.checks),
        pictures=[(index, _b64(path)) for index, path in pictures])
    (workdir / report.report_html).write_text(html)
    (workdir / report.report_json).write_text(report.model_dump_json(indent=2))
    return report


class ReportCharts(NamedTuple):
    checks: Path
    compute_share: Path | None  # None: no plan candidates to chart


def _compute_share(record: TaskRecord, path: Path) -> Path | None:
    """Share of main-path time per plan candidate (from the profile), coloured by plan group."""
    plan = record.plan
    if plan is None or not plan.candidates:
        return None
    return bar_chart_compute_share([(c.name, c.share, plan_group(c.status, c.name in plan.first_batch))
                                    for c in plan.candidates], path)


def _pictures(driver: ModelDriver, reference: MainPathRun, spliced: MainPathRun, data: Any, folder: Path,
              stem: str) -> list[tuple[int, Path]]:
    """First, middle and last step drawn from both runs side by side (PyTorch left), as PNG files."""
    steps = len(reference.steps)
    pictures = []
    for i in sorted({0, steps // 2, steps - 1}) if steps else []:
        if i >= len(spliced.steps):
            continue
        r, s = reference.steps[i], spliced.steps[i]
        left = driver.picture(data, r, f"PyTorch {driver.step_name} {r.index}")
        right = driver.picture(data, s, f"spliced {driver.step_name} {s.index}")
        if left is not None and right is not None:
            path = save_png(side_by_side(left, right), folder / f"{stem}-{driver.step_name}-{r.index}.png")
            pictures.append((r.index, path))
    return pictures


def _b64(path: Path | None) -> str | None:
    return base64.b64encode(path.read_bytes()).decode() if path is not None else None
