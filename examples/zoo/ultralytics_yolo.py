"""Ultralytics YOLO detectors (built from their model yaml, random weights) as an omskills driver.

The entry users call is `YOLO.predict(images, imgsz=..., conf=..., max_det=...)`: letterbox
pre-processing, the network, then NMS and the scaling of boxes back to the image stay in Python.
The predictor runs a Conv+BatchNorm-fused deep copy of `YOLO.model` (`predictor.model.backend.model`),
so that copy is the root the engine cuts; `load` makes the predictor once so it exists. `YoloDriver`
lets the profile pick the heaviest layers; `YoloNetworkDriver` cuts the whole network as one graph.

Random weights need one verification setting, as torchvision's detectors do: with the default
BatchNorm statistics the activations vanish and every anchor gets the head's bias as its score
(every box ties). `calibrate_batch_norm` estimates the statistics from the task's letterboxed
images on the unfused model and loads the re-fused weights into the predictor's copy.

Ultralytics reads `YOLO_CONFIG_DIR` and `YOLO_OFFLINE` when first imported: both are set here, before
that import, so it writes no settings file in the home folder and downloads nothing; `YOLO_VERBOSE`
off keeps its logger (which writes to stdout) quiet.
"""

from __future__ import annotations

import copy
import os
import tempfile
import time
from pathlib import Path
from unittest import mock

os.environ.setdefault("YOLO_CONFIG_DIR", str(Path(tempfile.gettempdir()) / "omskills-ultralytics"))
os.environ.setdefault("YOLO_OFFLINE", "1")
os.environ.setdefault("YOLO_VERBOSE", "False")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from omskills.models.kit import (  # noqa: E402
    FP16_GATES,
    InputPath,
    LoadedModel,
    MainPathRun,
    ModelDriver,
    ModelSpec,
    OutputCheck,
    RunHooks,
    SeedCandidate,
    StepOutput,
    calibrate_batch_norm,
    draw_instances,
    load_state_dict,
    load_video,
    package_root,
)
from PIL import Image  # noqa: E402
from pydantic import BaseModel, ConfigDict, Field  # noqa: E402

DEFAULT_CONFIG = "yolov8n.yaml"


class YoloInputs(BaseModel):
    """Images and the arguments of `predict` that shape its work."""

    model_config = ConfigDict(extra="forbid")

    images: InputPath = "builtin:shapes"
    count: int = Field(2, ge=1)
    imgsz: int = Field(320, ge=64, multiple_of=32)  # letterboxed to this long side (stride 32)
    conf: float = Field(1e-6, ge=0.0, le=1.0)  # tiny: random weights still give max_det boxes
    iou: float = Field(0.7, gt=0.0, le=1.0)
    max_det: int = Field(10, ge=1)


class YoloVerification(BaseModel):
    model_config = ConfigDict(extra="forbid")

    calibrate_batch_norm: bool = True


def _bgr(image: Image.Image) -> np.ndarray:
    """What ultralytics expects from numpy sources (cv2's channel order)."""
    return np.ascontiguousarray(np.asarray(image.convert("RGB"))[..., ::-1])


class YoloDriver(ModelDriver):
    family = "ultralytics-yolo"
    description = (
        "ultralytics YOLO detectors from their model yaml: images in, boxes/scores/classes out (NMS in Python)"
    )
    inputs_model = YoloInputs
    verification_model = YoloVerification
    step_name = "image"
    entry_methods = ("predict",)
    entry_classes = ("YOLO", "DetectionPredictor")

    def source_root(self, spec: ModelSpec) -> Path:
        return package_root(spec.source, "ultralytics")

    def source_package(self, spec: ModelSpec) -> str:
        return "ultralytics"

    def builder_name(self, spec: ModelSpec) -> str:
        """The function that turns a model yaml into layers (the static inventory starts there)."""
        return spec.builder or "parse_model"

    def load(self, spec: ModelSpec) -> LoadedModel:
        from ultralytics import YOLO

        torch.manual_seed(spec.seed)
        config = spec.builder_kwargs.get("config", DEFAULT_CONFIG)  # a yaml shipped in the wheel: yolo11n.yaml, ...
        yolo = YOLO(config, task="detect")
        if spec.checkpoint:
            load_state_dict(yolo.model, Path(spec.checkpoint), spec.device)
        # The first predict makes the predictor and its fused copy of the model: the module users run.
        yolo.predict(np.zeros((64, 64, 3), np.uint8), imgsz=64, device=spec.device, verbose=False)
        root = yolo.predictor.model.backend.model
        return LoadedModel(
            entry=yolo,
            root=root,
            source_root=self.source_root(spec),
            weights=spec.checkpoint or "random",
            notes=[] if spec.checkpoint else [f"random weights (seed {spec.seed})"],
        )

    def load_inputs(self, inputs: YoloInputs, base_dir: Path) -> list[Image.Image]:
        return load_video(inputs.images, inputs.count, base_dir=base_dir, field="images")

    def prepare(
        self, loaded: LoadedModel, data: list[Image.Image], inputs: YoloInputs, verification: YoloVerification
    ) -> list[str]:
        if not verification.calibrate_batch_norm:
            return []
        from ultralytics.data.augment import LetterBox

        yolo = loaded.entry
        letterbox = LetterBox((inputs.imgsz, inputs.imgsz), auto=True, stride=32)
        batch = (
            torch.stack(
                [torch.from_numpy(letterbox(image=_bgr(image))[..., ::-1].copy()).permute(2, 0, 1) for image in data]
            ).float()
            / 255.0
        )
        layers = calibrate_batch_norm(yolo.model, lambda: yolo.model(batch.to(next(yolo.model.parameters()).device)))
        fused = copy.deepcopy(yolo.model).fuse(verbose=False)
        network = yolo.predictor.model.backend.model
        network = network.network if isinstance(network, _Holder) else network
        network.load_state_dict(fused.state_dict())  # same structure: the predictor's copy was fused alike
        return [
            f"BatchNorm statistics of {layers} layers estimated from the {len(data)} task images, "
            "then fused into the predictor's model"
        ]

    def run_main_path(
        self,
        loaded: LoadedModel,
        data: list[Image.Image],
        inputs: YoloInputs,
        verification: YoloVerification,
        hooks: RunHooks,
    ) -> MainPathRun:
        from ultralytics.utils import nms

        steps = []
        start = time.perf_counter()
        before_nms: dict[str, np.ndarray] = {}
        original = nms.non_max_suppression

        def suppressed(prediction, *args, **kwargs):
            raw = (
                prediction[0] if isinstance(prediction, (list, tuple)) else prediction
            )  # [batch, 4 + classes, anchors]
            before_nms["boxes_before_nms"] = raw[:, :4].detach().float().cpu().numpy()
            before_nms["class_scores_before_nms"] = raw[:, 4:].detach().float().cpu().numpy()
            return original(prediction, *args, **kwargs)

        with mock.patch.object(nms, "non_max_suppression", suppressed):
            for index, image in enumerate(data):
                t0 = time.perf_counter()
                [result] = loaded.entry.predict(
                    _bgr(image),
                    imgsz=inputs.imgsz,
                    conf=inputs.conf,
                    iou=inputs.iou,
                    max_det=inputs.max_det,
                    verbose=False,
                )
                boxes = result.boxes
                outputs = {
                    "boxes": boxes.xyxy.cpu().numpy(),
                    "scores": boxes.conf.cpu().numpy(),
                    "classes": boxes.cls.cpu().numpy().astype(np.int64),
                }
                steps.append(StepOutput(index=index, seconds=time.perf_counter() - t0, outputs=outputs | before_nms))
                before_nms.clear()
                hooks.step(index)
        return MainPathRun(steps=steps, setup_seconds=0.0, total_seconds=time.perf_counter() - start)

    def precision_checks(self, verification: YoloVerification) -> list[OutputCheck]:
        """Under fp16, the predictions before NMS decide (every anchor's box and class scores), held to
        fp16's gates; which boxes NMS keeps flips on near-ties that random weights make everywhere:
        the kept detections are reported beside them."""
        return [
            OutputCheck(
                output="class_scores_before_nms", metric="tensor", gates=FP16_GATES, label="class scores before NMS"
            ),
            OutputCheck(
                output="boxes_before_nms", metric="tensor", gates=FP16_GATES, label="boxes before NMS (pixels)"
            ),
            *(c.model_copy(update={"gating": False}) for c in self.comparison(verification)),
        ]

    def comparison(self, verification: YoloVerification) -> list[OutputCheck]:
        return [
            OutputCheck(output="classes", metric="exact", label="classes"),
            OutputCheck(output="boxes", metric="max_abs", threshold=1e-2, label="boxes (pixels)"),
            OutputCheck(output="scores", metric="max_abs", threshold=1e-4, label="scores"),
        ]

    def settings_notes(self, verification: YoloVerification) -> list[str]:
        if verification.calibrate_batch_norm:
            return ["calibrate_batch_norm: BatchNorm statistics estimated from the task's images"]
        return []

    def picture(self, data: list[Image.Image], step: StepOutput, title: str) -> Image.Image:
        xywh = [[x0, y0, x1 - x0, y1 - y0] for x0, y0, x1, y1 in step.outputs["boxes"].tolist()]
        classes = [int(c) for c in step.outputs["classes"]]
        return draw_instances(data[step.index], classes, None, xywh, f"{title} classes {classes}", normalised=False)


class _Holder(torch.nn.Module):
    """The network as a child module: the engine splices a candidate into its parent, and the root
    itself has none."""

    def __init__(self, network: torch.nn.Module) -> None:
        super().__init__()
        self.network = network

    def forward(self, *args, **kwargs):
        return self.network(*args, **kwargs)


class YoloNetworkDriver(YoloDriver):
    """The same, cut as one graph: the whole network (letterboxed batch in, raw predictions out, what
    ultralytics itself exports) instead of the heaviest layers the profile ranks. The predictor's
    backend is given a holder of its network, so that the network is a child the engine can replace."""

    def load(self, spec: ModelSpec) -> LoadedModel:
        loaded = super().load(spec)
        backend = loaded.entry.predictor.model.backend
        backend.model = loaded.root = _Holder(backend.model)
        return loaded

    def seed_candidates(self) -> list[SeedCandidate]:
        return [SeedCandidate("detector", "network", "the whole network; letterbox and NMS stay in Python")]
