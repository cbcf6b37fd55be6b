"""torchvision's detectors (RetinaNet, FCOS, SSD, Mask / Keypoint R-CNN, Faster R-CNN) as one driver.

The entry users call is the detector itself: `model([image])` returns boxes, labels and scores,
plus masks (Mask R-CNN) or keypoints (Keypoint R-CNN). Around the network sits the Python control
plane the engine must leave alone: the transform (resize, normalise, batch), anchors, box
decoding, top-k and NMS, RoI pooling and the mask / keypoint post-processing. The builder comes
from the record (`intake.model.builder`, a function of `torchvision.models.detection`); the
driver names no seed candidates, the study ranks the module tree from a profile.

The frames are resized to width x height before the detector's own transform sees them, so the
record's sizes decide the image size the networks run on (the aspect ratio, after the transform
rescales to `min_size` / `max_size`).

Random weights need the example's two verification settings: `calibrate_batch_norm` estimates
BatchNorm statistics from the task's images (default statistics shrink a random backbone's
activations until every score ties), and `min_score` / `detections_per_image` replace the
model's own `score_thresh` / `detections_per_img` (on the RoI heads for the R-CNNs, on the
model for the one-stage detectors) so a fixed number of detections is kept whatever their score.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar
from unittest import mock

import numpy as np
import torch
from omskills.models.kit import (
    FP16_GATES,
    InputPath,
    LoadedModel,
    MainPathRun,
    ModelDriver,
    ModelSpec,
    OutputCheck,
    RunHooks,
    StepOutput,
    calibrate_batch_norm,
    draw_instances,
    load_state_dict,
    load_video,
    package_root,
)
from PIL import Image
from pydantic import BaseModel, ConfigDict, Field

DEFAULT_BUILDER = "retinanet_resnet50_fpn"


class DetectionInputs(BaseModel):
    """Frames of a video, a folder of images or a built-in clip, resized to width x height."""

    model_config = ConfigDict(extra="forbid")

    images: InputPath = "builtin:shapes"
    count: int = Field(2, ge=1)
    width: int = Field(240, ge=32)
    height: int = Field(180, ge=32)


class DetectionVerification(BaseModel):
    model_config = ConfigDict(extra="forbid")

    calibrate_batch_norm: bool = True
    min_score: float = Field(0.0, ge=0.0, le=1.0)  # replaces the model's score_thresh
    detections_per_image: int = Field(10, ge=1)  # replaces the model's detections_per_img


def _tensor(image: Image.Image) -> torch.Tensor:
    return torch.from_numpy(np.array(image.convert("RGB"))).permute(2, 0, 1).float() / 255.0


def _postprocessor(model: torch.nn.Module) -> torch.nn.Module:
    """Where the detector keeps score_thresh / detections_per_img: the RoI heads of a two-stage
    detector, the model itself for the one-stage ones."""
    return getattr(model, "roi_heads", model)


class TorchvisionDetector(ModelDriver):
    family = "torchvision-detection"
    description = "torchvision detectors (RetinaNet, FCOS, SSD, Faster/Mask/Keypoint R-CNN): images in, instances out"
    inputs_model = DetectionInputs
    verification_model = DetectionVerification
    step_name = "image"
    entry_methods = ("forward",)
    entry_classes = ("GeneralizedRCNN", "FasterRCNN", "MaskRCNN", "KeypointRCNN", "RetinaNet", "FCOS", "SSD")
    # Checks of the outputs only some detectors have (masks, keypoints), set by the subclasses.
    extra_checks: ClassVar[tuple[OutputCheck, ...]] = ()

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
        return LoadedModel(
            entry=model,
            root=model,
            source_root=self.source_root(spec),
            weights=spec.checkpoint or "random",
            notes=notes,
        )

    def load_inputs(self, inputs: DetectionInputs, base_dir: Path) -> list[Image.Image]:
        frames = load_video(inputs.images, inputs.count, base_dir=base_dir, field="intake.inputs.images")
        return [frame.resize((inputs.width, inputs.height), Image.BILINEAR) for frame in frames]

    def prepare(
        self, loaded: LoadedModel, data: list[Image.Image], inputs: DetectionInputs, verification: DetectionVerification
    ) -> list[str]:
        if not verification.calibrate_batch_norm:
            return []
        layers = calibrate_batch_norm(loaded.root, lambda: loaded.entry([_tensor(image) for image in data]))
        return [f"BatchNorm statistics of {layers} layers estimated from the {len(data)} task images"]

    def run_main_path(
        self,
        loaded: LoadedModel,
        data: list[Image.Image],
        inputs: DetectionInputs,
        verification: DetectionVerification,
        hooks: RunHooks,
    ) -> MainPathRun:
        model, steps = loaded.entry, []
        post = _postprocessor(model)
        start = time.perf_counter()
        before_nms: dict[str, np.ndarray] = {}
        with (
            mock.patch.object(post, "score_thresh", verification.min_score),
            mock.patch.object(post, "detections_per_img", verification.detections_per_image),
            _scores_before_nms(model, before_nms),
            torch.no_grad(),
        ):
            for index, image in enumerate(data):
                t0 = time.perf_counter()
                [found] = model([_tensor(image)])
                outputs = {name: value.cpu().numpy() for name, value in found.items()}
                steps.append(StepOutput(index=index, seconds=time.perf_counter() - t0, outputs=outputs | before_nms))
                before_nms.clear()
                hooks.step(index)
        return MainPathRun(steps=steps, setup_seconds=0.0, total_seconds=time.perf_counter() - start)

    def comparison(self, verification: DetectionVerification) -> list[OutputCheck]:
        # Every detector: the same instances (labels), where (boxes, pixels) and how sure (scores).
        # Mask R-CNN's pasted mask probabilities and Keypoint R-CNN's keypoint scores are continuous
        # (tensor); keypoint positions are heatmap argmaxes put back in pixels (max_abs).
        return [
            OutputCheck(output="labels", metric="exact", label="labels"),
            OutputCheck(output="boxes", metric="max_abs", threshold=1e-2, label="boxes (pixels)"),
            OutputCheck(output="scores", metric="max_abs", threshold=1e-4, label="scores"),
            *self.extra_checks,
        ]

    def precision_checks(self, verification: DetectionVerification) -> list[OutputCheck]:
        """Under fp16, the continuous values before NMS decide: a one-stage detector's class logits
        over every anchor, a two-stage detector's RPN objectness over every anchor, held to fp16's
        gates. What NMS keeps flips on ties that random weights make everywhere: the RoI head's
        logits (over the proposals NMS kept) and the kept instances are reported beside them."""
        gating = [
            OutputCheck(output=name, metric="tensor", gates=FP16_GATES, optional=True, label=label)
            for name, label in (
                ("class_logits", "class logits before NMS (one-stage)"),
                ("rpn_objectness", "RPN objectness before NMS (two-stage)"),
            )
        ]
        roi = OutputCheck(
            output="roi_class_logits",
            metric="tensor",
            gates=FP16_GATES,
            optional=True,
            gating=False,
            label="RoI class logits (two-stage)",
        )
        return [*gating, roi, *(c.model_copy(update={"gating": False}) for c in self.comparison(verification))]

    def settings_notes(self, verification: DetectionVerification) -> list[str]:
        notes = [
            f"min_score={verification.min_score}, detections_per_image={verification.detections_per_image}: "
            "the best detections are kept whatever their score"
        ]
        if verification.calibrate_batch_norm:
            notes.append("calibrate_batch_norm: BatchNorm statistics estimated from the task's images")
        return notes

    def picture(self, data: list[Image.Image], step: StepOutput, title: str) -> Image.Image:
        boxes = step.outputs["boxes"]
        xywh = [[x0, y0, x1 - x0, y1 - y0] for x0, y0, x1, y1 in boxes.tolist()]
        return draw_instances(
            data[step.index],
            [int(label) for label in step.outputs["labels"]],
            None,
            xywh,
            f"{title} labels {step.outputs['labels'].tolist()}",
            normalised=False,
        )


@contextlib.contextmanager
def _scores_before_nms(model: torch.nn.Module, captured: dict[str, np.ndarray]) -> Iterator[None]:
    """Fill `captured` on each call with the scores the post-processing ranks before its threshold
    and NMS: the class logits (`postprocess_detections`' first argument: a tensor for the RoI
    heads, the head's outputs for a one-stage detector) and a two-stage detector's RPN objectness."""
    post = _postprocessor(model)
    original = post.postprocess_detections

    def ranked(first, *args, **kwargs):
        # A one-stage detector's head scores every anchor; a two-stage one's RoI head scores the
        # proposals its RPN kept after NMS, which fp16 can change: named apart.
        name, logits = ("class_logits", first["cls_logits"]) if isinstance(first, dict) else ("roi_class_logits", first)
        captured[name] = _flat(logits).detach().float().cpu().numpy()
        return original(first, *args, **kwargs)

    def objectness(module, inputs, output):
        levels = output[0]
        captured["rpn_objectness"] = torch.cat([t.flatten() for t in levels]).detach().float().cpu().numpy()

    rpn = getattr(model, "rpn", None)
    handle = rpn.head.register_forward_hook(objectness) if rpn is not None else None
    try:
        with mock.patch.object(post, "postprocess_detections", ranked):
            yield
    finally:
        if handle is not None:
            handle.remove()


def _flat(value) -> torch.Tensor:
    """A tensor, or the nested lists RetinaNet and FCOS split their head outputs into (per image,
    per level), as one flat tensor."""
    if isinstance(value, torch.Tensor):
        return value
    return torch.cat([_flat(v).flatten() for v in value])


class TorchvisionMaskDetector(TorchvisionDetector):
    """Mask R-CNN: the pasted per-instance mask probabilities are compared too."""

    extra_checks = (OutputCheck(output="masks", metric="tensor", label="mask probabilities"),)


class TorchvisionKeypointDetector(TorchvisionDetector):
    """Keypoint R-CNN: the keypoints (pixels) and their heatmap scores are compared too."""

    extra_checks = (
        OutputCheck(output="keypoints_scores", metric="tensor", label="keypoint scores"),
        OutputCheck(output="keypoints", metric="max_abs", threshold=1e-2, label="keypoints (pixels)"),
    )
