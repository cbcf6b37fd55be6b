"""CLIP zero-shot classification with open_clip, as its users call it: a two-function driver.

Each step is one image of `intake.inputs.images` classified against the same prompt set, the way
open_clip's README does it: `tokenizer(prompts)` -> `model.encode_text`, `preprocess(image)` ->
`model.encode_image`, both normalised, `100 * image @ text.T` and a softmax in Python. The prompts
are encoded again for every image, as such a loop does; the deployed text tower answers the repeats
from memory (its input is the token embedding plus the positional embedding, its mask a buffer:
values derived from the prompt and the model's constants alone, splicing.memo).

The model is open_clip's `CLIP` class built by `open_clip.create_model(builder, pretrained=None)`
from the built-in config `intake.model.builder` names (ViT-B-32) with a tiny config over it (2 + 2
layers, widths 64 and 32, 64x64 images, 16-token context; `builder_kwargs` override it), at every
scale: random weights, no download. The tokenizer is open_clip's own BPE, whose vocabulary the
wheel ships (`open_clip/bpe_simple_vocab_16e6.txt.gz`), so the vocabulary keeps its 49,408 tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import open_clip
import torch
from omskills.models.kit import InputPath, OutputCheck, load_video
from pydantic import BaseModel, ConfigDict, Field

FAMILY = "open-clip-zero-shot"
STEP_NAME = "image"
SEED_CANDIDATES = [("text_tower", "transformer"), ("image_tower", "visual")]
TINY_CONFIG: dict[str, Any] = {
    "embed_dim": 32,
    "vision_cfg": {"image_size": 64, "layers": 2, "width": 64, "head_width": 32, "patch_size": 16},
    "text_cfg": {"context_length": 16, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 2},
}
COMPARISON = [
    OutputCheck(output="logits", metric="tensor", label="100 x cosine of the image with each prompt"),
    OutputCheck(output="probs", metric="tensor", label="zero-shot probabilities"),
    OutputCheck(output="text_features", metric="tensor", label="prompt embeddings (normalised)"),
    OutputCheck(output="image_features", metric="tensor", label="image embedding (normalised)"),
]


class Inputs(BaseModel):
    """Images to classify (frames of a video, a folder, or a built-in clip) and the prompt set."""

    model_config = ConfigDict(extra="forbid")

    images: InputPath = "builtin:shapes"
    count: int = Field(2, ge=1)
    prompts: list[str] = Field(min_length=1)


@dataclass
class ZeroShot:
    """What a user holds: the model, its image preprocessing and its tokenizer."""

    model: torch.nn.Module
    preprocess: Any
    tokenizer: Any


def build_model(spec):
    name = spec.builder or "ViT-B-32"
    config = TINY_CONFIG | spec.builder_kwargs
    model, _, preprocess = open_clip.create_model_and_transforms(name, pretrained=None, **config)
    tokenizer = open_clip.get_tokenizer(name, context_length=model.context_length)
    return ZeroShot(model.eval(), preprocess, tokenizer), model


def run_main_path(clip: ZeroShot, inputs: Inputs):
    for image in load_video(inputs.images, inputs.count):
        text = clip.tokenizer(inputs.prompts)
        image_features = clip.model.encode_image(clip.preprocess(image).unsqueeze(0))
        text_features = clip.model.encode_text(text)
        image_features = image_features / image_features.norm(dim=-1, keepdim=True)
        text_features = text_features / text_features.norm(dim=-1, keepdim=True)
        logits = 100.0 * image_features @ text_features.T
        yield {
            "logits": logits[0],
            "probs": logits.softmax(dim=-1)[0],
            "text_features": text_features,
            "image_features": image_features[0],
        }
