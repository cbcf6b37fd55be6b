"""transformers' DETR object detector with its image processor and post-processing, as a driver class.

The entry users call: `DetrImageProcessor(images=...)` (resize so the shorter side is `size`,
normalise, pixel mask), `DetrForObjectDetection(**inputs)`, then
`processor.post_process_object_detection(outputs, threshold, target_sizes)` (softmax, best class
per query, boxes scaled back to the image). One step per image of `intake.inputs.images`.

Weights are random from a small config (a 4-stage basic-block ResNet backbone from
`ResNetConfig`, 2 + 2 transformer layers of width 64, 20 queries; `builder_kwargs` override
DetrConfig fields). Two verification settings make random weights exercise the post-processing:
the object queries are drawn from N(0, query_std) (at the config's init_std every query sees the
same attention and gets the same box), and `min_score` 0 keeps every query's detection.
"""

from __future__ import annotations

import time
from pathlib import Path

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
    load_video,
    package_root,
)
from PIL import Image
from pydantic import BaseModel, ConfigDict, Field

TINY_CONFIG = dict(
    d_model=64,
    encoder_layers=2,
    decoder_layers=2,
    encoder_attention_heads=2,
    decoder_attention_heads=2,
    encoder_ffn_dim=128,
    decoder_ffn_dim=128,
    num_queries=20,
    num_labels=10,
    init_std=0.1,
)
BACKBONE = dict(
    embedding_size=32, hidden_sizes=[32, 64, 128, 256], depths=[1, 1, 1, 1], layer_type="basic", out_features=["stage4"]
)


class DetrInputs(BaseModel):
    """Images to detect in (frames of a video, a folder, a built-in clip); shorter side resized to size."""

    model_config = ConfigDict(extra="forbid")

    images: InputPath = "builtin:shapes"
    count: int = Field(2, ge=1)
    size: int = Field(128, ge=32)


class DetrVerification(BaseModel):
    model_config = ConfigDict(extra="forbid")

    query_std: float = Field(3.0, gt=0)  # std of the re-drawn object queries
    min_score: float = Field(0.0, ge=0.0, le=1.0)  # post_process_object_detection's threshold


class DetrDriver(ModelDriver):
    family = "hf-detr"
    description = (
        "transformers DetrForObjectDetection (small config, random) with DetrImageProcessor and its post-processing"
    )
    inputs_model = DetrInputs
    verification_model = DetrVerification
    step_name = "image"

    def source_root(self, spec: ModelSpec) -> Path:
        return package_root(spec.source, "transformers")

    def load(self, spec: ModelSpec) -> LoadedModel:
        from transformers import DetrConfig, DetrForObjectDetection, ResNetConfig

        torch.manual_seed(spec.seed)
        config = DetrConfig(backbone_config=ResNetConfig(**BACKBONE), **(TINY_CONFIG | spec.builder_kwargs))
        model = DetrForObjectDetection(config).eval().to(spec.device)
        return LoadedModel(
            entry=model,
            root=model,
            source_root=self.source_root(spec),
            weights="random",
            notes=[f"random weights (seed {spec.seed})"],
        )

    def load_inputs(self, inputs: DetrInputs, base_dir: Path) -> list[Image.Image]:
        return load_video(inputs.images, inputs.count, base_dir=base_dir)

    def prepare(
        self, loaded: LoadedModel, data: list[Image.Image], inputs: DetrInputs, verification: DetrVerification
    ) -> list[str]:
        queries = loaded.root.model.query_position_embeddings.weight
        generator = torch.Generator().manual_seed(0)
        with torch.no_grad():
            queries.copy_(torch.randn(queries.shape, generator=generator) * verification.query_std)
        return [f"object queries drawn from N(0, {verification.query_std})"]

    def run_main_path(
        self,
        loaded: LoadedModel,
        data: list[Image.Image],
        inputs: DetrInputs,
        verification: DetrVerification,
        hooks: RunHooks,
    ) -> MainPathRun:
        from transformers import DetrImageProcessor

        processor = DetrImageProcessor(size={"shortest_edge": inputs.size, "longest_edge": 2 * inputs.size})
        steps, start = [], time.perf_counter()
        with torch.no_grad():
            for index, image in enumerate(data):
                t0 = time.perf_counter()
                batch = processor(images=image, return_tensors="pt").to(loaded.root.device)
                outputs = loaded.entry(**batch)
                [found] = processor.post_process_object_detection(
                    outputs, threshold=verification.min_score, target_sizes=[image.size[::-1]]
                )
                steps.append(
                    StepOutput(
                        index=index,
                        seconds=time.perf_counter() - t0,
                        outputs={k: found[k].cpu().numpy() for k in ("boxes", "labels", "scores")},
                    )
                )
                hooks.step(index)
        return MainPathRun(steps=steps, setup_seconds=0.0, total_seconds=time.perf_counter() - start)

    def comparison(self, verification: DetrVerification) -> list[OutputCheck]:
        return [
            OutputCheck(output="labels", metric="exact", label="labels"),
            OutputCheck(output="boxes", metric="max_abs", threshold=1e-2, label="boxes (pixels)"),
            OutputCheck(output="scores", metric="max_abs", threshold=1e-4, label="scores"),
        ]

    def settings_notes(self, verification: DetrVerification) -> list[str]:
        return [
            f"object queries drawn from N(0, {verification.query_std}); min_score={verification.min_score}: "
            "every query's detection is kept"
        ]

    def picture(self, data: list[Image.Image], step: StepOutput, title: str) -> Image.Image:
        xywh = [[x0, y0, x1 - x0, y1 - y0] for x0, y0, x1, y1 in step.outputs["boxes"].tolist()]
        return draw_instances(
            data[step.index],
            [int(label) for label in step.outputs["labels"]],
            None,
            xywh,
            f"{title} labels {step.outputs['labels'].tolist()}",
            normalised=False,
        )
