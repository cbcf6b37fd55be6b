"""Faster R-CNN from torchvision as an omskills driver (an example written against omskills.models.kit).

The entry users call is the detector itself: `model([image])` returns boxes, labels and scores.
Around the network sits a Python control plane omskills must leave alone: the transform (resize,
normalise, batch), anchor generation, proposal selection and NMS, RoI pooling and the per-class
post-processing. The driver names no seed candidates: the study ranks torchvision's module tree
from a profile, and the boundary rules find the tensor-only subtrees.

Random weights need two verification settings, as SAM needs its forced detections:
`calibrate_batch_norm` estimates the BatchNorm statistics from the task's images (with the
default running statistics a random backbone shrinks its activations to about 1e-8, and every
proposal then gets the same score), and `min_score` / `detections_per_image` keep a fixed number
of detections whatever their score.
"""

from __future__ import annotations

import time
from pathlib import Path
from unittest import mock

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
    draw_instances,
    load_state_dict,
    load_video,
    package_root,
)
from PIL import Image
from pydantic import BaseModel, ConfigDict, Field

DEFAULT_BUILDER = "fasterrcnn_mobilenet_v3_large_320_fpn"


class ImageInputs(BaseModel):
    """Images to detect in: the frames of a video, a folder of images, or a built-in clip, each
    resized to width x height when given (the model's transform then scales them to its min_size)."""

    model_config = ConfigDict(extra="forbid")

    images: InputPath = "builtin:shapes"
    count: int = Field(2, ge=1)  # how many of them
    width: int | None = Field(None, ge=32, le=4096)
    height: int | None = Field(None, ge=32, le=4096)


class DetectionVerification(BaseModel):
    model_config = ConfigDict(extra="forbid")

    calibrate_batch_norm: bool = True
    min_score: float = Field(0.0, ge=0.0, le=1.0)  # replaces roi_heads.score_thresh
    detections_per_image: int = Field(10, ge=1)  # replaces roi_heads.detections_per_img


def _tensor(image: Image.Image) -> torch.Tensor:
    return torch.from_numpy(np.array(image.convert("RGB"))).permute(2, 0, 1).float() / 255.0


class FasterRcnnDriver(ModelDriver):
    family = "torchvision-fasterrcnn"
    description = "torchvision Faster R-CNN detectors (mobilenet_v3 / resnet50 FPN): images in, boxes/labels/scores out"
    inputs_model = ImageInputs
    verification_model = DetectionVerification
    step_name = "image"
    entry_methods = ("forward",)
    entry_classes = ("GeneralizedRCNN", "FasterRCNN")

    def source_root(self, spec: ModelSpec) -> Path:
        return package_root(spec.source, "torchvision")

    def source_package(self, spec: ModelSpec) -> str:
        return "torchvision"

    def builder_name(self, spec: ModelSpec) -> str:
        return spec.builder or DEFAULT_BUILDER

    def load(self, spec: ModelSpec) -> LoadedModel:
        from torchvision.models import detection

        name = self.builder_name(spec)
        builder = getattr(detection, name, None)
        if builder is None:
            raise ValueError(f"intake.model.builder: torchvision.models.detection has no {name!r}")
        torch.manual_seed(spec.seed)
        model = builder(weights=None, weights_backbone=None, **spec.builder_kwargs)
        if spec.checkpoint:
            load_state_dict(model, Path(spec.checkpoint), spec.device)
        model = model.eval().to(spec.device)
        notes = [] if spec.checkpoint else [f"random weights (seed {spec.seed})"]
        return LoadedModel(entry=model, root=model, source_root=self.source_root(spec),
                           weights=spec.checkpoint or "random", notes=notes)

    def load_inputs(self, inputs: ImageInputs, base_dir: Path) -> list[Image.Image]:
        images = load_video(inputs.images, inputs.count, base_dir=base_dir)
        if inputs.width is None and inputs.height is None:
            return images
        return [image.resize((inputs.width or image.width, inputs.height or image.height), Image.BILINEAR)
                for image in images]

    def prepare(self, loaded: LoadedModel, data: list[Image.Image], inputs: ImageInputs,
                verification: DetectionVerification) -> list[str]:
        if not verification.calibrate_batch_norm:
            return []
        norms = [m for m in loaded.root.modules() if isinstance(m, torch.nn.BatchNorm2d)]
        for norm in norms:  # a cumulative average over the images, the rest of the model in eval mode
            norm.reset_running_stats()
            norm.momentum = None
            norm.train()
        with torch.no_grad():
            loaded.entry([_tensor(image) for image in data])
        for norm in norms:
            norm.eval()
        return [f"BatchNorm statistics of {len(norms)} layers estimated from the {len(data)} task images"]

    def run_main_path(self, loaded: LoadedModel, data: list[Image.Image], inputs: ImageInputs,
                      verification: DetectionVerification, hooks: RunHooks) -> MainPathRun:
        model, steps = loaded.entry, []
        start = time.perf_counter()
        with mock.patch.object(model.roi_heads, "score_thresh", verification.min_score), \
                mock.patch.object(model.roi_heads, "detections_per_img", verification.detections_per_image), \
                torch.no_grad():
            for index, image in enumerate(data):
                t0 = time.perf_counter()
                [found] = model([_tensor(image)])
                steps.append(StepOutput(index=index, seconds=time.perf_counter() - t0,
                                        outputs={name: found[name].cpu().numpy() for name in ("boxes", "labels", "scores")}))
                hooks.step(index)
        return MainPathRun(steps=steps, setup_seconds=0.0, total_seconds=time.perf_counter() - start)

    def comparison(self, verification: DetectionVerification) -> list[OutputCheck]:
        return [
            OutputCheck(output="labels", metric="exact", label="labels"),
            OutputCheck(output="boxes", metric="max_abs", threshold=1e-2, label="boxes (pixels)"),
            OutputCheck(output="scores", metric="max_abs", threshold=1e-4, label="scores"),
        ]

    def settings_notes(self, verification: DetectionVerification) -> list[str]:
        notes = [f"min_score={verification.min_score}, detections_per_image={verification.detections_per_image}: "
                 "the best detections are kept whatever their score"]
        if verification.calibrate_batch_norm:
            notes.append("calibrate_batch_norm: BatchNorm statistics estimated from the task's images")
        return notes

    def picture(self, data: list[Image.Image], step: StepOutput, title: str) -> Image.Image:
        boxes = step.outputs["boxes"]
        xywh = [[x0, y0, x1 - x0, y1 - y0] for x0, y0, x1, y1 in boxes.tolist()]
        return draw_instances(data[step.index], [int(label) for label in step.outputs["labels"]], None, xywh,
                              f"{title} labels {step.outputs['labels'].tolist()}", normalised=False)
