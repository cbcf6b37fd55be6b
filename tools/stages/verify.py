"""Stage 4: splice the compiled candidates into the live model and verify the main path.

The same inputs go through the PyTorch reference and the spliced pipeline in one process. Per
step every output check of the driver is applied (ids, region IoU, coordinates, tensors), and
the report says which backend really ran each graph.
"""

from __future__ import annotations

import base64
import io
from pathlib import Path
from typing import Any

import numpy as np
from omskills.ascend.emulation import precisions_for, prepare, save_emulated
from omskills.compare.outputs import compare_step, expand, worse
from omskills.errors import InputError, StageError
from omskills.deploy.manifest import graph_from_record
from omskills.models.api import MainPathRun, ModelDriver, save_run
from omskills.models.cache import return_freed_memory
from omskills.records.export import SpliceStats
from omskills.records.parity import ParityReport
from omskills.records.task import TaskRecord, load_record
from omskills.records.verify import (
    CandidateVerification,
    CheckSummary,
    MainPathParity,
    OutputCheck,
    StepParity,
    VerifyReport,
)
from omskills.report.pictures import side_by_side
from omskills.report.render import template_environment
from omskills.runtime import BACKENDS, open_backend
from omskills.runtime.serving import SERVING_BACKENDS, open_graph
from omskills.runtime.splice import SpliceBackend, SpliceHandle, splice
from omskills.stages.model import open_model
from omskills.stages.steps import fingerprint, running_step


def _spliceable(record: TaskRecord) -> tuple[list[str], dict[str, str]]:
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


def _png_b64(image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


def _figure(report: VerifyReport) -> str:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 3.5))
    ax1, ax2 = fig.subplots(1, 2)
    steps = [s.index for s in report.per_step]
    for check in report.comparison:
        values = [next((c.value for c in s.checks if c.output == check.output and c.metric == check.metric), None)
                  for s in report.per_step]
        if check.metric == "iou" and any(v is not None for v in values):
            ax1.plot(steps, [v if v is not None else 0.0 for v in values], marker="o", label=check.title)
            ax1.axhline(check.threshold, color="r", linestyle="--", label=f"gate {check.threshold}")  # type: ignore[arg-type]
        elif check.metric in ("tensor", "max_abs") and any(v for v in values):
            ax1.semilogy(steps, [max(v or 0.0, 1e-12) for v in values], marker=".", label=f"{check.title} max abs")
    ax1.set(title=f"per {report.step_name}", xlabel=report.step_name)
    if ax1.get_legend_handles_labels()[0]:
        ax1.legend(fontsize=7)
    names = [c.name for c in report.candidates]
    x = np.arange(len(names))
    ax2.bar(x - 0.2, [c.torch_ms_per_call or 0 for c in report.candidates], 0.4, label="PyTorch (profile)")
    ax2.bar(x + 0.2, [c.backend_ms_per_call or 0 for c in report.candidates], 0.4, label="spliced backend")
    ax2.set_xticks(x, names, rotation=30, ha="right", fontsize=8)
    ax2.set(title="latency per call (ms)")
    ax2.legend()
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    return base64.b64encode(buf.getvalue()).decode()


def _probe_summary(report: ParityReport | None) -> dict[str, float | str | None]:
    if report is None:
        return {"verdict": None, "cosine": None, "max_abs": None}
    return {"verdict": report.verdict, "cosine": round(report.worst_cosine, 7), "max_abs": float(f"{report.worst_max_abs:.3e}")}


def _open(record: TaskRecord, workdir: Path, name: str, backend: str, emulated: bool = False) -> SpliceBackend:
    """The graph's backend, opened as a deployment opens it (runtime.serving): on ONNX Runtime's CPU
    the batch in chunks where probe_onnx found it must be; an OM in the mode of its shape strategy,
    its batch gears serving other sizes. `emulated`: the graph rewritten to compute as its chosen
    ATC precision mode would, on ONNX Runtime CPU."""
    if backend not in SERVING_BACKENDS:  # a third party's backend: opened on the preferred model as it is
        return open_backend(record.preferred_model(workdir, name), backend)
    model = _emulated_model(record, workdir, name) if emulated else None
    return open_graph(graph_from_record(record, workdir, name), workdir, backend,
                      device_id=record.intake.target.device_id, model=model)


def _emulated_model(record: TaskRecord, workdir: Path, name: str) -> Path:
    report = record.toolchain_of(name).precision
    if report is None:
        raise StageError(f"{name}: no precision emulation recorded: run emulate_precision first")
    source = record.preferred_model(workdir, name)
    prepared = prepare(source)
    out = source.with_name(f"{source.stem}.emulated-{report.chosen_mode}.onnx")
    return save_emulated(prepared, precisions_for(prepared, report.chosen_mode, report.chosen_keep), out)


def _modes(record: TaskRecord, names: list[str]) -> dict[str, str]:
    modes = {}
    for name in names:
        report = record.toolchain_of(name).precision
        if report is not None:
            keep = f" keeping {len(report.chosen_keep)} node(s)" if report.chosen_keep else ""
            modes[name] = report.chosen_mode + keep
    return modes


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
    names, skipped = _spliceable(record)
    modes = _modes(record, names) if emulated else {}
    model = open_model(record, workdir)
    driver, bound, loaded = model.driver, model.bound, model.loaded
    inputs_hash = fingerprint(names, [record.exports[n].sha256 for n in names], backend, *([modes] if emulated else []))
    with running_step(task_path, "verify:emulated" if emulated else "verify", inputs_hash) as step:
        reference = model.run()
        # The reference run's activations are freed; hand the pages back before the sessions load.
        return_freed_memory()
        replacements = [(record.contracts[n], _open(record, workdir, n, backend, emulated)) for n in names]
        strategies = {n: record.boundaries[n].shape_strategy for n in names if record.boundaries[n].shape_strategy}
        with splice(loaded.root, replacements, strategies=strategies) as handle:
            spliced = model.run()
        report = _report(record, driver, driver.comparison(bound.verification), driver.settings_notes(bound.verification),
                         workdir, backend, names, skipped, reference, spliced, handle, modes)
        _write_html(report, driver, reference, spliced, model.data, workdir / report.report_html)
        step.update(_stored(report))
    return report


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


def _report(record: TaskRecord, driver: ModelDriver, declared: list[OutputCheck], settings: list[str], workdir: Path,
            backend: str, names: list[str], skipped: dict[str, str], reference: MainPathRun, spliced: MainPathRun,
            handle: SpliceHandle, modes: dict[str, str] | None = None) -> VerifyReport:
    checks = expand(declared, reference.steps[0].outputs) if reference.steps else declared
    per_step = [StepParity(index=r.index, checks=compare_step(checks, r.outputs, s.outputs),
                           torch_seconds=round(r.seconds, 3), spliced_seconds=round(s.seconds, 3))
                for r, s in zip(reference.steps, spliced.steps)]
    stats = {s.candidate: s for s in handle.stats()}
    candidates = _candidates(record, names, stats)
    n = max(len(per_step), 1)
    torch_s = sum(s.torch_seconds for s in per_step) / n
    spliced_s = sum(s.spliced_seconds for s in per_step) / n
    fallbacks = sum(s.fallbacks for s in stats.values())
    steps_equal = [s.index for s in reference.steps] == [s.index for s in spliced.steps]
    main = MainPathParity(steps=len(per_step), steps_equal=steps_equal, checks=_summaries(checks, per_step),
                          fallbacks=fallbacks, torch_s_per_step=round(torch_s, 3), spliced_s_per_step=round(spliced_s, 3),
                          latency_ratio=round(spliced_s / torch_s, 3) if torch_s else 0.0)
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
        task_id=record.id, weights=record.intake.model.checkpoint or "random", scale=record.intake.model.scale,
        backend=backend, step_name=driver.step_name,
        backend_per_candidate={c.name: c.backend for c in candidates} | {n: "pytorch (not spliced)" for n in skipped},
        not_spliced=skipped, candidates=candidates, comparison=checks, main_path=main, per_step=per_step,
        splice_stats=list(stats.values()), fallback_events=handle.fallbacks(),
        verification_settings=settings, precision="emulated" if modes else "fp32", precision_modes=modes or {},
        report_json=f"verify/{stem}.json", report_html=f"verify/{stem}.html",
        outputs_pytorch=f"verify/{runs}-pytorch.npz", outputs_spliced=f"verify/{runs}-spliced.npz", verdict=main.verdict)
    (out / f"{stem}.json").write_text(report.model_dump_json(indent=2))
    return report


def _write_html(report: VerifyReport, driver: ModelDriver, reference: MainPathRun, spliced: MainPathRun, data: Any,
                path: Path) -> None:
    steps = len(reference.steps)
    pictures = []
    for i in sorted({0, steps // 2, steps - 1}) if steps else []:
        if i >= len(spliced.steps):
            continue
        r, s = reference.steps[i], spliced.steps[i]
        left = driver.picture(data, r, f"PyTorch {driver.step_name} {r.index}")
        right = driver.picture(data, s, f"spliced {driver.step_name} {s.index}")
        if left is not None and right is not None:
            pictures.append((r.index, _png_b64(side_by_side(left, right))))
    html = template_environment(html=True).get_template("report.html.j2").render(
        r=report, m=report.main_path, pictures=pictures, figure=_figure(report))
    path.write_text(html)
