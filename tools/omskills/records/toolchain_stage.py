"""Per-candidate results of stage 3 kept in the task record."""

from __future__ import annotations

from omskills.records.base import Record
from omskills.records.parity import ParityReport
from omskills.records.precision import PrecisionReport
from omskills.records.toolchain import AtcResult, BatchIndependence, BatchSplit, OpPrecheck, OptimizeResult
from pydantic import Field


class CandidateToolchain(Record):
    probes: dict[str, ParityReport] = Field(default_factory=dict)  # variant -> probe on captured samples
    batch_split: BatchSplit | None = None  # how ONNX Runtime runs it here, when not the whole batch at once
    # Whether its batch items are computed independently (None: not checked, a record written before)
    batch_independence: BatchIndependence | None = None
    optimize: OptimizeResult | None = None
    precheck: OpPrecheck | None = None
    precision: PrecisionReport | None = None  # Ascend precision modes emulated on CPU (emulate_precision)
    atc: AtcResult | None = None
