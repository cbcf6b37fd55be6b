"""The model of a task, ready to run: its driver, parsed inputs and settings, the loaded model."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omskills import progress
from omskills.models.api import LoadedModel, MainPathRun, ModelDriver, RunHooks, driver_checks, run_seeded
from omskills.models.cache import load_model
from omskills.models.registry import BoundIntake, bind_intake
from omskills.records.intake import ModelSpec
from omskills.records.task import TaskRecord
from omskills.stages.steps import fingerprint


@dataclass
class TaskModel:
    bound: BoundIntake
    data: Any  # what the driver loaded from intake.inputs
    loaded: LoadedModel
    load_seconds: float

    @property
    def driver(self) -> ModelDriver:
        return self.bound.driver

    def run(self, hooks: RunHooks | None = None) -> MainPathRun:
        return run_seeded(
            self.driver, self.loaded, self.data, self.bound.inputs, self.bound.verification, hooks or RunHooks()
        )


def open_model(record: TaskRecord, workdir: Path, spec: ModelSpec | None = None) -> TaskModel:
    """Load (or reuse) the task's model (or the one `spec` describes) with its inputs, prepared."""
    bound = bind_intake(record.intake, workdir)
    progress.report(0, None, f"reading the inputs of the {bound.driver.family} driver...")
    with driver_checks(bound.driver, "load_inputs"):
        data = bound.driver.load_inputs(bound.inputs, workdir)
    progress.report(0, None, f"building the {(spec or record.intake.model).scale} model (or reusing the loaded one)...")
    _, loaded, seconds = load_model(spec or record.intake.model, workdir)
    progress.report(0, None, f"model ready ({seconds:.1f} s); preparing it for the inputs...")
    ensure_prepared(loaded, bound, data)
    return TaskModel(bound=bound, data=data, loaded=loaded, load_seconds=seconds)


def ensure_prepared(loaded: LoadedModel, bound: BoundIntake, data: Any) -> None:
    """Run the driver's `prepare` unless it last ran on these inputs and settings (a reused model
    may have been prepared for another intake)."""
    key = fingerprint(bound.inputs, bound.verification)
    if loaded.prepared_for != key:
        loaded.notes += bound.driver.prepare(loaded, data, bound.inputs, bound.verification)
        loaded.prepared_for = key
