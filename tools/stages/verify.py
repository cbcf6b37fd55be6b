"""Stage 4: splice the compiled candidates into the live predictor and verify the main path.

The same frames and prompt go through the PyTorch reference and the spliced pipeline in
one process; per frame the object ids, mask IoU per object, boxes and scores are compared,
and the report says which backend really ran each candidate.
"""

from __future__ import annotations

import base64
import io
from pathlib import Path

import numpy as np

from omskills.compare.parity import ParityReport
from omskills.errors import StageError
from omskills.stages.main_path import frames_for, verification_notes
from omskills.models.cache import load_model, return_freed_memory
from omskills.models import FrameResult, MainPathResult
from omskills.report.pictures import draw_overlay, side_by_side
from omskills.records.export import SpliceStats
from omskills.records.verify import CandidateVerification, FrameParity, MainPathParity, VerifyReport
from omskills.runtime import open_backend
from omskills.runtime.batch_split import open_onnxruntime
from omskills.runtime.splice import SpliceBackend, splice
from omskills.stages.steps import fingerprint, running_step
from omskills.records.task import TaskRecord, load_record
from omskills.stages.toolchain import CandidateToolchain, batch_split_of, preferred_model

IOU_GATE = 0.99


def mask_iou(a: np.ndarray, b: np.ndarray) -> float:
    union = np.logical_or(a, b).sum()
    return 1.0 if union == 0 else float(np.logical_and(a, b).sum() / union)


def frame_parity(ref: FrameResult, got: FrameResult) -> FrameParity:
    ious: dict[str, float] = {}
    box_diff = score_diff = 0.0
    for i, obj in enumerate(ref.obj_ids):
        if obj in got.obj_ids:
            j = got.obj_ids.index(obj)
            ious[str(obj)] = round(mask_iou(ref.masks[i], got.masks[j]), 6)
            box_diff = max(box_diff, float(np.abs(np.subtract(ref.boxes_xywh[i], got.boxes_xywh[j])).max()))
            score_diff = max(score_diff, abs(ref.scores[i] - got.scores[j]))
        else:
            ious[str(obj)] = 0.0
    return FrameParity(frame=ref.frame, reference_ids=ref.obj_ids, spliced_ids=got.obj_ids,
                       obj_ids_equal=ref.obj_ids == got.obj_ids, mask_iou=ious, max_box_diff=box_diff,
                       max_score_diff=score_diff, torch_seconds=round(ref.seconds, 3), spliced_seconds=round(got.seconds, 3))


def _spliceable(record: TaskRecord) -> tuple[list[str], dict[str, str]]:
    """Candidates with an export whose probe did not fail; the others stay in PyTorch, with why."""
    if record.plan is None:
        raise StageError("no plan in the task record: run plan_candidates first")
    chosen, skipped = [], {}
    for name in record.plan.first_batch:
        tc = record.toolchain.get(name, CandidateToolchain())
        probe = tc.probes.get("original")
        if name not in record.exports:
            skipped[name] = f"not exported ({record.plan.candidate(name).reason})"  # type: ignore[union-attr]
        elif probe is None:
            skipped[name] = "never probed: run probe_onnx first"
        elif probe.verdict == "fail":
            skipped[name] = f"probe failed (cosine {probe.worst_cosine:.5f}, max abs {probe.worst_max_abs:.2e})"
        else:
            chosen.append(name)
    return chosen, skipped


def _png_b64(image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


def _figure(per_frame: list[FrameParity], candidates: list[CandidateVerification]) -> str:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 3.5))
    ax1, ax2 = fig.subplots(1, 2)
    frames = [f.frame for f in per_frame]
    ax1.plot(frames, [min(f.mask_iou.values(), default=1.0) for f in per_frame], marker="o")
    ax1.axhline(IOU_GATE, color="r", linestyle="--", label=f"gate {IOU_GATE}")
    ax1.set(title="min mask IoU per frame", xlabel="frame", ylim=(min(0.9, ax1.get_ylim()[0]), 1.005))
    ax1.legend()
    names = [c.name for c in candidates]
    x = np.arange(len(names))
    ax2.bar(x - 0.2, [c.torch_ms_per_call or 0 for c in candidates], 0.4, label="PyTorch (profile)")
    ax2.bar(x + 0.2, [c.backend_ms_per_call or 0 for c in candidates], 0.4, label="spliced backend")
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


def _open(record: TaskRecord, workdir: Path, name: str, backend: str) -> SpliceBackend:
    """The candidate's backend; on ONNX Runtime, the batch in chunks where probe_onnx found it must be
    (the OM has its batch gears and runs the whole batch)."""
    split = batch_split_of(record, name)
    path = preferred_model(record, workdir, name)
    if backend == "onnxruntime":
        return open_onnxruntime(path, split)
    return open_backend(path, backend)


def verify_main_path(task_path: Path, backend: str = "onnxruntime") -> VerifyReport:
    record = load_record(task_path)
    workdir = TaskRecord.workdir(task_path)
    names, skipped = _spliceable(record)
    intake = record.intake
    frames = frames_for(record, workdir)
    driver, loaded, _ = load_model(intake.model)
    inputs_hash = fingerprint(names, [record.exports[n].sha256 for n in names], backend)
    with running_step(task_path, "verify", inputs_hash) as step:
        reference = driver.run_main_path(loaded, frames, intake)
        # The reference run's activations are freed; hand the pages back before the ORT sessions load.
        return_freed_memory()
        replacements = [(record.contracts[n], _open(record, workdir, n, backend)) for n in names]
        strategies = {n: record.boundaries[n].shape_strategy for n in names if record.boundaries[n].shape_strategy}
        with splice(loaded.root, replacements, strategies=strategies) as handle:
            spliced = driver.run_main_path(loaded, frames, intake)
        report = _report(record, task_path, workdir, backend, names, skipped, reference, spliced, handle, frames)

        def store(rec: TaskRecord) -> None:
            rec.verification = report
            for c in report.candidates:
                if rec.plan and (cand := rec.plan.candidate(c.name)):
                    cand.status = c.status  # type: ignore[assignment]
            rec.decide("verify_main_path", f"main path {report.verdict}",
                       f"ids equal {report.main_path.obj_ids_equal}, min IoU {report.main_path.min_mask_iou:.4f}, "
                       f"fallbacks {report.main_path.fallbacks}, spliced/torch latency {report.main_path.latency_ratio:.2f}")

        step.update(store)
    return report


def _backend_label(record: TaskRecord, name: str, stats: SpliceStats) -> str:
    label = f"{stats.backend_kind}:{stats.backend_device}"
    split = batch_split_of(record, name)
    if split is not None and stats.backend_kind == "onnxruntime":
        label += f" (batch in chunks of {split.max_batch})"
    return label


def _report(record: TaskRecord, task_path: Path, workdir: Path, backend: str, names: list[str], skipped: dict[str, str],
            reference: MainPathResult, spliced: MainPathResult, handle, frames) -> VerifyReport:
    per_frame = [frame_parity(r, s) for r, s in zip(reference.frames, spliced.frames)]
    stats = {s.candidate: s for s in handle.stats()}
    profile = record.profile
    candidates = []
    for name in names:
        st = stats[name]
        node = profile.node(record.contracts[name].module_path) if profile else None
        ok = st.fallbacks == 0
        candidates.append(CandidateVerification(
            name=name, status="integrated" if ok else "fallback", backend=_backend_label(record, name, st),
            probe=_probe_summary(record.toolchain[name].probes.get("original")),
            torch_ms_per_call=round(1000 * node.inclusive_s / node.calls, 3) if node and node.calls else None,
            backend_ms_per_call=round(1000 * st.mean_backend_seconds, 3) if st.backend_calls else None,
            calls=st.calls, fallbacks=st.fallbacks))
    ious = [v for f in per_frame for v in f.mask_iou.values()]
    n = max(len(per_frame), 1)
    torch_s = sum(f.torch_seconds for f in per_frame) / n
    spliced_s = sum(f.spliced_seconds for f in per_frame) / n
    fallbacks = sum(s.fallbacks for s in stats.values())
    main = MainPathParity(frames=len(per_frame), obj_ids_equal=all(f.obj_ids_equal for f in per_frame) and len(reference.frames) == len(spliced.frames),
                          min_mask_iou=min(ious, default=1.0), fallbacks=fallbacks, torch_s_per_frame=round(torch_s, 3),
                          spliced_s_per_frame=round(spliced_s, 3), latency_ratio=round(spliced_s / torch_s, 3) if torch_s else 0.0)
    verdict = "pass" if main.obj_ids_equal and main.min_mask_iou >= IOU_GATE and fallbacks == 0 else "fail"
    out = workdir / "verify"
    out.mkdir(parents=True, exist_ok=True)
    report = VerifyReport(
        task_id=record.id, weights=record.intake.model.checkpoint or "random", scale=record.intake.model.scale, backend=backend,
        backend_per_candidate={c.name: c.backend for c in candidates} | {n: "pytorch (not spliced)" for n in skipped},
        not_spliced=skipped, candidates=candidates, main_path=main, per_frame=per_frame,
        splice_stats=list(stats.values()), fallback_events=handle.fallbacks(),
        verification_settings=verification_notes(record.intake), report_json="verify/report.json",
        report_html="verify/report.html", verdict=verdict)
    (out / "report.json").write_text(report.model_dump_json(indent=2))
    _write_html(report, reference, spliced, frames, out / "report.html")
    return report


def _write_html(report: VerifyReport, reference: MainPathResult, spliced: MainPathResult, frames, path: Path) -> None:
    from omskills.report.render import template_environment

    chosen = sorted({0, len(reference.frames) // 2, len(reference.frames) - 1})
    overlays = []
    for i in chosen:
        r, s = reference.frames[i], spliced.frames[i]
        left = draw_overlay(frames[r.frame], r.obj_ids, r.masks, r.boxes_xywh, f"PyTorch frame {r.frame} ids {r.obj_ids}")
        right = draw_overlay(frames[s.frame], s.obj_ids, s.masks, s.boxes_xywh, f"spliced frame {s.frame} ids {s.obj_ids}")
        overlays.append((r.frame, _png_b64(side_by_side(left, right))))
    env = template_environment(html=True)
    html = env.get_template("report.html.j2").render(r=report, m=report.main_path, overlays=overlays,
                                                      figure=_figure(report.per_frame, report.candidates))
    path.write_text(html)
