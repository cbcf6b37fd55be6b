"""Run a task's main path once and write what it produced.

Writes `main_path.json` (per step a summary of every output; weights, scale, timings,
portability findings), `outputs.npz` (every step's outputs) and the driver's pictures.
"""

from __future__ import annotations

import resource
from pathlib import Path
from typing import Any

import numpy as np
from omskills import progress
from omskills.models.api import LoadedModel, MainPathRun, RunHooks
from omskills.models.registry import BoundIntake
from omskills.records.main_path import VALUES_KEPT, MainPathReport, OutputSummary, StepRecord
from omskills.records.task import TaskRecord
from omskills.report.pictures import save_png
from omskills.stages.model import open_model


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def summarise(name: str, value: np.ndarray) -> OutputSummary:
    value = np.asarray(value)
    summary = OutputSummary(name=name, shape=list(value.shape), dtype=str(value.dtype))
    if value.dtype == bool:
        summary.true_count = int(value.sum())
    elif value.dtype.kind in "iuf" and value.size:
        summary.minimum, summary.maximum = round(float(value.min()), 6), round(float(value.max()), 6)
        summary.mean = round(float(value.mean()), 6)
    if value.size <= VALUES_KEPT and value.dtype.kind in "biuf":
        values = np.round(value, 6) if value.dtype.kind == "f" else value
        summary.values = values.reshape(-1).tolist() if value.ndim == 0 else values.tolist()  # a scalar: one value
    return summary


def run_and_report(record: TaskRecord, task_dir: Path, out_dir: Path) -> tuple[MainPathReport, MainPathRun]:
    """Load (or reuse) the model, run the main path once, write the outputs.

    Each phase is reported as it starts (progress lines on the CLI, notifications over MCP):
    building a model and its first step can take minutes in which nothing else is said.
    """
    model = open_model(record, task_dir)  # reports its own phases (inputs, build, prepare)
    unit = model.driver.step_name
    progress.report(0, None, f"running the main path: setup and {unit} 1...")
    done = [0]

    def on_step(_index: int) -> None:  # the model may show its own bar; this feeds MCP progress
        done[0] += 1
        progress.report(done[0], None, f"running the main path: {unit} {done[0]} done")

    run = model.run(RunHooks(on_step=on_step))
    progress.report(
        done[0],
        None,
        f"main path done ({len(run.steps)} {unit}(s) in {run.total_seconds:.1f} s); "
        f"writing outputs and pictures to {out_dir}...",
    )
    report = write_main_path(record, model.bound, model.loaded, run, model.data, out_dir, model.load_seconds)
    return report, run


def write_main_path(
    record: TaskRecord,
    bound: BoundIntake,
    loaded: LoadedModel,
    run: MainPathRun,
    data: Any,
    out_dir: Path,
    load_seconds: float,
) -> MainPathReport:
    out_dir.mkdir(parents=True, exist_ok=True)
    driver = bound.driver
    outputs_path = out_dir / "outputs.npz"
    np.savez_compressed(
        outputs_path, **{f"{s.index}/{name}": value for s in run.steps for name, value in s.outputs.items()}
    )
    pictures = []
    for step in run.steps:
        image = driver.picture(data, step, f"{driver.step_name} {step.index} | weights: {loaded.weights}")
        if image is not None:
            path = save_png(image, out_dir / "pictures" / f"{driver.step_name}_{step.index:04d}.png")
            pictures.append(str(path.relative_to(out_dir)))
    n = max(len(run.steps), 1)
    model = record.intake.model
    report = MainPathReport(
        task_id=record.id,
        model_family=driver.family,
        scale=model.scale,
        weights=loaded.weights,
        device=model.device,
        inputs=bound.inputs.model_dump(mode="json"),
        step_name=driver.step_name,
        num_steps=len(run.steps),
        verification=driver.settings_notes(bound.verification),
        load_seconds=round(load_seconds, 3),
        setup_seconds=round(run.setup_seconds, 3),
        total_seconds=round(run.total_seconds, 3),
        seconds_per_step=round(sum(s.seconds for s in run.steps) / n, 3),
        peak_rss_mb=round(peak_rss_mb(), 1),
        steps=[
            StepRecord(
                index=s.index,
                seconds=round(s.seconds, 3),
                outputs=[summarise(name, value) for name, value in s.outputs.items()],
            )
            for s in run.steps
        ],
        outputs_path=outputs_path.name,
        pictures=pictures,
        portability_findings=loaded.findings(),
        notes=list(loaded.notes) + run.notes,
    )
    (out_dir / "main_path.json").write_text(report.model_dump_json(indent=2))
    return report
