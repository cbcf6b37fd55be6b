"""The verification report of one spliced run against the PyTorch reference: per-candidate rows
(the backend that really ran each graph), the driver's checks per step and per item, and the
JSON, HTML and pictures written to verify/.
"""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
from omskills.ascend.link import link_cost
from omskills.compare.outputs import compare_step, expand
from omskills.models.api import MainPathRun, ModelDriver, save_run
from omskills.records.export import SpliceStats
from omskills.records.parity import ParityReport
from omskills.records.task import TaskRecord
from omskills.records.verify import CandidateVerification, ItemFigure, OutputCheck, VerifyReport
from omskills.report.charts import bar_chart_compute_share, checks_chart, plan_group
from omskills.report.item_table import item_table
from omskills.report.pictures import save_png, side_by_side
from omskills.report.render import template_environment
from omskills.report.stage_status import STAGES, stage_status
from omskills.run_folder import RunFolder
from omskills.splicing.splice import SpliceHandle
from omskills.splicing.traffic import traffic_report
from omskills.stages.model import TaskModel
from omskills.stages.spliced_runs import main_path_parity, spliceable


def verification_report(
    record: TaskRecord,
    workdir: Path,
    model: TaskModel,
    reference: MainPathRun,
    spliced: MainPathRun,
    handle: SpliceHandle,
    names: list[str],
    modes: dict[str, str] | None = None,
    backend: str = "onnxruntime",
) -> VerifyReport:
    """The report of one spliced run of the main path against the reference (`modes`: the ATC
    precision mode each graph was emulated in, judged by the driver's precision checks; empty for
    the graphs as exported, judged by its comparison)."""
    driver, verification = model.driver, model.bound.verification
    return _report(
        record,
        driver,
        driver.precision_checks(verification) if modes else driver.comparison(verification),
        driver.settings_notes(verification),
        workdir,
        backend,
        names,
        spliceable(record)[1],
        reference,
        spliced,
        handle,
        modes,
        model.loaded.weights,
    )


def write_verification_report(
    report: VerifyReport,
    record: TaskRecord,
    model: TaskModel,
    reference: MainPathRun,
    spliced: MainPathRun,
    workdir: Path,
) -> VerifyReport:
    """The report's JSON, its HTML and its pictures written; the report with its figures listed."""
    return _write_reports(report, record, model.driver, reference, spliced, model.data, workdir)


def _probe_summary(report: ParityReport | None) -> dict[str, float | str | None]:
    if report is None:
        return {"verdict": None, "cosine": None, "max_abs": None}
    return {
        "verdict": report.verdict,
        "cosine": round(report.worst_cosine, 7),
        "max_abs": float(f"{report.worst_max_abs:.3e}"),
    }


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
        rows.append(
            CandidateVerification(
                name=name,
                status="integrated" if st.fallbacks == 0 else "fallback",
                backend=_backend_label(record, name, st),
                probe=_probe_summary(record.toolchain_of(name).probes.get("original")),
                torch_ms_per_call=round(1000 * node.inclusive_s / node.calls, 3) if node and node.calls else None,
                backend_ms_per_call=round(1000 * st.mean_backend_seconds, 3) if st.backend_calls else None,
                calls=st.calls,
                fallbacks=st.fallbacks,
                memo_hits=st.memo_hits,
            )
        )
    return rows


def _report(
    record: TaskRecord,
    driver: ModelDriver,
    declared: list[OutputCheck],
    settings: list[str],
    workdir: Path,
    backend: str,
    names: list[str],
    skipped: dict[str, str],
    reference: MainPathRun,
    spliced: MainPathRun,
    handle: SpliceHandle,
    modes: dict[str, str] | None = None,
    weights: str = "random",
) -> VerifyReport:
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
        candidates = [
            c.model_copy(update={"backend": f"{c.backend} (Ascend {modes.get(c.name, 'fp32')} emulated, not an NPU)"})
            for c in candidates
        ]
    report = VerifyReport(
        task_id=record.id,
        weights=weights,
        scale=record.intake.model.scale,
        backend=backend,
        step_name=driver.step_name,
        backend_per_candidate={c.name: c.backend for c in candidates} | {n: "pytorch (not spliced)" for n in skipped},
        not_spliced=skipped,
        candidates=candidates,
        comparison=checks,
        main_path=main,
        per_step=per_step,
        traffic=None
        if handle.traffic.error
        else traffic_report(handle.traffic.steps(), link_cost(record.intake.target)),
        splice_stats=list(stats.values()),
        fallback_events=handle.fallbacks(),
        verification_settings=settings,
        precision="emulated" if modes else "fp32",
        precision_modes=modes or {},
        report_json=f"verify/{stem}.json",
        report_html=f"verify/{stem}.html",
        outputs_pytorch=f"verify/{runs}-pytorch.npz",
        outputs_spliced=f"verify/{runs}-spliced.npz",
        item_figures=_item_figures(checks, reference, spliced),
        verdict=main.verdict,
    )
    if handle.traffic.error:
        report.notes.append(f"host-device traffic was not counted: {handle.traffic.error}")
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
                one = {check.output: values[i : i + 1], check.key: keys[i : i + 1]}
                [result] = compare_step([check], one, got.outputs)
                figures.append(
                    ItemFigure(
                        output=check.output,
                        metric=check.metric,
                        title=check.title,
                        key=check.key,
                        item=str(key),
                        step=ref.index,
                        value=result.value,
                        passed=result.passed,
                    )
                )
    return figures


def _write_reports(
    report: VerifyReport,
    record: TaskRecord,
    driver: ModelDriver,
    reference: MainPathRun,
    spliced: MainPathRun,
    data: Any,
    workdir: Path,
) -> VerifyReport:
    """The report's pictures as PNG files (verify/figures/), the self-contained HTML that embeds
    them, and the JSON; returns the report with its figures listed."""
    stem = Path(report.report_html).stem
    folder = workdir / "verify" / "figures"
    charts = ReportCharts(
        checks=checks_chart(report, folder / f"{stem}-checks.png"),
        compute_share=_compute_share(record, folder / f"{stem}-compute-share.png"),
    )
    pictures = _pictures(driver, reference, spliced, data, folder, stem)
    files = [p for p in (charts.compute_share, charts.checks) if p is not None] + [p for _, p in pictures]
    report = report.model_copy(update={"figures": [RunFolder(workdir).stored(p) for p in files]})
    html = (
        template_environment(html=True)
        .get_template("report.html.j2")
        .render(
            r=report,
            m=report.main_path,
            stages=stage_status(record, report),
            stage_names=STAGES,
            items=item_table(report.item_figures),
            compute_share=_b64(charts.compute_share),
            checks=_b64(charts.checks),
            pictures=[(index, _b64(path)) for index, path in pictures],
        )
    )
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
    return bar_chart_compute_share(
        [(c.name, c.share, plan_group(c.status, c.name in plan.first_batch)) for c in plan.candidates], path
    )


def _pictures(
    driver: ModelDriver, reference: MainPathRun, spliced: MainPathRun, data: Any, folder: Path, stem: str
) -> list[tuple[int, Path]]:
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
