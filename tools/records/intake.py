"""Intake: what to adapt (model, weights, inputs, target) and how to verify it."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from omskills.records.base import Record


class ModelSpec(Record):
    family: Literal["sam3", "sam3.1"]
    # "package" = the installed PyPI package; otherwise a path to a checkout of the source.
    source: str = "package"
    builder: str
    builder_kwargs: dict[str, Any] = Field(default_factory=dict)
    scale: Literal["full", "tiny"] = "full"
    # None = random initialisation with `seed` (labelled "random" in every report).
    checkpoint: str | None = None
    seed: int = 0
    # Device of the PyTorch reference: cpu here, cuda where a GPU exists, npu with torch_npu.
    device: str = "cpu"


class InputSpec(Record):
    # A path to an mp4/gif/folder of frames, or builtin:<name>.
    video: str
    prompt: str
    frames: int = Field(8, ge=1)

    @field_validator("prompt")
    @classmethod
    def _prompt_not_empty(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("the text prompt is empty")
        return value


class TargetSpec(Record):
    soc: str = "Ascend910B4"
    cann_version: str | None = None
    # Candidates to deploy whatever their share of the main path (the plan defers small ones).
    deploy: list[str] = Field(default_factory=list)


class VerificationSpec(Record):
    """Settings that make random weights exercise the whole main path.

    With random weights no detection passes the score thresholds and the tracker never
    runs. `force_top_k_detections` keeps the K best-scoring detections of the prompted
    frame whatever their score; `disable_hotstart` removes the hot-start delay so they
    are tracked at once; `keep_objects_visible` makes the tracker's object-visibility
    logit non-negative (its absolute value), so a random head does not blank every
    tracked mask as "occluded". All are reported in every output when on.
    """

    force_top_k_detections: int = Field(2, ge=0)
    disable_hotstart: bool = True
    keep_objects_visible: bool = False


class Intake(Record):
    model: ModelSpec
    inputs: InputSpec
    target: TargetSpec = Field(default_factory=TargetSpec)
    verification: VerificationSpec = Field(default_factory=VerificationSpec)
