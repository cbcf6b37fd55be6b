"""torchvision's video classifiers (MC3-18 by default; R3D-18, R(2+1)D-18 by builder) as a two-function driver.

The entry users call is the weights' recipe: the video preprocessing of the builder's weights
enum (resize, centre crop, normalise, frames to channels-first; the enum only supplies the recipe,
nothing is downloaded), one batched forward over clips of consecutive frames, then softmax and
top-k in Python. Weights are random (`weights=None`); the study ranks the module tree.
"""

from types import SimpleNamespace

import numpy as np
import torch
from omskills.models.kit import load_video
from pydantic import BaseModel, ConfigDict, Field
from torchvision.models import get_model_weights, video

DEFAULT_BUILDER = "mc3_18"


class Inputs(BaseModel):
    """`clips` clips of `frames` consecutive frames of the built-in clip (or a video), cropped to size x size."""

    model_config = ConfigDict(extra="forbid")

    video: str = "builtin:shapes"
    clips: int = Field(2, ge=1)
    frames: int = Field(8, ge=8)  # the network halves time three times
    size: int = Field(112, ge=64)
    top_k: int = Field(5, ge=1)


COMPARISON = [
    {"output": "logits", "metric": "tensor", "label": "logits"},
    {"output": "probabilities", "metric": "max_abs", "threshold": 1e-5, "label": "top-k probabilities"},
    # Random weights give close logits: the order of close classes may flip, so reported only.
    {"output": "classes", "metric": "exact", "gating": False, "label": "top-k class ids"},
]


def build_model(spec):
    name = spec.builder or DEFAULT_BUILDER
    if not hasattr(video, name):
        raise ValueError(f"intake.model.builder: torchvision.models.video has no {name!r}")
    model = getattr(video, name)(weights=None, **spec.builder_kwargs)
    # What users call: the weights' preprocessing recipe and the network (the tree to cut).
    return SimpleNamespace(recipe=get_model_weights(name).DEFAULT.transforms, network=model), model


def run_main_path(classifier, inputs):
    # The recipe's default (resize 128x171, crop 112) scaled to the asked crop size.
    preprocess = classifier.recipe(
        crop_size=(inputs.size, inputs.size),
        resize_size=(round(inputs.size * 128 / 112), round(inputs.size * 171 / 112)),
    )
    frames = load_video(inputs.video, inputs.clips * inputs.frames, field="intake.inputs.video")
    pixels = torch.from_numpy(np.stack([np.asarray(frame) for frame in frames])).permute(0, 3, 1, 2)  # T, C, H, W uint8
    clips = preprocess(pixels.reshape(inputs.clips, inputs.frames, *pixels.shape[1:]))  # N, C, T, H, W
    logits = classifier.network(clips)
    probabilities, classes = logits.softmax(-1).topk(inputs.top_k, dim=-1)
    return {"logits": logits, "probabilities": probabilities, "classes": classes}
