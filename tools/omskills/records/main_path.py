"""Results of one run of the main path: per step, a summary of every named output."""

from __future__ import annotations

from typing import Any

from omskills.records.base import Record
from omskills.records.inventory import PortabilityFinding
from pydantic import Field

# Outputs with at most this many elements are stored whole in the report.
VALUES_KEPT = 64


class OutputSummary(Record):
    name: str
    shape: list[int]
    dtype: str
    values: list[Any] | None = None  # the values, rounded, when the output is small (a 0-d output: one)
    minimum: float | None = None
    maximum: float | None = None
    mean: float | None = None
    true_count: int | None = None  # boolean outputs: how many elements are set


class StepRecord(Record):
    index: int
    seconds: float
    outputs: list[OutputSummary]

    def output(self, name: str) -> OutputSummary | None:
        return next((o for o in self.outputs if o.name == name), None)


class MainPathReport(Record):
    task_id: str
    model_family: str
    scale: str
    weights: str  # the label of omskills.models.weights: files read (sha256), declared, or "random"
    device: str
    inputs: dict[str, Any]  # intake.inputs as the driver read them
    step_name: str = "step"
    num_steps: int
    verification: list[str] = Field(default_factory=list)  # settings that were on, said plainly
    load_seconds: float
    setup_seconds: float
    total_seconds: float
    seconds_per_step: float
    peak_rss_mb: float
    steps: list[StepRecord]
    outputs_path: str  # npz of every step's outputs, keys "<step>/<output>"
    pictures: list[str]
    portability_findings: list[PortabilityFinding]
    notes: list[str] = Field(default_factory=list)
