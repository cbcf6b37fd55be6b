"""timm image classifiers as their users call them: timm's preprocessing, the model, softmax top-k.

One two-function driver for every `timm.create_model` name (the record's `intake.model.builder`,
with `builder_kwargs` for a small config). Each step is one image of `intake.inputs.images`:
`resolve_data_config` + `create_transform` (resize, centre crop, normalise) on the PIL image at
`size` x `size`, the model, then softmax and top-k; the transform and the top-k stay in Python.

Weights are random from the config (`pretrained=False`). A random network with BatchNorm keeps
its default running statistics (mean 0, variance 1) and shrinks its activations layer after
layer (EfficientNet's logits come out near 1e-5), so `build_model` estimates them once from the
built-in clip's frames, the same way every time: the logits then vary as a trained model's do.
"""

from __future__ import annotations

import timm
import torch
from omskills.models.kit import InputPath, OutputCheck, calibrate_batch_norm, load_video
from pydantic import BaseModel, ConfigDict, Field
from timm.data import create_transform, resolve_data_config

FAMILY = "timm-classifier"
STEP_NAME = "image"
CALIBRATION_FRAMES = 4


class Inputs(BaseModel):
    """Images to classify (frames of a video, a folder, or a built-in clip) at size x size."""

    model_config = ConfigDict(extra="forbid")

    images: InputPath = "builtin:shapes"
    count: int = Field(2, ge=1)
    size: int = Field(128, ge=32)
    top_k: int = Field(5, ge=1)


COMPARISON = [
    OutputCheck(output="logits", metric="tensor", label="class logits"),
    OutputCheck(output="top_probs", metric="tensor", label="top-k probabilities"),
    OutputCheck(output="top_ids", metric="exact", label="top-k class ids"),
]


def _transform(model: torch.nn.Module, size: int):
    return create_transform(**resolve_data_config({"input_size": (3, size, size)}, model=model))


def _calibrate_batch_norm(model: torch.nn.Module, size: int) -> None:
    """BatchNorm statistics as a cumulative average over a few frames of the built-in clip."""
    transform = _transform(model, size)
    batch = torch.stack([transform(image) for image in load_video("builtin:shapes", CALIBRATION_FRAMES)])
    calibrate_batch_norm(model, lambda: model(batch))


def build_model(spec):
    if not spec.builder:
        raise ValueError("intake.model.builder: name a timm model (e.g. convnext_atto)")
    model = timm.create_model(spec.builder, pretrained=False, **spec.builder_kwargs).eval()
    _calibrate_batch_norm(model, model.pretrained_cfg.get("input_size", (3, 224, 224))[-1])
    return model


def run_main_path(model, inputs: Inputs):
    transform = _transform(model, inputs.size)
    for image in load_video(inputs.images, inputs.count):
        logits = model(transform(image)[None])
        top = logits.softmax(-1).topk(inputs.top_k)
        yield {"logits": logits[0], "top_probs": top.values[0], "top_ids": top.indices[0]}
