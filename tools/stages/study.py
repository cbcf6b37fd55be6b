"""The study run: the main path once, instrumented for both stage 1 and stage 2.

One model run gives the profile (hooks on every module), the contracts of every seed
candidate (hooks on the candidates, provenance of every tensor) and the main-path
outputs. Profiling first and capturing later would mean two runs of minutes each.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

from omskills.contracts.capture import capture_contracts
from omskills.contracts.provenance import ProvenanceTracker
from omskills.contracts.routing import route_forward_calls
from omskills.errors import StageError
from omskills.stages.main_path import frames_for, write_main_path
from omskills.models.cache import load_model
from omskills.models import MainPathResult
from omskills.profiling.profiler import ModuleProfiler
from omskills.records.plan import StudyRun
from omskills.stages.steps import fingerprint, is_done, running_step
from omskills.records.task import TaskRecord, load_record
from omskills import progress

STEP = "study"
MAX_SAMPLES = 2


def study_inputs_hash(record: TaskRecord) -> str:
    return fingerprint(record.intake.model, record.intake.inputs, record.intake.verification)


def ensure_study(task_path: Path) -> TaskRecord:
    """Run the study unless a finished one with the same intake is in the record."""
    record = load_record(task_path)
    inputs_hash = study_inputs_hash(record)
    workdir = TaskRecord.workdir(task_path)
    samples_present = all((workdir / p).exists() for c in record.contracts.values() for p in c.samples)
    if is_done(record, STEP, inputs_hash) and record.profile and record.contracts and samples_present:
        return record
    intake = record.intake
    frames = frames_for(record, workdir)
    driver, loaded, load_seconds = load_model(intake.model)
    seeds = driver.seed_candidates()
    with running_step(task_path, STEP, inputs_hash) as step:
        tracker = ProvenanceTracker()
        profiler = ModuleProfiler(loaded.root)
        frames_done = [0]
        outcome: list[MainPathResult] = []

        def on_frame(_frame: int) -> None:
            frames_done[0] += 1
            profiler.mark_frame()
            progress.report(frames_done[0], len(frames), "study run: frames")

        def run() -> None:
            with contextlib.ExitStack() as stack:
                for src in driver.provenance_sources(loaded):
                    stack.enter_context(tracker.wrap_callable(src.owner, src.attribute, src.kind, src.source))
                stack.enter_context(route_forward_calls([loaded.root.get_submodule(s.module_path) for s in seeds]))
                stack.enter_context(profiler)
                outcome.append(driver.run_main_path(loaded, frames, intake, on_frame=on_frame, on_prompt=profiler.mark_prompt))

        start = time.perf_counter()
        contracts = capture_contracts(loaded.root, {s.name: s.module_path for s in seeds}, run, tracker,
                                      samples_dir=workdir / "samples", max_samples=MAX_SAMPLES,
                                      frame_counter=lambda: frames_done[0], relative_to=workdir,
                                      derived_args=driver.derived_args())
        seconds = time.perf_counter() - start
        profile = profiler.report(notes=[f"instrumented run (profiler + contract capture); weights: {loaded.weights}"])
        report = write_main_path(record, loaded, outcome[0], frames, workdir / "study", load_seconds)
        study = StudyRun(inputs_hash=inputs_hash, main_path_json=str(Path("study") / "main_path.json"),
                         contracts_captured=[c.candidate for c in contracts], seconds=round(seconds, 3),
                         source_limits=driver.source_limits(loaded))

        def store(rec: TaskRecord) -> None:
            rec.study, rec.profile = study, profile
            rec.contracts = {c.candidate: c for c in contracts}
            if rec.inventory is not None:
                rec.inventory = rec.inventory.merge_runtime_findings(report.portability_findings)

        step.update(store)
        step.result.note = f"{len(frames)} frames, {len(contracts)} contracts, weights {loaded.weights}"
    return load_record(task_path)


def require_study(record: TaskRecord) -> None:
    if record.profile is None or not record.contracts:
        raise StageError("no study run in the task record: run profile_main_path first")
