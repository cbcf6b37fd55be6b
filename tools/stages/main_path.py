"""Run the text-prompted main path of a task and write what it produced.

Writes `main_path.json` (per frame: ids, scores, boxes; weights, scale, timings,
portability findings), `masks.npz` and overlay PNGs into the output folder.
"""

from __future__ import annotations

import resource
from pathlib import Path
from typing import Callable

import numpy as np

from omskills import progress
from omskills.models.cache import load_model
from omskills.models import MainPathResult
from omskills.report.pictures import draw_overlay, save_png
from omskills.records.intake import Intake
from omskills.records.main_path import FrameRecord, MainPathReport
from omskills.records.task import TaskRecord
from omskills.models.media import load_video


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def verification_notes(intake: Intake) -> list[str]:
    v = intake.verification
    notes = []
    if v.force_top_k_detections:
        notes.append(f"force_top_k_detections={v.force_top_k_detections}: the top-{v.force_top_k_detections} detections of the prompted frame are kept whatever their score")
    if v.disable_hotstart:
        notes.append("disable_hotstart: hot-start delay set to 0 so forced objects are tracked at once")
    if v.keep_objects_visible:
        notes.append("keep_objects_visible: the tracker's object-visibility logit is taken as its absolute value")
    return notes


def frames_for(record: TaskRecord, task_dir: Path):
    return load_video(record.intake.inputs.video, record.intake.inputs.frames, base_dir=task_dir)


def run_and_report(record: TaskRecord, task_dir: Path, out_dir: Path,
                   instrument: Callable[[object], object] | None = None) -> tuple[MainPathReport, MainPathResult]:
    """Load (or reuse) the model, run the main path once, write the outputs."""
    intake = record.intake
    frames = frames_for(record, task_dir)
    driver, loaded, load_seconds = load_model(intake.model)
    done = [0]

    def on_frame(_frame: int) -> None:  # SAM shows its own tqdm bar; this feeds MCP progress
        done[0] += 1
        progress.report(done[0], len(frames), "main path frames")

    result = driver.run_main_path(loaded, frames, intake, on_frame=on_frame)
    report = write_main_path(record, loaded, result, frames, out_dir, load_seconds)
    return report, result


def write_main_path(record: TaskRecord, loaded, result: MainPathResult, frames, out_dir: Path, load_seconds: float) -> MainPathReport:
    out_dir.mkdir(parents=True, exist_ok=True)
    intake = record.intake
    masks_path = out_dir / "masks.npz"
    np.savez_compressed(masks_path, **{f"frame_{f.frame}": f.masks for f in result.frames},
                        **{f"obj_ids_{f.frame}": np.asarray(f.obj_ids, dtype=np.int64) for f in result.frames})
    overlays = []
    for f in result.frames:
        title = f"frame {f.frame} | ids {f.obj_ids} | weights: {loaded.weights}"
        image = draw_overlay(frames[f.frame], f.obj_ids, f.masks, f.boxes_xywh, title)
        overlays.append(str(save_png(image, out_dir / "overlays" / f"frame_{f.frame:04d}.png").relative_to(out_dir)))
    n = max(len(result.frames), 1)
    report = MainPathReport(
        task_id=record.id, model_family=intake.model.family, scale=intake.model.scale, weights=loaded.weights,
        device=intake.model.device, prompt=intake.inputs.prompt, video=intake.inputs.video, num_frames=len(result.frames),
        verification=verification_notes(intake),
        load_seconds=round(load_seconds, 3), prompt_seconds=round(result.prompt_seconds, 3),
        total_seconds=round(result.total_seconds, 3), seconds_per_frame=round(sum(f.seconds for f in result.frames) / n, 3),
        peak_rss_mb=round(peak_rss_mb(), 1),
        frames=[FrameRecord(frame=f.frame, obj_ids=f.obj_ids, scores=[round(s, 6) for s in f.scores],
                            boxes_xywh=[[round(v, 6) for v in b] for b in f.boxes_xywh],
                            mask_areas=[int(m.sum()) for m in f.masks], seconds=round(f.seconds, 3)) for f in result.frames],
        masks_path=masks_path.name, overlays=overlays,
        portability_findings=loaded.portability.findings(), notes=list(loaded.notes) + result.notes,
    )
    (out_dir / "main_path.json").write_text(report.model_dump_json(indent=2))
    return report
