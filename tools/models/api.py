"""What every model-family driver provides to the engine."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from PIL import Image

from omskills.source.portability import DevicePortability
from omskills.records.contracts import QuantityLimit, QuantitySchedule, ShapeDerivedArg
from omskills.records.intake import Intake, ModelSpec


@dataclass
class LoadedModel:
    predictor: Any  # the object users call (handle_request / handle_stream_request)
    root: torch.nn.Module  # the nn.Module tree candidates are paths into
    source_root: Path  # folder holding the model's Python package (for file:line findings)
    weights: str  # "random" or the checkpoint path
    portability: DevicePortability
    notes: list[str] = field(default_factory=list)


@dataclass
class FrameResult:
    frame: int
    obj_ids: list[int]
    scores: list[float]
    boxes_xywh: list[list[float]]  # normalised [x, y, w, h]
    masks: np.ndarray  # (num_objects, H, W) bool, original video resolution
    seconds: float


@dataclass
class MainPathResult:
    frames: list[FrameResult]
    prompt_seconds: float
    total_seconds: float
    notes: list[str]


@dataclass(frozen=True)
class SeedCandidate:
    """A heavy subtree the family driver knows about: name, module path(s) and why it matters."""

    name: str
    module_path: str
    description: str
    group: str = ""  # seed subtree it belongs to when one seed is cut into several calls


@dataclass(frozen=True)
class ProvenanceSource:
    """`owner.attribute` is a Python callable whose tensor outputs are of this provenance kind."""

    owner: Any
    attribute: str
    kind: str  # "prompt" | "image" | "session"
    source: str


FrameHook = Callable[[int], None]


class ModelDriver(ABC):
    family: str

    @abstractmethod
    def source_root(self, spec: ModelSpec) -> Path:
        """Folder that contains the model's Python package (checked, clear error if missing)."""

    @abstractmethod
    def load(self, spec: ModelSpec) -> LoadedModel:
        """Build the model on spec.device under the portability layer (never a hub download)."""

    @abstractmethod
    def run_main_path(self, loaded: LoadedModel, frames: list[Image.Image], intake: Intake,
                      on_frame: FrameHook | None = None, on_prompt: Callable[[], None] | None = None) -> MainPathResult:
        """start_session -> add_prompt(text, frame 0) -> propagate_in_video, per-frame results."""

    @abstractmethod
    def seed_candidates(self) -> list[SeedCandidate]:
        """The family's known heavy subtrees (the plan still ranks them by the profile)."""

    def provenance_sources(self, loaded: LoadedModel) -> list[ProvenanceSource]:
        return []

    def control_plane_notes(self) -> list[str]:
        """What the family keeps in Python around its candidates, and why (for the record)."""
        return []

    def source_limits(self, loaded: LoadedModel) -> dict[str, list[QuantityLimit | QuantitySchedule]]:
        """Per candidate: quantities whose range the source shows and the input dims they drive
        (e.g. tracked objects), read from the built model; the study stores them in the record."""
        return {}

    def derived_args(self) -> dict[str, dict[str, ShapeDerivedArg]]:
        """Per candidate: non-tensor arguments the source computes from input shapes (tree path ->
        derivation); the contract binds each where every observed call agrees."""
        return {}
