"""SAM 3 (PyPI `sam3`) video driver: build, tiny scale, text-prompted main path.

The predictor users call is `Sam3VideoPredictor` (handle_request / handle_stream_request).
Its constructor calls `.cuda()` and may download weights, so the model is built with
`build_sam3_video_model(checkpoint_path=..., load_from_HF=False, device=...)` and the
predictor is assembled around it without running that constructor.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import inspect
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, ClassVar
from unittest import mock

import numpy as np
import torch
from omskills.errors import InputError, TaskRecordError, one_line
from omskills.models.api import (
    InputPath,
    LoadedModel,
    MainPathRun,
    ModelDriver,
    ProvenanceSource,
    RunHooks,
    SeedCandidate,
    StepOutput,
    check_builder_kwargs,
)
from omskills.models.checkpoints import CHECKPOINT_FIELD, load_state_dict, parameters_on_meta, read_state_dict
from omskills.models.media import check_frames_decode, load_video, probe_video
from omskills.records.contracts import DimRef, QuantityLimit, QuantitySchedule, ShapeDerivedArg
from omskills.records.intake import ModelSpec
from omskills.records.verify import OutputCheck
from omskills.report.pictures import draw_instances
from omskills.source.packages import package_root
from omskills.source.portability import DevicePortability, FunctionFix
from omskills.stdio import stdout_to_stderr
from PIL import Image
from pydantic import BaseModel, ConfigDict, Field, field_validator

# Tiny scale: the same classes built by Meta's builder helpers, with small widths/depths and
# 336x336 frames (a 24x24 token grid in 2x2 windows of 12) instead of 1008x1008 (72x72 in 3x3
# windows of 24). The frame size sets the cost of every model-bound step: a tiny 2-frame run
# takes 2.3 s here against 19 s at 1008. Every place the builder writes the frame size (or the
# token grid, or the mask memory's 8/7 upsampled size) is overridden together.
# Keys are names looked up in sam3.model_builder at build time; values override kwargs.
TINY_SIDE = 336
_TINY_GRID = TINY_SIDE // 14  # the ViT's patch size
TINY_OVERRIDES: dict[str, dict[str, Any]] = {
    "ViT": {
        "embed_dim": 192,
        "num_heads": 3,
        "depth": 4,
        "global_att_blocks": (1, 3),
        "img_size": TINY_SIDE,
        "window_size": _TINY_GRID // 2,
    },
    "VETextEncoder": {"width": 256, "heads": 4, "layers": 2},
    "TransformerEncoderFusion": {"num_layers": 2},
    "TransformerDecoder": {"num_layers": 2, "resolution": TINY_SIDE},
    "TransformerEncoderCrossAttention": {"num_layers": 2},
    "TransformerEncoderLayer": {"dim_feedforward": 512},
    "TransformerDecoderLayer": {"dim_feedforward": 512},
    "TransformerDecoderLayerv2": {"dim_feedforward": 512},
    "PositionEmbeddingSine": {"precompute_resolution": TINY_SIDE},
    "SimpleMaskDownSampler": {"interpol_size": [TINY_SIDE * 8 // 7] * 2},
    "RoPEAttention": {"feat_sizes": [_TINY_GRID, _TINY_GRID]},
    "Sam3TrackerPredictor": {"image_size": TINY_SIDE},
    "Sam3VideoInferenceWithInstanceInteractivity": {"image_size": TINY_SIDE},
}

# Every scale: the tracker's RoPE in real arithmetic (same math as the complex form, which
# neither ONNX exporter can translate: view_as_complex).
EXPORT_OVERRIDES: dict[str, dict[str, Any]] = {"RoPEAttention": {"use_rope_real": True}}

BPE_FILE = "bpe_simple_vocab_16e6.txt.gz"
# A session holds every frame as a 3x1008x1008 float tensor (12 MB each): 1000 frames is 12 GB.
MAX_FRAMES = 1000
DEFAULT_BUILDER = "build_sam3_video_model"
# Builders that load a checkpoint's keys as saved (build_sam3_video_model: `load_state_dict(ckpt)`):
# for these the gate compares the keys and the driver loads them itself, strictly, for one-line
# errors. Others rename keys on load (build_sam3_image_model strips `detector.` and maps `tracker.`
# into its interactive predictor, not strictly): they load the checkpoint themselves, unchecked here.
KEYS_AS_SAVED = frozenset({"build_sam3_video_model"})


class VideoTextInputs(BaseModel):
    """A video and the text prompt given on its first frame."""

    model_config = ConfigDict(extra="forbid")

    video: InputPath  # an mp4/gif/folder of frames, or builtin:<name>
    prompt: str
    frames: int = Field(8, ge=1, le=MAX_FRAMES)

    @field_validator("prompt")
    @classmethod
    def _prompt_not_empty(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("the text prompt is empty")
        return value


class SamVerification(BaseModel):
    """Settings that make random weights exercise the whole main path.

    With random weights no detection passes the score thresholds and the tracker never
    runs. `force_top_k_detections` keeps the K best-scoring detections of the prompted
    frame whatever their score; `disable_hotstart` removes the hot-start delay so they
    are tracked at once; `keep_objects_visible` makes the tracker's object-visibility
    logit non-negative (its absolute value), so a random head does not blank every
    tracked mask as "occluded". All are reported in every output when on.
    """

    model_config = ConfigDict(extra="forbid")

    force_top_k_detections: int = Field(2, ge=0)
    disable_hotstart: bool = True
    keep_objects_visible: bool = False

    def notes(self) -> list[str]:
        notes = []
        if self.force_top_k_detections:
            notes.append(
                f"force_top_k_detections={self.force_top_k_detections}: the top-{self.force_top_k_detections} "
                "detections of the prompted frame are kept whatever their score"
            )
        if self.disable_hotstart:
            notes.append("disable_hotstart: hot-start delay set to 0 so forced objects are tracked at once")
        if self.keep_objects_visible:
            notes.append("keep_objects_visible: the tracker's object-visibility logit is taken as its absolute value")
        return notes


def bpe_vocabulary_path() -> Path:
    """SAM's tokenizer vocabulary: not in the sam3 wheel; open_clip_torch ships the same file."""
    spec = importlib.util.find_spec("open_clip")
    if spec is None or spec.origin is None:
        raise InputError(f"{BPE_FILE} not found: install open_clip_torch (it ships the vocabulary)")
    path = Path(spec.origin).parent / BPE_FILE
    if not path.is_file():
        raise InputError(f"{BPE_FILE} not found at {path}")
    return path


def _with_overrides(cls: type, overrides: dict[str, Any]) -> Callable[..., Any]:
    @functools.wraps(cls)
    def build(*args: Any, **kwargs: Any) -> Any:
        return cls(*args, **{**kwargs, **overrides})

    return build


@contextlib.contextmanager
def scaled_builder(scale: str) -> Iterator[None]:
    """Inside this context Meta's builder helpers construct the `tiny` variant of each class."""
    import sam3.model_builder as mb

    with contextlib.ExitStack() as stack:
        overrides_by_name = dict(EXPORT_OVERRIDES)
        if scale == "tiny":
            for name, overrides in TINY_OVERRIDES.items():
                overrides_by_name[name] = {**overrides_by_name.get(name, {}), **overrides}
        for name, overrides in overrides_by_name.items():
            stack.enter_context(mock.patch.object(mb, name, _with_overrides(getattr(mb, name), overrides)))
        yield


@contextlib.contextmanager
def deterministic_uninitialised(seed: int) -> Iterator[list[int]]:
    """Tensors the builder leaves uninitialised (torch.empty) get seeded N(0, 0.02) values.

    Random init otherwise leaves e.g. TextTransformer.positional_embedding as garbage or
    NaN, which makes runs non-reproducible. Tensors initialised later are overwritten.
    """
    created: list[int] = []
    original = torch.empty
    generator = torch.Generator().manual_seed(seed + 1)

    def seeded_empty(*args: Any, **kwargs: Any) -> torch.Tensor:
        tensor = original(*args, **kwargs)
        if tensor.is_floating_point() and tensor.device.type == "cpu" and tensor.numel() > 0:
            with torch.no_grad():
                tensor.copy_(torch.randn(tensor.shape, generator=generator, dtype=tensor.dtype) * 0.02)
            created.append(tensor.numel())
        return tensor

    with mock.patch.object(torch, "empty", seeded_empty):
        yield created


def reinit_non_finite(model: torch.nn.Module, seed: int) -> list[str]:
    generator = torch.Generator().manual_seed(seed + 2)
    fixed = []
    with torch.no_grad():
        for name, param in model.named_parameters():
            if not torch.isfinite(param).all():
                param.copy_(torch.randn(param.shape, generator=generator) * 0.02)
                fixed.append(name)
    return fixed


class ForcedDetections:
    """Verification setting: keep the top-K detections of the prompted frame whatever their score.

    With random weights nothing passes SAM's score thresholds and the tracker never runs.
    For the prompted frame only, the K best-scoring queries bypass NMS and the thresholds
    for detection and new-object creation are lowered to just under the K-th best score;
    other frames are untouched. The detector computes a frame's detections one chunk ahead
    (`_build_multigpu_buffer_next_chunk`), so the frame is taken from that call.
    """

    def __init__(self, model: Any, k: int, prompt_frame: int = 0):
        self.model = model
        self.k = k
        self.prompt_frame = prompt_frame
        self._chunk_frame: int | None = None
        self._detect_frame: int | None = None
        self._thresholds = (model.score_threshold_detection, model.new_det_thresh)
        self.forced_threshold: dict[int, float] = {}

    def _chunk(self, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def build_chunk(*args: Any, **kwargs: Any) -> Any:
            self._chunk_frame = kwargs.get("frame_idx_begin")
            try:
                return original(*args, **kwargs)
            finally:
                self._chunk_frame = None

        return build_chunk

    def _nms(self, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def nms_masks(
            pred_probs: torch.Tensor, pred_masks: torch.Tensor, prob_threshold: float, iou_threshold: float
        ) -> torch.Tensor:
            if self._chunk_frame != self.prompt_frame or pred_probs.numel() == 0:
                return original(
                    pred_probs=pred_probs,
                    pred_masks=pred_masks,
                    prob_threshold=prob_threshold,
                    iou_threshold=iou_threshold,
                )
            # Keep exactly the K best: with random weights their masks overlap and NMS would merge them.
            top = torch.topk(pred_probs, min(self.k, pred_probs.numel()))
            keep = torch.zeros_like(pred_probs, dtype=torch.bool)
            keep[top.indices] = True
            self.forced_threshold[self.prompt_frame] = top.values[-1].item() - 1e-6
            self._lower_thresholds_if_forced()
            return keep

        return nms_masks

    def _detection(self, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def run_backbone_and_detection(*args: Any, **kwargs: Any) -> Any:
            # Thresholds set here hold until the next frame's detection: the association step
            # that creates new objects runs after this call returns.
            self._detect_frame = kwargs.get("frame_idx")
            self.model.score_threshold_detection, self.model.new_det_thresh = self._thresholds
            self._lower_thresholds_if_forced()
            return original(*args, **kwargs)

        return run_backbone_and_detection

    def _lower_thresholds_if_forced(self) -> None:
        threshold = self.forced_threshold.get(self.prompt_frame)
        if self._detect_frame == self.prompt_frame and threshold is not None:
            self.model.score_threshold_detection = min(self._thresholds[0], threshold)
            self.model.new_det_thresh = min(self._thresholds[1], threshold)

    @contextlib.contextmanager
    def active(self) -> Iterator[ForcedDetections]:
        import sam3.model.sam3_image as sam3_image

        detector = self.model.detector
        with (
            mock.patch.object(sam3_image, "nms_masks", self._nms(sam3_image.nms_masks)),
            mock.patch.object(
                detector, "_build_multigpu_buffer_next_chunk", self._chunk(detector._build_multigpu_buffer_next_chunk)
            ),
            mock.patch.object(
                self.model, "run_backbone_and_detection", self._detection(self.model.run_backbone_and_detection)
            ),
        ):
            try:
                yield self
            finally:
                self.model.score_threshold_detection, self.model.new_det_thresh = self._thresholds

    @property
    def forced_frames(self) -> list[int]:
        return sorted(self.forced_threshold)


def _empty_batch_safe(original: Callable[..., Any]) -> Callable[..., tuple[bool, Any]]:
    def connected_components_cpu(input_tensor: torch.Tensor) -> tuple[bool, Any]:
        if input_tensor.shape[0] == 0:  # the CPU fallback stacks an empty list and crashes
            empty = torch.zeros(input_tensor.shape, dtype=torch.int64, device=input_tensor.device)
            return True, (empty, empty.clone())
        return False, original(input_tensor)

    return connected_components_cpu


def _linear_time_components(original: Callable[..., Any]) -> Callable[..., tuple[bool, Any]]:
    """Same labels and counts as SAM's CPU fallback, in O(pixels) instead of O(components x pixels).

    The fallback loops over components comparing the whole image each time; random-weight
    masks have hundreds of components, which made a tiny-scale frame take over a minute.
    """

    def connected_components_cpu_single(values: torch.Tensor) -> tuple[bool, Any]:
        from skimage.measure import label

        labels, _ = label(values.cpu().numpy(), return_num=True)
        sizes = np.bincount(labels.ravel())
        sizes[0] = 0  # background keeps count 0, as in the original
        labels_t = torch.from_numpy(labels)
        return True, (labels_t, torch.from_numpy(sizes[labels]).to(labels_t.dtype))

    return connected_components_cpu_single


SAM3_FIXES = (
    FunctionFix(
        "sam3.perflib.connected_components",
        "connected_components_cpu_single",
        "cpu_fallback",
        "connected_components_cpu_single: O(pixels) labelling (bincount) instead of a loop over components",
        _linear_time_components,
    ),
    FunctionFix(
        "sam3.perflib.connected_components",
        "connected_components_cpu",
        "cpu_fallback",
        "connected_components_cpu: empty batch answered without calling the CPU fallback",
        _empty_batch_safe,
    ),
)


def _visible_objects(_module: torch.nn.Module, _args: Any, output: Any) -> Any:
    """Verification: the mask decoder's 4th output is the object-visibility logit; SAM blanks the
    mask of an object whose logit is negative. Its absolute value keeps random-weight objects."""
    masks, ious, tokens, object_score_logits = output
    return masks, ious, tokens, object_score_logits.abs()


class TrackerMaskLogits:
    """Each propagated frame's mask logits per object, before the `> 0` that makes the binary
    masks: read where the model builds a frame's outputs (`build_outputs`: the tracker's low-res
    logits of the objects it carries, the detector's of the new ones). Keyed by frame where the
    model passes it, else in the order frames are built."""

    def __init__(self) -> None:
        self.by_frame: dict[int, dict[int, np.ndarray]] = {}
        self.in_order: list[dict[int, np.ndarray]] = []

    @classmethod
    @contextlib.contextmanager
    def watching(cls, model: Any) -> Iterator[TrackerMaskLogits]:
        watched = cls()
        original = getattr(model, "build_outputs", None)
        if original is None:
            yield watched
            return
        signature = inspect.signature(original)

        def build_outputs(*args: Any, **kwargs: Any) -> Any:
            watched._keep(signature.bind(*args, **kwargs).arguments)
            return original(*args, **kwargs)

        with mock.patch.object(model, "build_outputs", build_outputs):
            yield watched

    def _keep(self, arguments: dict[str, Any]) -> None:
        plan = arguments.get("tracker_update_plan", arguments.get("sam2_update_plan")) or {}
        logits = {
            int(i): m
            for i, m in zip(
                arguments["tracker_metadata_prev"]["obj_ids_all_gpu"], arguments["tracker_low_res_masks_global"]
            )
        }
        masks = arguments["det_out"]["mask"]
        logits |= {
            int(i): masks[int(k)] for i, k in zip(plan.get("new_det_obj_ids", []), plan.get("new_det_fa_inds", []))
        }
        kept = {i: m.detach().float().cpu().numpy().reshape(m.shape[-2:]) for i, m in logits.items()}
        frame = arguments.get("frame_idx")
        if frame is None:
            self.in_order.append(kept)
        else:
            self.by_frame[int(frame)] = kept

    def clear(self) -> None:
        self.by_frame.clear()
        self.in_order.clear()

    def of_frame(self, frame: int, obj_ids: list[int]) -> np.ndarray | None:
        """(objects, h, w) in the order of `obj_ids`; None when not every object's logits were seen."""
        logits = (
            self.by_frame.pop(frame, None)
            if frame in self.by_frame
            else (self.in_order.pop(0) if self.in_order else None)
        )
        if logits is None or not all(i in logits for i in obj_ids) or len({logits[i].shape for i in obj_ids}) > 1:
            return None
        return np.stack([logits[i] for i in obj_ids]) if obj_ids else np.zeros((0, 1, 1), np.float32)


class SamVideoDriver(ModelDriver):
    """What SAM 3 and SAM 3.1 share: the video predictor's request API on a video and a text prompt.

    The main path is start_session -> add_prompt(text, frame 0) -> propagate_in_video; each frame
    yields object ids, scores, boxes and binary masks. Two runs agree when the object ids are equal
    on every frame and each object's mask IoU is at least 0.99; scores and boxes are reported.
    """

    inputs_model = VideoTextInputs
    verification_model = SamVerification
    step_name = "frame"
    entry_methods = ("handle_request", "handle_stream_request")
    # The builder's arguments the driver passes itself: builder_kwargs may not name them.
    builder_args_set_here: ClassVar[tuple[str, ...]] = ("checkpoint_path", "load_from_HF", "bpe_path", "device")

    def source_package(self, spec: ModelSpec) -> str:
        return "sam3"

    def load_inputs(self, inputs: VideoTextInputs, base_dir: Path) -> list[Image.Image]:
        return load_video(inputs.video, inputs.frames, base_dir=base_dir, field="intake.inputs.video")

    def check_inputs(self, inputs: VideoTextInputs, base_dir: Path) -> list[str]:
        video = probe_video(inputs.video, base_dir, field="intake.inputs.video", enough=inputs.frames)
        if inputs.frames > video.frames:
            raise InputError(
                f"intake.inputs.frames: {inputs.frames} frames asked, but the video {video.where} has {video.frames}"
            )
        if video.decoded < inputs.frames:  # the length came from a header, which a truncated file keeps
            check_frames_decode(inputs.video, inputs.frames, base_dir, field="intake.inputs.video")
        length = f"{video.frames}" if video.whole else f"more than {video.frames - 1}"
        return [f"intake.inputs.video: {video.where}, {length} frames, the first {inputs.frames} used"]

    def run_main_path(
        self,
        loaded: LoadedModel,
        data: list[Image.Image],
        inputs: VideoTextInputs,
        verification: SamVerification,
        hooks: RunHooks,
    ) -> MainPathRun:
        predictor = loaded.entry
        notes: list[str] = []
        with (
            loaded.portability,
            self._verification(loaded.root, verification) as forced,
            self._session_patches(loaded, notes),
            TrackerMaskLogits.watching(loaded.root) as logits,
        ):
            start = time.perf_counter()
            session_id = predictor.handle_request({"type": "start_session", "resource_path": list(data)})["session_id"]
            try:
                hooks.prompt()
                predictor.handle_request(
                    {"type": "add_prompt", "session_id": session_id, "frame_index": 0, "text": inputs.prompt}
                )
                setup = time.perf_counter() - start
                logits.clear()  # what the prompt's own pass built is not a propagated frame
                steps = list(self._propagate(predictor, session_id, hooks, logits))
            finally:
                predictor.handle_request({"type": "close_session", "session_id": session_id})
            total = time.perf_counter() - start
        if forced is not None:
            notes.append(
                f"top-{verification.force_top_k_detections} detections forced on frames {forced.forced_frames}"
            )
        return MainPathRun(steps=steps, setup_seconds=setup, total_seconds=total, notes=notes)

    @contextlib.contextmanager
    def _session_patches(self, loaded: LoadedModel, notes: list[str]) -> Iterator[None]:
        """Source mismatches worked around for the length of a run (none for SAM 3)."""
        yield

    @staticmethod
    def _propagate(predictor: Any, session_id: str, hooks: RunHooks, logits: TrackerMaskLogits) -> Iterator[StepOutput]:
        """Frames may arrive in post-processing batches (SAM 3.1): each one's `seconds` is its
        share of the wait since the previous one."""
        request = {
            "type": "propagate_in_video",
            "session_id": session_id,
            "propagation_direction": "forward",
            "start_frame_index": 0,
        }
        t0 = time.perf_counter()
        for response in predictor.handle_stream_request(request):
            outputs = response["outputs"]
            now = time.perf_counter()
            frame = int(response["frame_index"])
            obj_ids = np.asarray([int(i) for i in outputs["out_obj_ids"]], dtype=np.int64)
            step = {
                "obj_ids": obj_ids,
                "scores": np.asarray([float(s) for s in outputs["out_probs"]], dtype=np.float64),
                "boxes_xywh": np.asarray(outputs["out_boxes_xywh"], dtype=np.float64).reshape(-1, 4),
                "masks": np.asarray(outputs["out_binary_masks"]).astype(bool),
            }
            mask_logits = logits.of_frame(frame, obj_ids.tolist())
            if mask_logits is not None:
                step["mask_logits"] = mask_logits
            yield StepOutput(index=frame, seconds=now - t0, outputs=step)
            t0 = time.perf_counter()
            hooks.step(frame)

    def comparison(self, verification: SamVerification) -> list[OutputCheck]:
        return [
            OutputCheck(output="obj_ids", metric="exact", label="object ids"),
            OutputCheck(output="masks", metric="iou", key="obj_ids", threshold=0.99, label="mask IoU per object"),
            OutputCheck(output="scores", metric="max_abs", key="obj_ids", threshold=1e-3, gating=False, label="scores"),
            OutputCheck(
                output="boxes_xywh",
                metric="max_abs",
                key="obj_ids",
                threshold=1e-3,
                gating=False,
                label="boxes (normalised xywh)",
            ),
            # Continuous, so a mask IoU below its gate tells a pixel flipping at the threshold from a divergence.
            OutputCheck(
                output="mask_logits",
                metric="tensor",
                key="obj_ids",
                gating=False,
                label="mask logits (low-res, before > 0)",
            ),
        ]

    def precision_checks(self, verification: SamVerification) -> list[OutputCheck]:
        """Under fp16 the masks are judged at the threshold that makes them: the low-res mask logits
        by a decision check at 0 (a pixel whose reference logit sat within tolerance of 0 may flip;
        the positive region's IoU, counting only pixels that moved beyond their tolerance, must
        hold), the object ids exactly; the binary masks' IoU, scores and boxes are reported beside
        it (on random weights most logits sit near 0, and the tracker's hole filling turns a small
        component's near-threshold area into a whole component kept or dropped)."""
        fp32 = {c.output: c for c in self.comparison(verification)}
        return [
            fp32["obj_ids"],
            OutputCheck(
                output="mask_logits",
                metric="decision",
                key="obj_ids",
                threshold=0.99,
                decision_at=0.0,
                optional=True,  # a frame whose logits the driver could not read
                label="mask logits at the threshold (IoU, divergent pixels only)",
            ),
            fp32["masks"].model_copy(update={"gating": False}),
            fp32["scores"],
            fp32["boxes_xywh"],
        ]

    def settings_notes(self, verification: SamVerification) -> list[str]:
        return verification.notes()

    def picture(self, data: list[Image.Image], step: StepOutput, title: str) -> Image.Image:
        out = step.outputs
        ids = [int(i) for i in out["obj_ids"]]
        return draw_instances(data[step.index], ids, out["masks"], out["boxes_xywh"].tolist(), f"{title} ids {ids}")

    @contextlib.contextmanager
    def _verification(self, model: Any, verification: SamVerification) -> Iterator[Any]:
        raise NotImplementedError


class Sam3Driver(SamVideoDriver):
    family = "sam3"
    description = "SAM 3 (PyPI sam3==0.1.4): text-prompted video segmentation, Sam3VideoPredictor"

    def builder_name(self, spec: ModelSpec) -> str:
        return spec.builder or DEFAULT_BUILDER

    def source_root(self, spec: ModelSpec) -> Path:
        if spec.source == "package" and importlib.util.find_spec("sam3") is None:
            raise InputError("intake.model.source: the sam3 package is not installed (pip install 'omskills[sam3]')")
        return package_root(spec.source, "sam3")

    def _builder(self, spec: ModelSpec) -> Callable[..., Any]:
        """The builder function in sam3.model_builder (imported inside a portability context)."""
        from sam3 import model_builder

        builder_name = self.builder_name(spec)
        builder = getattr(model_builder, builder_name, None)
        if builder is None:
            raise TaskRecordError(f"intake.model.builder: {builder_name!r} is not in sam3.model_builder")
        return builder

    def check_builder(self, spec: ModelSpec) -> str:
        # sam3's modules warn on import (no CUDA, torch.jit.script deprecated): the gate's answer is its line.
        with DevicePortability(spec.device, self.source_root(spec) / "sam3"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            check_builder_kwargs(self._builder(spec), spec.builder_kwargs, self.builder_args_set_here)
        return (
            f"intake.model.builder: sam3.model_builder.{self.builder_name(spec)} imports and takes the builder_kwargs"
        )

    def expected_state_keys(self, spec: ModelSpec) -> set[str] | None:
        """The model built on the meta device at the scale asked: its keys, no weights allocated."""
        if spec.builder_kwargs.get("strict_state_dict_loading") is False:
            return None  # the user lets the keys differ
        if self.builder_name(spec) not in KEYS_AS_SAVED:
            return None  # the builder renames the keys on load: the raw ones would not compare
        with DevicePortability("cpu", self.source_root(spec) / "sam3"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            builder = self._builder(spec)
            with parameters_on_meta(), scaled_builder(spec.scale):
                model = builder(
                    checkpoint_path=None,
                    load_from_HF=False,
                    bpe_path=str(bpe_vocabulary_path()),
                    device="meta",
                    **spec.builder_kwargs,
                )
        return set(model.state_dict())

    def load(self, spec: ModelSpec) -> LoadedModel:
        source_root = self.source_root(spec)
        if spec.checkpoint is not None and not Path(spec.checkpoint).is_file():
            raise InputError(f"intake.model.checkpoint: checkpoint file not found: {spec.checkpoint}")
        portability = DevicePortability(spec.device, source_root / "sam3")
        for fix in SAM3_FIXES:
            portability.add_fix(fix)
        notes: list[str] = []
        torch.manual_seed(spec.seed)
        # A builder that takes the keys as saved gets no checkpoint: it is loaded here, its errors one
        # line (the builder's strict load lists every key). Another builder loads it with its own renaming.
        ours = self.builder_name(spec) in KEYS_AS_SAVED
        with portability:
            builder = self._builder(spec)
            with scaled_builder(spec.scale), deterministic_uninitialised(spec.seed) as filled:
                model = self._build(builder, spec, checkpoint=None if ours else spec.checkpoint)
            if spec.checkpoint is not None and ours:
                load_state_dict(
                    model,
                    Path(spec.checkpoint),
                    "cpu",
                    strict=spec.builder_kwargs.get("strict_state_dict_loading", True) is not False,
                )
            model = model.eval()
        fixed = reinit_non_finite(model, spec.seed)
        if spec.checkpoint is None:
            notes.append(f"random weights (seed {spec.seed}); {len(filled)} uninitialised tensors seeded")
        if fixed:
            notes.append(f"re-initialised non-finite parameters: {', '.join(fixed)}")
        return LoadedModel(
            entry=self._predictor(model),
            root=model,
            source_root=source_root,
            weights=spec.checkpoint or "random",
            portability=portability,
            notes=notes,
        )

    def _build(self, builder: Callable[..., Any], spec: ModelSpec, checkpoint: str | None) -> Any:
        """The builder's model; given a checkpoint, the builder loads it (printing what it finds, to
        stderr here: stdout may be the MCP channel) and a failure is one line naming the field."""
        kwargs = dict(
            load_from_HF=False, bpe_path=str(bpe_vocabulary_path()), device=spec.device, **spec.builder_kwargs
        )
        if checkpoint is None:
            return builder(checkpoint_path=None, **kwargs)
        read_state_dict(Path(checkpoint))  # a file that is no state dict: the usual one line
        try:
            with stdout_to_stderr():
                return builder(checkpoint_path=str(checkpoint), **kwargs)
        except Exception as err:  # noqa: BLE001 - torch's load errors list every key over many lines
            raise InputError(
                f"{CHECKPOINT_FIELD}: {checkpoint}: sam3.model_builder.{self.builder_name(spec)} "
                f"could not load it: {one_line(err, 300)}"
            ) from None

    @staticmethod
    def _predictor(model: torch.nn.Module) -> Any:
        from sam3.model.sam3_video_predictor import Sam3VideoPredictor

        predictor = Sam3VideoPredictor.__new__(Sam3VideoPredictor)
        predictor.async_loading_frames = False
        predictor.video_loader_type = "cv2"
        predictor.model = model
        return predictor

    @contextlib.contextmanager
    def _verification(self, model: Any, verification: SamVerification) -> Iterator[ForcedDetections | None]:
        with contextlib.ExitStack() as stack:
            if verification.disable_hotstart and model.hotstart_delay > 0:
                stack.enter_context(mock.patch.object(model, "hotstart_delay", 0))
            if verification.keep_objects_visible:
                # Hooked on whatever sits at tracker.sam_mask_decoder now (the original or its splice).
                decoder = model.tracker.sam_mask_decoder
                stack.callback(decoder.register_forward_hook(_visible_objects).remove)
            forced = None
            if verification.force_top_k_detections > 0:
                forced = stack.enter_context(ForcedDetections(model, verification.force_top_k_detections).active())
            yield forced

    def provenance_sources(self, loaded: LoadedModel) -> list[ProvenanceSource]:
        """Python callables whose tensor outputs are user inputs: prompt tokens and video frames."""
        import sam3.model.sam3_video_inference as inference

        tokenizer = loaded.root.detector.backbone.language_backbone.tokenizer
        return [
            ProvenanceSource(type(tokenizer), "__call__", "input", f"{type(tokenizer).__name__} (text prompt tokens)"),
            ProvenanceSource(
                inference, "load_resource_as_video_frames", "input", "video frames (load_resource_as_video_frames)"
            ),
        ]

    def source_limits(self, loaded: LoadedModel) -> dict[str, list[QuantityLimit | QuantitySchedule]]:
        """The tracker batches all tracked objects (the source compiles for up to 16 of them); the
        memory attention reads image tokens of past frames and pointer tokens of past objects."""

        def objects(*dims: tuple[str, int]) -> QuantityLimit:
            return QuantityLimit(
                quantity="num_objects",
                low=1,
                high=16,
                evidence="sam3/model/sam3_video_base.py:123 num_obj_for_compile = 16 (tracked objects per batch)",
                dims=[DimRef(input=name, dim=d) for name, d in dims],
            )

        return {
            "mask_memory_encoder": [objects(("pix_feat", 0), ("masks", 0))],
            "memory_attention": [
                *_memory_limits(loaded.root.tracker),
                objects(("src_0", 1), ("src_pos_0", 1), ("prompt", 1), ("prompt_pos", 1)),
            ],
        }

    def derived_args(self) -> dict[str, dict[str, ShapeDerivedArg]]:
        return {
            "memory_attention": {
                "kwargs['num_obj_ptr_tokens']": ShapeDerivedArg(
                    # The remainder of prompt.shape[0] / HW, written with // rather than %: torch.export then
                    # simplifies the RoPE slice length (prompt.shape[0] - num_obj_ptr_tokens) to a multiple of HW.
                    expression="prompt.shape[0] - src_0.shape[0] * (prompt.shape[0] // src_0.shape[0])",
                    evidence="sam3/model/sam3_tracker_base.py:683-780 builds prompt as memory frames of HW image "
                    "tokens each (HW = src_0.shape[0]) followed by hidden_dim // mem_dim tokens per object pointer, "
                    "fewer than HW in all; num_obj_ptr_tokens = obj_ptrs.shape[0] is the remainder",
                )
            }
        }

    def seed_candidates(self) -> list[SeedCandidate]:
        return [
            SeedCandidate(
                "text_encoder",
                "detector.backbone.language_backbone.encoder",
                "CLIP-style text transformer (tokens -> text features); the tokenizer stays in Python",
                "text_encoder",
            ),
            SeedCandidate(
                "vision_backbone",
                "detector.backbone.vision_backbone",
                "ViT trunk + dual ViTDet neck, once per frame",
                "vision_backbone",
            ),
            # The detector calls its transformer's encoder and decoder separately (no wrapper call).
            SeedCandidate(
                "grounding_encoder",
                "detector.transformer.encoder",
                "fusion encoder: image features attend to the text prompt",
                "detector_grounding",
            ),
            SeedCandidate(
                "grounding_decoder",
                "detector.transformer.decoder",
                "DETR-style decoder: object queries -> boxes and presence",
                "detector_grounding",
            ),
            SeedCandidate(
                "segmentation_head",
                "detector.segmentation_head",
                "pixel decoder + mask head of the detector",
                "detector_grounding",
            ),
            SeedCandidate(
                "dot_prod_scoring", "detector.dot_prod_scoring", "query-text dot-product scores", "detector_grounding"
            ),
            SeedCandidate(
                "memory_attention",
                "tracker.transformer.encoder",
                "memory attention over past frames' memories, per frame",
                "tracker_propagation",
            ),
            SeedCandidate(
                "mask_decoder",
                "tracker.sam_mask_decoder",
                "SAM mask decoder of the tracker, per frame (one graph per multimask_output value)",
                "tracker_propagation",
            ),
            SeedCandidate(
                "mask_memory_encoder",
                "tracker.maskmem_backbone",
                "encodes predicted masks into memory features",
                "mask_memory_encoder",
            ),
        ]


def _memory_limits(tracker: Any) -> list[QuantityLimit | QuantitySchedule]:
    """Memory attention's prompt length: each memory frame adds HW image tokens, each object-pointer
    frame hidden_dim // mem_dim pointer tokens. With one conditioning frame (the text prompt on frame
    0), frame t attends to min(t, num_maskmem) memory frames and min(t, max_obj_ptrs_in_encoder)
    pointer frames: that schedule gives the gears."""
    side = int(tracker.sam_image_embedding_size)
    maskmem, max_ptrs = int(tracker.num_maskmem), int(tracker.max_obj_ptrs_in_encoder)
    per_pointer = max(1, int(tracker.hidden_dim) // int(tracker.mem_dim))
    where = "sam3/model/sam3_tracker_base.py"
    limits: list[QuantityLimit | QuantitySchedule] = [
        QuantityLimit(
            quantity="memory_frames",
            low=1,
            high=maskmem,
            evidence=f"{where}: the conditioning frame + num_maskmem-1={maskmem - 1} previous frames, "
            f"{side}x{side} tokens each",
            dims=[DimRef(input=name, dim=0, scale=side * side) for name in ("prompt", "prompt_pos")],
        ),
        QuantityLimit(
            quantity="object_pointer_frames",
            low=1,
            high=max_ptrs,
            evidence=f"{where}: max_obj_ptrs_in_encoder={max_ptrs}, hidden_dim // mem_dim = {per_pointer} "
            "tokens per pointer",
            dims=[DimRef(input=name, dim=0, scale=per_pointer) for name in ("prompt", "prompt_pos")],
        ),
    ]
    if int(tracker.memory_temporal_stride_for_eval) != 1 or getattr(tracker, "use_memory_selection", False):
        return limits  # other memory layouts: the ranges alone
    return limits + [memory_schedule(maskmem, max_ptrs, f"{where}, _prepare_memory_conditioned_features")]


def memory_schedule(maskmem: int, max_ptrs: int, where: str) -> QuantitySchedule:
    """Forward propagation from one conditioning frame: frame t attends to min(t, num_maskmem)
    memory frames and min(t, max_obj_ptrs_in_encoder) pointer frames (SAM 3 and SAM 3.1 alike)."""
    return QuantitySchedule(
        quantities=["memory_frames", "object_pointer_frames"],
        rows=[[min(t, maskmem), min(t, max_ptrs)] for t in range(1, max(maskmem, max_ptrs) + 1)],
        evidence=f"frame t after one conditioning frame: min(t, num_maskmem={maskmem}) memory frames, "
        f"min(t, max_obj_ptrs_in_encoder={max_ptrs}) pointer frames ({where})",
    )
