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
import time
from pathlib import Path
from typing import Any, Callable, Iterator
from unittest import mock

import numpy as np
import torch
from PIL import Image

from omskills.errors import InputError, TaskRecordError
from omskills.source.portability import DevicePortability, FunctionFix
from omskills.records.contracts import DimRef, QuantityLimit, QuantitySchedule
from omskills.records.intake import Intake, ModelSpec, VerificationSpec
from omskills.models.api import FrameHook, FrameResult, LoadedModel, MainPathResult, ModelDriver, ProvenanceSource, SeedCandidate

# Tiny scale: the same classes built by Meta's builder helpers, with small widths/depths.
# Keys are names looked up in sam3.model_builder at build time; values override kwargs.
TINY_OVERRIDES: dict[str, dict[str, Any]] = {
    "ViT": {"embed_dim": 192, "num_heads": 3, "depth": 4, "global_att_blocks": (1, 3)},
    "VETextEncoder": {"width": 256, "heads": 4, "layers": 2},
    "TransformerEncoderFusion": {"num_layers": 2},
    "TransformerDecoder": {"num_layers": 2},
    "TransformerEncoderCrossAttention": {"num_layers": 2},
    "TransformerEncoderLayer": {"dim_feedforward": 512},
    "TransformerDecoderLayer": {"dim_feedforward": 512},
    "TransformerDecoderLayerv2": {"dim_feedforward": 512},
}

# Every scale: the tracker's RoPE in real arithmetic (same math as the complex form, which
# neither ONNX exporter can translate; see FACTS: view_as_complex).
EXPORT_OVERRIDES: dict[str, dict[str, Any]] = {"RoPEAttention": {"use_rope_real": True}}

BPE_FILE = "bpe_simple_vocab_16e6.txt.gz"


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
            overrides_by_name.update(TINY_OVERRIDES)
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
        def nms_masks(pred_probs: torch.Tensor, pred_masks: torch.Tensor, prob_threshold: float, iou_threshold: float) -> torch.Tensor:
            if self._chunk_frame != self.prompt_frame or pred_probs.numel() == 0:
                return original(pred_probs=pred_probs, pred_masks=pred_masks, prob_threshold=prob_threshold, iou_threshold=iou_threshold)
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
    def active(self) -> Iterator["ForcedDetections"]:
        import sam3.model.sam3_image as sam3_image

        detector = self.model.detector
        with mock.patch.object(sam3_image, "nms_masks", self._nms(sam3_image.nms_masks)), \
                mock.patch.object(detector, "_build_multigpu_buffer_next_chunk", self._chunk(detector._build_multigpu_buffer_next_chunk)), \
                mock.patch.object(self.model, "run_backbone_and_detection", self._detection(self.model.run_backbone_and_detection)):
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
    FunctionFix("sam3.perflib.connected_components", "connected_components_cpu_single", "cpu_fallback",
                "connected_components_cpu_single: O(pixels) labelling (bincount) instead of a loop over components", _linear_time_components),
    FunctionFix("sam3.perflib.connected_components", "connected_components_cpu", "cpu_fallback",
                "connected_components_cpu: empty batch answered without calling the CPU fallback", _empty_batch_safe),
)


def _visible_objects(_module: torch.nn.Module, _args: Any, output: Any) -> Any:
    """Verification: the mask decoder's 4th output is the object-visibility logit; SAM blanks the
    mask of an object whose logit is negative. Its absolute value keeps random-weight objects."""
    masks, ious, tokens, object_score_logits = output
    return masks, ious, tokens, object_score_logits.abs()


class Sam3Driver(ModelDriver):
    family = "sam3"

    def source_root(self, spec: ModelSpec) -> Path:
        if spec.source == "package":
            found = importlib.util.find_spec("sam3")
            if found is None or not found.submodule_search_locations:
                raise InputError("intake.model.source: the sam3 package is not installed (pip install sam3==0.1.4)")
            return Path(list(found.submodule_search_locations)[0]).parent
        root = Path(spec.source).expanduser()
        if not (root / "sam3").is_dir():
            raise InputError(f"intake.model.source: {root} is not a SAM checkout (no sam3/ package folder in it)")
        return root

    def load(self, spec: ModelSpec) -> LoadedModel:
        source_root = self.source_root(spec)
        if spec.checkpoint is not None and not Path(spec.checkpoint).is_file():
            raise InputError(f"intake.model.checkpoint: checkpoint file not found: {spec.checkpoint}")
        portability = DevicePortability(spec.device, source_root / "sam3")
        for fix in SAM3_FIXES:
            portability.add_fix(fix)
        notes: list[str] = []
        torch.manual_seed(spec.seed)
        with portability:
            from sam3 import model_builder

            builder = getattr(model_builder, spec.builder, None)
            if builder is None:
                raise TaskRecordError(f"intake.model.builder: {spec.builder!r} is not in sam3.model_builder")
            with scaled_builder(spec.scale), deterministic_uninitialised(spec.seed) as filled:
                model = builder(checkpoint_path=spec.checkpoint, load_from_HF=False, bpe_path=str(bpe_vocabulary_path()),
                                device=spec.device, **spec.builder_kwargs)
            model = model.eval()
        fixed = reinit_non_finite(model, spec.seed)
        if spec.checkpoint is None:
            notes.append(f"random weights (seed {spec.seed}); {len(filled)} uninitialised tensors seeded")
        if fixed:
            notes.append(f"re-initialised non-finite parameters: {', '.join(fixed)}")
        return LoadedModel(predictor=self._predictor(model), root=model, source_root=source_root,
                           weights=spec.checkpoint or "random", portability=portability, notes=notes)

    @staticmethod
    def _predictor(model: torch.nn.Module) -> Any:
        from sam3.model.sam3_video_predictor import Sam3VideoPredictor

        predictor = Sam3VideoPredictor.__new__(Sam3VideoPredictor)
        predictor.async_loading_frames = False
        predictor.video_loader_type = "cv2"
        predictor.model = model
        return predictor

    def run_main_path(self, loaded: LoadedModel, frames: list[Image.Image], intake: Intake,
                      on_frame: FrameHook | None = None, on_prompt: Callable[[], None] | None = None) -> MainPathResult:
        predictor = loaded.predictor
        verification = intake.verification
        notes: list[str] = []
        with loaded.portability, self._verification(loaded.root, verification, notes) as forced:
            start = time.perf_counter()
            session_id = predictor.handle_request({"type": "start_session", "resource_path": list(frames)})["session_id"]
            try:
                if on_prompt:
                    on_prompt()
                t0 = time.perf_counter()
                predictor.handle_request({"type": "add_prompt", "session_id": session_id, "frame_index": 0, "text": intake.inputs.prompt})
                prompt_seconds = time.perf_counter() - t0
                results = list(self._propagate(predictor, session_id, on_frame))
            finally:
                predictor.handle_request({"type": "close_session", "session_id": session_id})
            total = time.perf_counter() - start
        if forced is not None:
            notes.append(f"top-{verification.force_top_k_detections} detections forced on frames {forced.forced_frames}")
        return MainPathResult(frames=results, prompt_seconds=prompt_seconds, total_seconds=total, notes=notes)

    @staticmethod
    def _propagate(predictor: Any, session_id: str, on_frame: FrameHook | None) -> Iterator[FrameResult]:
        request = {"type": "propagate_in_video", "session_id": session_id, "propagation_direction": "forward", "start_frame_index": 0}
        t0 = time.perf_counter()
        for response in predictor.handle_stream_request(request):
            outputs = response["outputs"]
            now = time.perf_counter()
            yield FrameResult(
                frame=int(response["frame_index"]),
                obj_ids=[int(i) for i in outputs["out_obj_ids"]],
                scores=[float(s) for s in outputs["out_probs"]],
                boxes_xywh=np.asarray(outputs["out_boxes_xywh"], dtype=np.float64).reshape(-1, 4).tolist(),
                masks=np.asarray(outputs["out_binary_masks"]).astype(bool),
                seconds=now - t0,
            )
            t0 = time.perf_counter()
            if on_frame:
                on_frame(int(response["frame_index"]))

    @contextlib.contextmanager
    def _verification(self, model: Any, verification: VerificationSpec, notes: list[str]) -> Iterator[ForcedDetections | None]:
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
        """Python callables whose tensor outputs are prompt, image or session inputs."""
        import sam3.model.sam3_video_inference as inference

        tokenizer = loaded.root.detector.backbone.language_backbone.tokenizer
        return [
            ProvenanceSource(type(tokenizer), "__call__", "prompt", f"{type(tokenizer).__name__} (text prompt tokens)"),
            ProvenanceSource(inference, "load_resource_as_video_frames", "image", "video frames (load_resource_as_video_frames)"),
        ]

    def source_limits(self, loaded: LoadedModel) -> dict[str, list[QuantityLimit | QuantitySchedule]]:
        """The tracker batches all tracked objects; the source compiles for up to 16 of them."""

        def objects(*dims: tuple[str, int]) -> QuantityLimit:
            return QuantityLimit(quantity="num_objects", low=1, high=16,
                                 evidence="sam3/model/sam3_video_base.py:123 num_obj_for_compile = 16 (tracked objects per batch)",
                                 dims=[DimRef(input=name, dim=d) for name, d in dims])

        return {
            "mask_memory_encoder": [objects(("pix_feat", 0), ("masks", 0))],
            "memory_attention": [objects(("src_0", 1), ("src_pos_0", 1), ("prompt", 1), ("prompt_pos", 1))],
        }

    def seed_candidates(self) -> list[SeedCandidate]:
        return [
            SeedCandidate("text_encoder", "detector.backbone.language_backbone.encoder",
                          "CLIP-style text transformer (tokens -> text features); the tokenizer stays in Python", "text_encoder"),
            SeedCandidate("vision_backbone", "detector.backbone.vision_backbone",
                          "ViT trunk + dual ViTDet neck, once per frame", "vision_backbone"),
            # The detector calls its transformer's encoder and decoder separately (no wrapper call).
            SeedCandidate("grounding_encoder", "detector.transformer.encoder",
                          "fusion encoder: image features attend to the text prompt", "detector_grounding"),
            SeedCandidate("grounding_decoder", "detector.transformer.decoder",
                          "DETR-style decoder: object queries -> boxes and presence", "detector_grounding"),
            SeedCandidate("segmentation_head", "detector.segmentation_head",
                          "pixel decoder + mask head of the detector", "detector_grounding"),
            SeedCandidate("dot_prod_scoring", "detector.dot_prod_scoring",
                          "query-text dot-product scores", "detector_grounding"),
            SeedCandidate("memory_attention", "tracker.transformer.encoder",
                          "memory attention over past frames' memories, per frame", "tracker_propagation"),
            SeedCandidate("mask_decoder", "tracker.sam_mask_decoder",
                          "SAM mask decoder of the tracker, per frame", "tracker_propagation"),
            SeedCandidate("mask_memory_encoder", "tracker.maskmem_backbone",
                          "encodes predicted masks into memory features", "mask_memory_encoder"),
        ]
