"""torchvision's semantic segmentation models (DeepLabV3, LRASPP, FCN) as one driver.

The entry users call is the weights' recipe around the model: the preprocessing of the builder's
weights enum (resize the shorter side, normalise; the enum only supplies the recipe, nothing is
downloaded), one batched `model(batch)["out"]` (the model upsamples its logits to the input size
itself), then softmax and a per-pixel argmax in Python. The builder comes from the record
(`intake.model.builder`, a function of `torchvision.models.segmentation`).

Random weights need `calibrate_batch_norm`: with the default running statistics a random
MobileNetV3 backbone shrinks its activations until the logits are the same at every pixel
(spatial spread about 1e-8), so the statistics are estimated from the task's images first.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from omskills.models.kit import (
    InputPath,
    LoadedModel,
    MainPathRun,
    ModelDriver,
    ModelSpec,
    OutputCheck,
    RunHooks,
    StepOutput,
    calibrate_batch_norm,
    load_state_dict,
    load_video,
    package_root,
    side_by_side,
    titled,
)
from PIL import Image
from pydantic import BaseModel, ConfigDict, Field

DEFAULT_BUILDER = "deeplabv3_mobilenet_v3_large"


class SegmentationInputs(BaseModel):
    """A batch of frames of a video, a folder or a built-in clip; `size` is the shorter side."""

    model_config = ConfigDict(extra="forbid")

    images: InputPath = "builtin:shapes"
    count: int = Field(2, ge=1)
    size: int = Field(160, ge=64)


class SegmentationVerification(BaseModel):
    model_config = ConfigDict(extra="forbid")

    calibrate_batch_norm: bool = True


@dataclass
class Segmenter:
    """What users write around the model: the weights' preprocessing, the forward, softmax and argmax."""

    model: torch.nn.Module
    recipe: Callable[..., Callable[[Image.Image], torch.Tensor]]  # the weights enum's transforms

    def __call__(self, images: list[Image.Image], size: int) -> dict[str, torch.Tensor]:
        preprocess = self.recipe(resize_size=size)
        logits = self.model(torch.stack([preprocess(image) for image in images]))["out"]
        probabilities = logits.softmax(1)
        return {"logits": logits, "confidence": probabilities.amax(1), "classes": probabilities.argmax(1)}


class TorchvisionSegmenter(ModelDriver):
    family = "torchvision-segmentation"
    description = "torchvision semantic segmentation (DeepLabV3, LRASPP, FCN): images in, per-pixel classes out"
    inputs_model = SegmentationInputs
    verification_model = SegmentationVerification
    step_name = "batch"
    entry_methods = ("forward",)

    def source_root(self, spec: ModelSpec) -> Path:
        return package_root(spec.source, "torchvision")

    def source_package(self, spec: ModelSpec) -> str:
        return "torchvision"

    def builder_name(self, spec: ModelSpec) -> str:
        return spec.builder or DEFAULT_BUILDER

    def load(self, spec: ModelSpec) -> LoadedModel:
        from torchvision.models import get_model_weights, segmentation

        name = self.builder_name(spec)
        builder = getattr(segmentation, name, None)
        if builder is None:
            raise ValueError(f"intake.model.builder: torchvision.models.segmentation has no {name!r}")
        torch.manual_seed(spec.seed)
        model = builder(weights=None, weights_backbone=None, **spec.builder_kwargs)
        if spec.checkpoint:
            load_state_dict(model, Path(spec.checkpoint), spec.device)
        model = model.eval().to(spec.device)
        entry = Segmenter(model, get_model_weights(name).DEFAULT.transforms)
        return LoadedModel(
            entry=entry,
            root=model,
            source_root=self.source_root(spec),
            weights=spec.checkpoint or "random",
            notes=[] if spec.checkpoint else [f"random weights (seed {spec.seed})"],
        )

    def load_inputs(self, inputs: SegmentationInputs, base_dir: Path) -> list[Image.Image]:
        return load_video(inputs.images, inputs.count, base_dir=base_dir, field="intake.inputs.images")

    def prepare(
        self,
        loaded: LoadedModel,
        data: list[Image.Image],
        inputs: SegmentationInputs,
        verification: SegmentationVerification,
    ) -> list[str]:
        if not verification.calibrate_batch_norm:
            return []
        layers = calibrate_batch_norm(loaded.root, lambda: loaded.entry(data, inputs.size))
        return [f"BatchNorm statistics of {layers} layers estimated from the {len(data)} task images"]

    def run_main_path(
        self,
        loaded: LoadedModel,
        data: list[Image.Image],
        inputs: SegmentationInputs,
        verification: SegmentationVerification,
        hooks: RunHooks,
    ) -> MainPathRun:
        start = time.perf_counter()
        with torch.no_grad():
            outputs = loaded.entry(data, inputs.size)
        seconds = time.perf_counter() - start
        hooks.step(0)
        return MainPathRun(
            steps=[StepOutput(index=0, seconds=seconds, outputs={k: v.cpu().numpy() for k, v in outputs.items()})],
            setup_seconds=0.0,
            total_seconds=seconds,
        )

    def comparison(self, verification: SegmentationVerification) -> list[OutputCheck]:
        return [
            OutputCheck(output="logits", metric="tensor", label="logits"),
            OutputCheck(output="confidence", metric="tensor", label="per-pixel top probability"),
            # An argmax over 21 near-equal random-weight classes flips at a few near-tied pixels
            # under float noise: reported, the logits decide.
            OutputCheck(output="classes", metric="exact", gating=False, label="per-pixel classes"),
        ]

    def settings_notes(self, verification: SegmentationVerification) -> list[str]:
        return [
            "calibrate_batch_norm: BatchNorm statistics estimated from the task's images"
        ] * verification.calibrate_batch_norm

    def picture(self, data: list[Image.Image], step: StepOutput, title: str) -> Image.Image:
        classes = step.outputs["classes"][0]
        palette = (np.arange(256)[:, None] * np.array([37, 91, 151]) % 256).astype(np.uint8)
        mask = Image.fromarray(palette[classes])
        return side_by_side(titled(data[0].resize(mask.size), title), mask)
