"""SAM 3.1 (Object Multiplex) video driver: a user's checkout of Meta's `sam3` repository.

SAM 3.1 is not on PyPI: users clone https://github.com/facebookresearch/sam3 (a revision
from 2026-03-27 on, with `sam3/model/sam3_multiplex_video_predictor.py`) and point the task
record at the checkout with `intake.model.source`; the environment variable
`OMSKILLS_SAM31_SOURCE`, when set, overrides that field. The checkout's `sam3` package is put
first on `sys.path`; a `sam3` already imported from elsewhere (e.g. the PyPI SAM 3 wheel) is an
error, because one process cannot hold both.

`build_sam3_multiplex_video_predictor` always downloads a checkpoint from the hub when none
is given and calls `.cuda()`. Here the download function is replaced while building (no
checkpoint = seeded random weights) and `.cuda()` is redirected by the portability layer.
The model is imported inside the portability context: `sam3_multiplex_base.py` queries the
CUDA device when it is imported.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import torch
from omskills.errors import InputError, TaskRecordError
from omskills.models.api import LoadedModel, ProvenanceSource, SeedCandidate
from omskills.records.contracts import DimRef, QuantityLimit, QuantitySchedule, ShapeDerivedArg
from omskills.records.intake import ModelSpec
from omskills.sam.sam3 import (
    SAM3_FIXES,
    ForcedDetections,
    SamVerification,
    SamVideoDriver,
    _with_overrides,
    bpe_vocabulary_path,
    deterministic_uninitialised,
    memory_schedule,
    reinit_non_finite,
)
from omskills.source.portability import HOST_DEPENDENT_IMPORTS, DevicePortability, FunctionFix

SOURCE_ENV = "OMSKILLS_SAM31_SOURCE"
MULTIPLEX_PREDICTOR_FILE = Path("sam3") / "model" / "sam3_multiplex_video_predictor.py"
CLONE_HINT = (
    "git clone https://github.com/facebookresearch/sam3 at a revision with SAM 3.1 "
    f"(Object Multiplex, 2026-03-27 or later: it has {MULTIPLEX_PREDICTOR_FILE})"
)
BUILDER = "build_sam3_multiplex_video_predictor"

# Tiny scale: the same classes built by Meta's builder helpers, with small widths/depths.
# Keys are names looked up in sam3.model_builder at build time; values override kwargs.
TINY_OVERRIDES: dict[str, dict[str, Any]] = {
    "ViT": {"embed_dim": 192, "num_heads": 3, "depth": 4, "global_att_blocks": (1, 3)},
    "VETextEncoder": {"width": 256, "heads": 4, "layers": 2},
    "TransformerEncoderFusion": {"num_layers": 2},
    "TransformerDecoder": {"num_layers": 2},
    "TransformerEncoderLayer": {"dim_feedforward": 512},
    "TransformerDecoderLayer": {"dim_feedforward": 512},
    # The multiplex tracker's memory attention.
    "TransformerEncoderDecoupledCrossAttention": {"num_layers": 2},
    "DecoupledTransformerDecoderLayerv2": {"dim_feedforward": 512},
}


def resolve_checkout(source: str) -> Path:
    """The SAM 3.1 checkout: `OMSKILLS_SAM31_SOURCE` if set, else `intake.model.source`."""
    from_env = os.environ.get(SOURCE_ENV, "").strip()
    where = f"environment variable {SOURCE_ENV}" if from_env else "intake.model.source"
    raw = from_env or source
    how_to_fix = f"{CLONE_HINT}, then set intake.model.source (or --source, or {SOURCE_ENV}) to the checkout"
    if not raw or raw == "package":
        raise InputError(f"{where}: SAM 3.1 is not on PyPI and no checkout is given: {how_to_fix}")
    root = Path(raw).expanduser()
    if root.name == "sam3" and (root / "__init__.py").is_file():
        root = root.parent  # the package folder itself was given
    if not root.is_dir():
        raise InputError(f"{where}: {root} does not exist: {how_to_fix}")
    if not (root / MULTIPLEX_PREDICTOR_FILE).is_file():
        raise InputError(f"{where}: {root} is not a SAM 3.1 checkout (no {MULTIPLEX_PREDICTOR_FILE}): {how_to_fix}")
    return root.resolve()


def use_checkout(root: Path) -> None:
    """Make `import sam3` resolve to the checkout (first on sys.path); refuse a foreign sam3."""
    loaded = sys.modules.get("sam3")
    if loaded is not None:
        origin = Path(getattr(loaded, "__file__", None) or "<namespace>").resolve()
        if not origin.is_relative_to(root):
            raise InputError(
                f"intake.model.source: a different sam3 package is already imported in this process "
                f"({origin}); run SAM 3.1 from a fresh process so {root / 'sam3'} is the one imported"
            )
    entry = str(root)
    if entry in sys.path:
        sys.path.remove(entry)
    sys.path.insert(0, entry)
    importlib.invalidate_caches()


@contextlib.contextmanager
def scaled_builder(model_builder: Any, scale: str) -> Iterator[list[str]]:
    """Inside this context the builder makes the `tiny` variant of each class and downloads nothing."""
    called: list[str] = []

    def no_download(version: str = "sam3.1") -> None:
        # Stands in for download_ckpt_from_hf: no checkpoint given means random init (None), never a download.
        called.append(version)
        return None

    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(model_builder, "download_ckpt_from_hf", no_download))
        if scale == "tiny":
            for name, overrides in TINY_OVERRIDES.items():
                stack.enter_context(
                    mock.patch.object(model_builder, name, _with_overrides(getattr(model_builder, name), overrides))
                )
        yield called


def _fp32_addmm_act(original: Callable[..., Any]) -> Callable[..., tuple[bool, Any]]:
    """The ViT MLP's fused `addmm_act` casts its operands to bf16; the same linear + activation
    in fp32 keeps the reference at fp32 parity (and exports as plain Gemm + Gelu/Relu)."""

    def addmm_act(activation: type, linear: torch.nn.Linear, mat1: torch.Tensor) -> tuple[bool, torch.Tensor]:
        return True, activation()(torch.nn.functional.linear(mat1, linear.weight, linear.bias))

    return addmm_act


SAM31_FIXES = SAM3_FIXES + (
    FunctionFix(
        "sam3.model.vitdet",
        "addmm_act",
        "bf16_cast",
        "ViT MLP addmm_act: fp32 linear + activation instead of the bf16 fused kernel",
        _fp32_addmm_act,
    ),
)


class MultiplexForcedDetections(ForcedDetections):
    """Verification setting: keep the top-K detections of the prompted frame whatever their score.

    With random weights nothing passes SAM 3.1's score thresholds and the tracker never runs.
    For the prompted frame only, the K best-scoring queries bypass NMS and the thresholds for
    detection (`score_threshold_detection`) and new objects (`new_det_thresh`) are lowered to
    just under the K-th best score; other frames are untouched. SAM 3.1 runs the detector on a
    chunk of frames at once (batched grounding, or one chunk ahead), so the frames of an NMS call
    are taken from the chunk call around it.
    """

    def __init__(self, model: Any, k: int, prompt_frame: int = 0):
        super().__init__(model, k, prompt_frame)
        self._nms_frames: list[int] = []

    def _chunk(
        self, original: Callable[..., Any], frames_of: Callable[[dict[str, Any]], list[int]]
    ) -> Callable[..., Any]:
        @functools.wraps(original)
        def chunk(*args: Any, **kwargs: Any) -> Any:
            self._nms_frames = frames_of(kwargs)
            try:
                return original(*args, **kwargs)
            finally:
                self._nms_frames = []

        return chunk

    def _nms(self, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def nms_masks(
            pred_probs: torch.Tensor,
            pred_masks: torch.Tensor,
            prob_threshold: float,
            iou_threshold: float,
            **kwargs: Any,
        ) -> torch.Tensor:
            keep = original(
                pred_probs=pred_probs,
                pred_masks=pred_masks,
                prob_threshold=prob_threshold,
                iou_threshold=iou_threshold,
                **kwargs,
            )
            if self.prompt_frame not in self._nms_frames or pred_probs.numel() == 0:
                return keep
            row = self._nms_frames.index(self.prompt_frame)
            probs, kept = (pred_probs[row], keep[row]) if pred_probs.dim() == 2 else (pred_probs, keep)
            # Exactly the K best: with random weights their masks overlap and NMS would merge them.
            top = torch.topk(probs, min(self.k, probs.numel()))
            kept.zero_()
            kept[top.indices] = True
            self.forced_threshold[self.prompt_frame] = top.values[-1].item() - 1e-6
            self._lower_thresholds_if_forced()
            return keep

        return nms_masks

    @contextlib.contextmanager
    def active(self) -> Iterator[MultiplexForcedDetections]:
        import sam3.model.sam3_multiplex_detector as detector_module

        detector = self.model.detector
        batched = self._chunk(
            detector._process_grounding_chunk_batched, lambda kw: list(range(kw["chunk_start"], kw["chunk_end"]))
        )
        ahead = self._chunk(detector._build_multigpu_buffer_next_chunk, lambda kw: [kw["frame_idx_begin"]])
        with (
            mock.patch.object(detector_module, "nms_masks", self._nms(detector_module.nms_masks)),
            mock.patch.object(detector, "_process_grounding_chunk_batched", batched),
            mock.patch.object(detector, "_build_multigpu_buffer_next_chunk", ahead),
            mock.patch.object(
                self.model, "run_backbone_and_detection", self._detection(self.model.run_backbone_and_detection)
            ),
        ):
            try:
                yield self
            finally:
                self.model.score_threshold_detection, self.model.new_det_thresh = self._thresholds


def _visible_objects(_module: torch.nn.Module, _args: Any, output: Any) -> Any:
    """Verification: SAM 3.1 blanks the mask of an object whose visibility logit is negative.
    Its absolute value keeps random-weight objects. The multiplex decoder returns a dict, the
    interactive (SAM) decoder a tuple whose 4th item is that logit."""
    if isinstance(output, dict) and "object_score_logits" in output:
        return {**output, "object_score_logits": output["object_score_logits"].abs()}
    if isinstance(output, tuple) and len(output) == 4:
        return (*output[:3], output[3].abs())
    return output


@contextlib.contextmanager
def _init_state_accepting_known_kwargs(model: Any) -> Iterator[set[str]]:
    """Meta's `Sam3BasePredictor.start_session` passes `offload_state_to_cpu` (since 2026-04-21),
    which the multiplex model's `init_state` does not take: drop keywords it does not accept."""
    dropped: set[str] = set()
    original = model.init_state
    accepted = set(inspect.signature(original).parameters)

    @functools.wraps(original)
    def init_state(*args: Any, **kwargs: Any) -> Any:
        dropped.update(k for k in kwargs if k not in accepted)
        return original(*args, **{k: v for k, v in kwargs.items() if k in accepted})

    with mock.patch.object(model, "init_state", init_state):
        yield dropped


def _memory_limits(tracker: Any, per_bucket: int) -> list[QuantityLimit | QuantitySchedule]:
    """Memory attention's sequence lengths: each memory frame adds HW image tokens, each
    object-pointer frame `multiplex_count` pointer tokens. With one conditioning frame (the text
    prompt on frame 0), frame t attends to min(t, num_maskmem) memory frames and
    min(t, max_obj_ptrs_in_encoder) pointer frames: that schedule gives the gears."""
    side = int(tracker.sam_image_embedding_size)
    maskmem, max_ptrs = int(tracker.num_maskmem), int(tracker.max_obj_ptrs_in_encoder)
    cond = int(tracker.max_cond_frames_in_attn)
    where = "sam3/model/video_tracking_multiplex.py"
    limits: list[QuantityLimit | QuantitySchedule] = [
        QuantityLimit(
            quantity="memory_frames",
            low=1,
            high=maskmem - 1 + cond,
            evidence=f"{where}: up to max_cond_frames_in_attn={cond} conditioning frames + "
            f"num_maskmem-1={maskmem - 1} previous frames, {side}x{side} tokens each",
            dims=[
                DimRef(input=name, dim=0, scale=side * side)
                for name in ("memory_image", "memory_image_pos", "memory", "memory_pos")
            ],
        ),
        QuantityLimit(
            quantity="object_pointer_frames",
            low=1,
            high=max_ptrs,
            evidence=f"{where}: max_obj_ptrs_in_encoder={max_ptrs}, multiplex_count={per_bucket} "
            "pointer tokens per frame",
            dims=[DimRef(input=name, dim=0, scale=per_bucket) for name in ("memory", "memory_pos")],
        ),
    ]
    if int(tracker.memory_temporal_stride_for_eval) == 1:
        # Forward (or reverse) propagation from one conditioning frame; other prompt layouts fall back.
        limits.append(memory_schedule(maskmem, max_ptrs, f"{where}:1375 and :1479"))
    return limits


class Sam31Driver(SamVideoDriver):
    family = "sam3.1"
    description = (
        "SAM 3.1 (Object Multiplex) from a checkout of Meta's sam3 repository: text-prompted video segmentation"
    )
    source_env = SOURCE_ENV
    builder_args_set_here = ("checkpoint_path", "bpe_path")

    def builder_name(self, spec: ModelSpec) -> str:
        return spec.builder or BUILDER

    def source_root(self, spec: ModelSpec) -> Path:
        return resolve_checkout(spec.source)

    def load(self, spec: ModelSpec) -> LoadedModel:
        builder_name = self.builder_name(spec)
        if builder_name != BUILDER:
            raise TaskRecordError(
                f"intake.model.builder: the sam3.1 driver builds with {BUILDER}, not {builder_name!r}"
            )
        if spec.checkpoint is not None and not Path(spec.checkpoint).is_file():
            raise InputError(f"intake.model.checkpoint: checkpoint file not found: {spec.checkpoint}")
        source_root = self.source_root(spec)
        use_checkout(source_root)
        portability = DevicePortability(spec.device, source_root / "sam3")
        for fix in SAM31_FIXES:
            portability.add_fix(fix)
        for watched in HOST_DEPENDENT_IMPORTS:
            portability.watch_import(watched)
        notes: list[str] = []
        torch.manual_seed(spec.seed)
        # Meta's builder prints load reports to stdout; stdout belongs to the CLI/MCP transport.
        with portability, contextlib.redirect_stdout(sys.stderr):
            model_builder = importlib.import_module("sam3.model_builder")
            builder = getattr(model_builder, BUILDER, None)
            if builder is None:
                raise InputError(
                    f"intake.model.source: {source_root} has no sam3.model_builder.{BUILDER}: {CLONE_HINT}"
                )
            with (
                scaled_builder(model_builder, spec.scale) as downloads,
                deterministic_uninitialised(spec.seed) as filled,
            ):
                predictor = builder(
                    checkpoint_path=spec.checkpoint, bpe_path=str(bpe_vocabulary_path()), **spec.builder_kwargs
                )
            model = predictor.model.eval()
        fixed = reinit_non_finite(model, spec.seed)
        if spec.checkpoint is None:
            notes.append(f"random weights (seed {spec.seed}); {len(filled)} uninitialised tensors seeded")
        if downloads:
            notes.append(f"hub download of the {downloads[0]} checkpoint refused (no checkpoint given: random weights)")
        if fixed:
            notes.append(f"re-initialised non-finite parameters: {', '.join(fixed)}")
        return LoadedModel(
            entry=predictor,
            root=model,
            source_root=source_root,
            weights=spec.checkpoint or "random",
            portability=portability,
            notes=notes,
        )

    @contextlib.contextmanager
    def _session_patches(self, loaded: LoadedModel, notes: list[str]) -> Iterator[None]:
        with _init_state_accepting_known_kwargs(loaded.root) as dropped:
            yield
        if dropped:
            notes.append(
                f"source mismatch worked around: start_session passes {', '.join(sorted(dropped))} "
                f"which {type(loaded.root).__name__}.init_state does not accept (dropped)"
            )

    @contextlib.contextmanager
    def _verification(self, model: Any, verification: SamVerification) -> Iterator[MultiplexForcedDetections | None]:
        with contextlib.ExitStack() as stack:
            if verification.disable_hotstart and model.hotstart_delay > 0:
                stack.enter_context(mock.patch.object(model, "hotstart_delay", 0))
            if verification.keep_objects_visible:
                # Hooked on whatever sits there now (the original decoders or their splices).
                tracker = model.tracker.model
                for decoder in (tracker.sam_mask_decoder, tracker.interactive_sam_mask_decoder):
                    stack.callback(decoder.register_forward_hook(_visible_objects).remove)
            forced = None
            if verification.force_top_k_detections > 0:
                forced = stack.enter_context(
                    MultiplexForcedDetections(model, verification.force_top_k_detections).active()
                )
            yield forced

    def pytree_types(self, loaded: LoadedModel) -> list[type]:
        """The TriHead neck returns DETR-style NestedTensors (tensors + mask), flattened into both."""
        data_misc = sys.modules.get("sam3.model.data_misc")
        nested = getattr(data_misc, "NestedTensor", None)
        return [nested] if isinstance(nested, type) else []

    def provenance_sources(self, loaded: LoadedModel) -> list[ProvenanceSource]:
        """Python callables whose tensor outputs are prompt, image or session inputs."""
        tracking = sys.modules["sam3.model.sam3_multiplex_tracking"]
        tokenizer = loaded.root.detector.backbone.language_backbone.tokenizer
        return [
            ProvenanceSource(type(tokenizer), "__call__", "input", f"{type(tokenizer).__name__} (text prompt tokens)"),
            ProvenanceSource(
                tracking, "load_resource_as_video_frames", "input", "video frames (load_resource_as_video_frames)"
            ),
        ]

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
                "ViT trunk + TriHead ViTDet neck (detector, interactive and propagation heads; NestedTensor outputs), "
                "once per frame",
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
                "tracker.model.transformer.encoder",
                "decoupled memory attention (TransformerEncoderDecoupledCrossAttention) over past frames' "
                "multiplexed memories and object pointers, per frame",
                "tracker_propagation",
            ),
            SeedCandidate(
                "mask_decoder",
                "tracker.model.sam_mask_decoder",
                "MultiplexMaskDecoder: masks of the muxed objects, leading dim = bucket count, per frame",
                "tracker_propagation",
            ),
            SeedCandidate(
                "mask_memory_encoder",
                "tracker.model.maskmem_backbone",
                "SimpleMaskEncoder: multiplexed masks + condition planes (antialiased resize) -> memory features",
                "mask_memory_encoder",
            ),
        ]

    def source_limits(self, loaded: LoadedModel) -> dict[str, list[QuantityLimit | QuantitySchedule]]:
        """The 3.1 source's ranges behind the propagation candidates' varying dims, read from the model.

        Buckets: objects are muxed `multiplex_count` to a bucket, up to `max_num_objects`, so the
        bucket count (leading dim of the decoder and memory encoder, batch dim of the memory
        attention) is 1..ceil(max / count). Memory length: see `_memory_limits`.
        """
        tracker = loaded.root.tracker.model
        per_bucket = int(tracker.multiplex_controller.multiplex_count)
        max_objects = int(loaded.root.max_num_objects)

        def buckets(*dims: tuple[str, int]) -> QuantityLimit:
            return QuantityLimit(
                quantity="num_buckets",
                low=1,
                high=-(-max_objects // per_bucket),
                evidence=f"ceil(max_num_objects {max_objects} / multiplex_count {per_bucket})",
                dims=[DimRef(input=name, dim=d) for name, d in dims],
            )

        return {
            "mask_decoder": [
                buckets(
                    ("image_embeddings", 0),
                    ("high_res_features_0", 0),
                    ("high_res_features_1", 0),
                    ("extra_per_object_embeddings", 0),
                )
            ],
            "mask_memory_encoder": [buckets(("pix_feat", 0), ("masks", 0))],
            "memory_attention": [
                *_memory_limits(tracker, per_bucket),
                buckets(("src", 1), ("src_pos", 1), ("memory", 1), ("memory_pos", 1)),
            ],
        }

    def derived_args(self) -> dict[str, dict[str, ShapeDerivedArg]]:
        return {
            "memory_attention": {
                "kwargs['num_obj_ptr_tokens']": ShapeDerivedArg(
                    expression="memory.shape[0] - memory_image.shape[0]",
                    evidence="sam3/model/decoder.py:1371 asserts "
                    "memory.shape[1] - memory_image.shape[1] == num_obj_ptr_tokens (batch first)",
                )
            }
        }

    def control_plane_notes(self) -> list[str]:
        """What stays in Python around the candidates, and why (for the record's control plane)."""
        return [
            "MultiplexState / MultiplexController (sam3/model/multiplex_utils.py) stay in Python: mux and demux are "
            "matmuls with 0/1 assignment matrices that a Python loop fills from the object-to-bucket assignment "
            "(_precompute_transition_matrices); they hold no parameters, and the assignment changes whenever objects "
            "are added or removed, so it is session state, not a graph. The candidates receive already-muxed "
            "(num_buckets, multiplex_count, ...) tensors.",
            "Tracker inference states stay in Python: objects added on the same frame share one state "
            "(sam3_multiplex_base.py _propogate_tracker_one_frame_local_gpu loops over the states); within a state "
            "the propagation candidates take the state's bucket count (1..ceil(max_num_objects / multiplex_count)) "
            "as their leading dim, and the bucket assignment (MultiplexState) is rebuilt in Python when objects "
            "are added or removed.",
            "Detection-to-track association, hot-start, masklet confirmation and NMS post-processing stay in Python "
            "(data-dependent control flow over a variable number of detections).",
        ]
