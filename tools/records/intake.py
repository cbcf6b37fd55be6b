"""Intake: what to adapt (model, weights, inputs, target) and how to verify it.

The model's driver gives `inputs` and `verification` their meaning: it validates them with its
own pydantic models (`ModelDriver.inputs_model`, `verification_model`) when the record is loaded.
"""

from __future__ import annotations

from typing import Any, Literal

from omskills.records.base import Record
from pydantic import Field, model_validator


class ModelSpec(Record):
    # A registered model family (`omskills drivers` lists them) ...
    family: str | None = None
    # ... or the driver named directly: "package.module:Class", "path/in/workspace.py:Class", or a
    # file "path.py" with the two functions build_model and run_main_path. Paths are relative to
    # the task record's folder.
    driver: str | None = None
    # "package" = the installed package; otherwise a path to a checkout of the source.
    source: str = "package"
    builder: str | None = None  # what builds the model, in the driver's terms (a builder function)
    builder_kwargs: dict[str, Any] = Field(default_factory=dict)
    scale: Literal["full", "tiny"] = "full"
    # None = random initialisation with `seed` (labelled "random" in every report).
    checkpoint: str | None = None
    seed: int = 0
    # Device of the PyTorch reference: cpu here, cuda where a GPU exists, npu with torch_npu.
    device: str = "cpu"

    @model_validator(mode="after")
    def _names_a_driver(self) -> "ModelSpec":
        if not (self.family or self.driver):
            raise ValueError("set family (a registered driver, see `omskills drivers`) or driver (module:Class or a file)")
        return self


class TargetSpec(Record):
    soc: str = "Ascend910B4"
    cann_version: str | None = None
    # The NPU the deployed graphs run on (InferSession's device_id, the CANN provider's device_id).
    device_id: int = Field(default=0, ge=0)
    # Candidates to deploy whatever their share of the main path (the plan defers small ones).
    deploy: list[str] = Field(default_factory=list)


class Intake(Record):
    model: ModelSpec
    inputs: dict[str, Any] = Field(default_factory=dict)  # the driver's inputs_model validates it
    target: TargetSpec = Field(default_factory=TargetSpec)
    verification: dict[str, Any] = Field(default_factory=dict)  # the driver's verification_model validates it
