"""Stage 4 records: the spliced main path against the PyTorch reference."""

from __future__ import annotations

from pydantic import Field

from omskills.records.base import Record
from omskills.records.export import FallbackEvent, SpliceStats


class FrameParity(Record):
    frame: int
    reference_ids: list[int]
    spliced_ids: list[int]
    obj_ids_equal: bool
    mask_iou: dict[str, float]  # object id -> IoU
    max_box_diff: float
    max_score_diff: float
    torch_seconds: float
    spliced_seconds: float


class CandidateVerification(Record):
    name: str
    status: str
    backend: str
    probe: dict[str, float | str | None]  # verdict, cosine, max_abs
    torch_ms_per_call: float | None
    backend_ms_per_call: float | None
    calls: int
    fallbacks: int


class MainPathParity(Record):
    frames: int
    obj_ids_equal: bool
    min_mask_iou: float
    fallbacks: int
    torch_s_per_frame: float
    spliced_s_per_frame: float
    latency_ratio: float  # spliced / torch, same process, same frames


class VerifyReport(Record):
    task_id: str
    weights: str
    scale: str
    backend: str
    backend_per_candidate: dict[str, str]
    not_spliced: dict[str, str] = Field(default_factory=dict)  # candidate -> why it stayed in PyTorch
    candidates: list[CandidateVerification]
    main_path: MainPathParity
    per_frame: list[FrameParity]
    splice_stats: list[SpliceStats]
    fallback_events: list[FallbackEvent]
    verification_settings: list[str]
    report_json: str
    report_html: str
    verdict: str  # "pass" when ids equal, min IoU >= 0.99 and zero fallbacks
