"""Results of one run of the main path (start_session -> add_prompt -> propagate_in_video)."""

from __future__ import annotations

from pydantic import Field

from omskills.records.base import Record
from omskills.records.inventory import PortabilityFinding


class FrameRecord(Record):
    frame: int
    obj_ids: list[int]
    scores: list[float]
    boxes_xywh: list[list[float]]
    mask_areas: list[int]
    seconds: float


class MainPathReport(Record):
    task_id: str
    model_family: str
    scale: str
    weights: str  # "random" or the checkpoint path
    device: str
    prompt: str
    video: str
    num_frames: int
    verification: list[str] = Field(default_factory=list)  # settings that were on, said plainly
    load_seconds: float
    prompt_seconds: float
    total_seconds: float
    seconds_per_frame: float
    peak_rss_mb: float
    frames: list[FrameRecord]
    masks_path: str
    overlays: list[str]
    portability_findings: list[PortabilityFinding]
    notes: list[str] = Field(default_factory=list)

    @property
    def tracked_every_frame(self) -> bool:
        return all(f.obj_ids for f in self.frames)
