"""The model of a task, ready to run: its driver, parsed inputs and settings, the loaded model."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omskills.models.api import LoadedModel, MainPathRun, ModelDriver, RunHooks
from omskills.models.cache import load_model
from omskills.models.registry import BoundIntake, bind_intake
from omskills.records.task import TaskRecord


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
        return self.driver.run_main_path(self.loaded, self.data, self.bound.inputs, self.bound.verification,
                                         hooks or RunHooks())


def open_model(record: TaskRecord, workdir: Path) -> TaskModel:
    """Load (or reuse) the task's model with its inputs; a freshly loaded model is prepared first."""
    bound = bind_intake(record.intake, workdir)
    data = bound.driver.load_inputs(bound.inputs, workdir)
    _, loaded, seconds = load_model(record.intake.model, workdir)
    if not loaded.prepared:
        loaded.notes += bound.driver.prepare(loaded, data, bound.inputs, bound.verification)
        loaded.prepared = True
    return TaskModel(bound=bound, data=data, loaded=loaded, load_seconds=seconds)
