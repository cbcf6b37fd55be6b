"""segment-anything's SamPredictor and SamAutomaticMaskGenerator on a tiny random `Sam`.

The model is `segment_anything.modeling.Sam` built from its classes as `build_sam` does, but tiny: a
256-pixel ViT image encoder (patch 16, width 64, 2 blocks, windowed attention in the first, global
in the second), the prompt encoder and a two-way-transformer mask decoder of width 32. Weights are
random (seeded), so masks mean nothing; their logits are still a strict parity test.

Two entries, one driver class each:
- `SamPredictorDriver`: `predictor.set_image(image)` (resize to the longest side, normalise, pad,
  image encoder once per image) then `predictor.predict(point_coords, point_labels,
  multimask_output=True, return_logits=True)` (prompt encoder, mask decoder, upscaling in Python).
- `SamMaskGeneratorDriver`: `SamAutomaticMaskGenerator(sam, points_per_side=...).generate(image)`:
  a point grid in batches through the same networks, then thresholds, stability scores, box NMS
  and RLE encoding in Python. Random weights need its thresholds low: they are inputs of the task.
"""

from __future__ import annotations

import time
from functools import partial
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
    draw_instances,
    load_state_dict,
    load_video,
    package_root,
)
from PIL import Image
from pydantic import BaseModel, ConfigDict, Field

IMAGE_SIZE, PATCH, PROMPT_DIM = 256, 16, 32


def _tiny_sam():
    from segment_anything.modeling import ImageEncoderViT, MaskDecoder, PromptEncoder, Sam, TwoWayTransformer

    grid = IMAGE_SIZE // PATCH
    return Sam(
        image_encoder=ImageEncoderViT(
            img_size=IMAGE_SIZE,
            patch_size=PATCH,
            embed_dim=64,
            depth=2,
            num_heads=2,
            mlp_ratio=4.0,
            out_chans=PROMPT_DIM,
            qkv_bias=True,
            norm_layer=partial(torch.nn.LayerNorm, eps=1e-6),
            use_rel_pos=True,
            window_size=4,
            global_attn_indexes=(1,),
        ),
        prompt_encoder=PromptEncoder(
            embed_dim=PROMPT_DIM,
            image_embedding_size=(grid, grid),
            input_image_size=(IMAGE_SIZE, IMAGE_SIZE),
            mask_in_chans=4,
        ),
        mask_decoder=MaskDecoder(
            num_multimask_outputs=3,
            transformer_dim=PROMPT_DIM,
            iou_head_depth=3,
            iou_head_hidden_dim=32,
            transformer=TwoWayTransformer(depth=2, embedding_dim=PROMPT_DIM, mlp_dim=64, num_heads=2),
        ),
        pixel_mean=[123.675, 116.28, 103.53],
        pixel_std=[58.395, 57.12, 57.375],
    )


class _SamDriver(ModelDriver):
    """What both entries share: the tiny model, the images, the package."""

    step_name = "image"

    def source_root(self, spec: ModelSpec) -> Path:
        return package_root(spec.source, "segment_anything")

    def source_package(self, spec: ModelSpec) -> str:
        return "segment_anything"

    def builder_name(self, spec: ModelSpec) -> None:
        return None  # built here from the modeling classes: the package is scanned from its __init__

    def _sam(self, spec: ModelSpec):
        torch.manual_seed(spec.seed)
        sam = _tiny_sam()
        if spec.checkpoint:
            load_state_dict(sam, Path(spec.checkpoint), spec.device)
        return sam.eval().to(spec.device)

    def _loaded(self, spec: ModelSpec, entry, sam) -> LoadedModel:
        return LoadedModel(
            entry=entry,
            root=sam,
            source_root=self.source_root(spec),
            weights=spec.checkpoint or "random",
            notes=[] if spec.checkpoint else [f"random weights (seed {spec.seed})"],
        )

    def load_inputs(self, inputs: BaseModel, base_dir: Path) -> list[np.ndarray]:
        frames = load_video(inputs.images, inputs.count, base_dir=base_dir, field="images")
        return [np.asarray(frame.convert("RGB").resize((inputs.width, inputs.width * 3 // 4))) for frame in frames]


# -- SamPredictor ---------------------------------------------------------------------------


class PredictorInputs(BaseModel):
    """Images, and the point prompts given on each (spread over the image, the last one negative)."""

    model_config = ConfigDict(extra="forbid")

    images: InputPath = "builtin:shapes"
    count: int = Field(2, ge=1)
    width: int = Field(320, ge=32)  # images are resized to width x 3/4 width before set_image
    points: int = Field(2, ge=1)


def _points(count: int, height: int, width: int) -> tuple[np.ndarray, np.ndarray]:
    fractions = (np.arange(count) + 1) / (count + 1)
    coords = np.stack([fractions * width, (1 - fractions) * height], axis=1).astype(np.float32)
    labels = np.ones(count, np.int64)
    labels[-1] = 0 if count > 1 else 1
    return coords, labels


class SamPredictorDriver(_SamDriver):
    family = "segment-anything-predictor"
    description = "segment-anything SamPredictor: set_image then predict with point prompts, mask logits out"
    inputs_model = PredictorInputs
    entry_methods = ("set_image", "predict")
    entry_classes = ("SamPredictor",)

    def load(self, spec: ModelSpec) -> LoadedModel:
        from segment_anything import SamPredictor

        sam = self._sam(spec)
        return self._loaded(spec, SamPredictor(sam), sam)

    def run_main_path(
        self,
        loaded: LoadedModel,
        data: list[np.ndarray],
        inputs: PredictorInputs,
        verification: BaseModel,
        hooks: RunHooks,
    ) -> MainPathRun:
        predictor, steps = loaded.entry, []
        start = time.perf_counter()
        with torch.no_grad():
            for index, image in enumerate(data):
                t0 = time.perf_counter()
                predictor.set_image(image)
                coords, labels = _points(inputs.points, *image.shape[:2])
                masks, scores, low_res = predictor.predict(
                    point_coords=coords, point_labels=labels, multimask_output=True, return_logits=True
                )
                steps.append(
                    StepOutput(
                        index=index,
                        seconds=time.perf_counter() - t0,
                        outputs={"mask_logits": masks, "iou_predictions": scores, "low_res_logits": low_res},
                    )
                )
                hooks.step(index)
        return MainPathRun(steps=steps, setup_seconds=0.0, total_seconds=time.perf_counter() - start)

    def comparison(self, verification: BaseModel) -> list[OutputCheck]:
        return [
            OutputCheck(output="low_res_logits", metric="tensor", label="low-resolution mask logits"),
            OutputCheck(output="mask_logits", metric="tensor", label="mask logits at image size"),
            OutputCheck(output="iou_predictions", metric="max_abs", threshold=1e-4, label="predicted IoU"),
        ]

    def picture(self, data: list[np.ndarray], step: StepOutput, title: str) -> Image.Image:
        masks = step.outputs["mask_logits"] > 0
        return draw_instances(
            Image.fromarray(data[step.index]),
            list(range(len(masks))),
            masks,
            [],
            f"{title}: {len(masks)} masks (logits > 0)",
        )


# -- SamAutomaticMaskGenerator ----------------------------------------------------------------


class GeneratorInputs(BaseModel):
    """Images and the generator's settings (thresholds low enough for random weights)."""

    model_config = ConfigDict(extra="forbid")

    images: InputPath = "builtin:shapes"
    count: int = Field(1, ge=1)
    width: int = Field(320, ge=32)
    points_per_side: int = Field(4, ge=1)
    points_per_batch: int = Field(8, ge=1)
    pred_iou_thresh: float = -1.0
    stability_score_thresh: float = 0.0
    box_nms_thresh: float = Field(0.7, gt=0.0, le=1.0)


def _mask_ids(found: list[dict], side: int, height: int, width: int) -> np.ndarray:
    """A key that matches masks across runs: the grid point each mask came from (x3) plus its rank
    among that point's kept masks (a point yields up to three, one per multimask output)."""
    ids: list[int] = []
    for mask in found:
        x, y = mask["point_coords"][0]
        point = int(round(y / height * side - 0.5)) * side + int(round(x / width * side - 0.5))
        ids.append(3 * point + sum(1 for i in ids if i // 3 == point))
    return np.array(ids, np.int64)


class SamMaskGeneratorDriver(_SamDriver):
    family = "segment-anything-automatic"
    description = "segment-anything SamAutomaticMaskGenerator: a point grid through SAM, filtered masks out"
    inputs_model = GeneratorInputs
    entry_methods = ("generate",)
    entry_classes = ("SamAutomaticMaskGenerator",)

    def load(self, spec: ModelSpec) -> LoadedModel:
        return self._loaded(spec, None, self._sam(spec))  # the generator takes its settings from the inputs

    def run_main_path(
        self,
        loaded: LoadedModel,
        data: list[np.ndarray],
        inputs: GeneratorInputs,
        verification: BaseModel,
        hooks: RunHooks,
    ) -> MainPathRun:
        from segment_anything import SamAutomaticMaskGenerator

        generator = SamAutomaticMaskGenerator(
            loaded.root,
            points_per_side=inputs.points_per_side,
            points_per_batch=inputs.points_per_batch,
            pred_iou_thresh=inputs.pred_iou_thresh,
            stability_score_thresh=inputs.stability_score_thresh,
            box_nms_thresh=inputs.box_nms_thresh,
            output_mode="binary_mask",
        )
        steps = []
        start = time.perf_counter()
        for index, image in enumerate(data):
            t0 = time.perf_counter()
            found = generator.generate(image)
            height, width = image.shape[:2]
            outputs = {
                "mask_ids": _mask_ids(found, inputs.points_per_side, height, width),
                "segmentations": np.array([m["segmentation"] for m in found], bool).reshape(len(found), height, width),
                "predicted_iou": np.array([m["predicted_iou"] for m in found], np.float32),
                "stability_score": np.array([m["stability_score"] for m in found], np.float32),
                "boxes": np.array([m["bbox"] for m in found], np.float32).reshape(len(found), 4),
            }
            steps.append(StepOutput(index=index, seconds=time.perf_counter() - t0, outputs=outputs))
            hooks.step(index)
        return MainPathRun(steps=steps, setup_seconds=0.0, total_seconds=time.perf_counter() - start)

    def comparison(self, verification: BaseModel) -> list[OutputCheck]:
        return [
            OutputCheck(output="mask_ids", metric="exact", label="masks kept (grid point, rank)"),
            OutputCheck(
                output="predicted_iou", metric="max_abs", threshold=1e-4, key="mask_ids", label="predicted IoU"
            ),
            OutputCheck(
                output="stability_score", metric="max_abs", threshold=1e-3, key="mask_ids", label="stability score"
            ),
            OutputCheck(output="segmentations", metric="iou", threshold=0.99, key="mask_ids", label="masks"),
        ]

    def picture(self, data: list[np.ndarray], step: StepOutput, title: str) -> Image.Image:
        ids = [int(i) for i in step.outputs["mask_ids"]]
        return draw_instances(
            Image.fromarray(data[step.index]),
            ids,
            step.outputs["segmentations"],
            step.outputs["boxes"].tolist(),
            f"{title}: {len(ids)} masks",
            normalised=False,
        )
