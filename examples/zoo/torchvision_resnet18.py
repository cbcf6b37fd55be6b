"""torchvision's ResNet-18 classifier as a two-function driver: images in, top-k classes out.

The entry users call is the classifier's own recipe: the weights' preprocessing (resize, centre
crop, normalise), one batched forward, then softmax and top-k in Python. Weights are random
(`weights=None`); no seed candidates, the study ranks the module tree.
"""

import torch
import torchvision
from omskills.models.kit import load_video
from pydantic import BaseModel, ConfigDict, Field


class Inputs(BaseModel):
    """A batch of frames of the built-in clip (or a video / folder), cropped to size x size."""

    model_config = ConfigDict(extra="forbid")

    images: str = "builtin:shapes"
    count: int = Field(3, ge=1)
    size: int = Field(160, ge=32)
    top_k: int = Field(5, ge=1)


COMPARISON = [
    {"output": "logits", "metric": "tensor", "label": "logits"},
    {"output": "probabilities", "metric": "max_abs", "threshold": 1e-4, "label": "top-k probabilities"},
    # Random weights give near-flat logits: the order of close classes may flip, so reported only.
    {"output": "classes", "metric": "exact", "gating": False, "label": "top-k class ids"},
]


def build_model(spec):
    return torchvision.models.resnet18(weights=None, **spec.builder_kwargs)


def run_main_path(model, inputs):
    # The weights enum only supplies the preprocessing recipe here; nothing is downloaded.
    preprocess = torchvision.models.ResNet18_Weights.DEFAULT.transforms(crop_size=inputs.size, resize_size=inputs.size)
    images = load_video(inputs.images, inputs.count, field="intake.inputs.images")
    logits = model(torch.stack([preprocess(image) for image in images]))
    probabilities, classes = logits.softmax(-1).topk(inputs.top_k, dim=-1)
    return {"logits": logits, "probabilities": probabilities, "classes": classes}
