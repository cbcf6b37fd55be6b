"""The candidate plan (stage 1): which heavy subtrees to adapt first, and why."""

from __future__ import annotations

from typing import Annotated, Literal

from omskills.records.base import Record
from omskills.records.contracts import QuantityLimit, QuantitySchedule
from omskills.records.details import DETAIL
from omskills.records.names import RunPath, SafeName
from pydantic import Field

CandidateStatus = Literal[
    "pending",
    "selected",
    "deferred",
    "excluded",
    "exported",
    "optimised",
    "converted",
    "validated",
    "integrated",
    "failed",
    "fallback",
]


class Candidate(Record):
    name: SafeName
    module_path: str
    module_class: str
    description: str
    group: str = ""  # the seed subtree it belongs to (e.g. detector_grounding)
    share: float  # inclusive wall-time share of the main path
    calls: int
    calls_per_frame: float | None
    params: int
    boundary_clarity: float  # 1.0 = tensors only in/out, constant non-tensor args
    state_dependent: bool  # reads session state (memories, caches) across frames
    score: float
    rank: int
    status: CandidateStatus
    reason: str
    # Set while it is deferred because it runs inside that selected candidate: if the outer one
    # cannot be exported, this one is deployed instead.
    inside: str | None = None
    # Where the stages put this candidate's artefacts (ONNX, OM) once produced.
    onnx_path: RunPath | None = None
    om_path: RunPath | None = None


class Plan(Record):
    candidates: list[Candidate] = Field(
        description=(
            "Every seed candidate, highest score (share x boundary clarity x state factor) first, "
            "with its status and the reason for it."
        )
    )
    first_batch: list[SafeName] = Field(
        description=(
            "The candidates to adapt first: exportable, at or above the minimum share of main-path time "
            "the rationale names (or named in intake.target.deploy), not named in intake.target.defer, "
            "and not inside another selected one."
        )
    )
    rationale: str = Field(
        description="How the first batch was chosen, and the share of main-path wall time it covers."
    )
    report_path: RunPath | None = Field(
        None, description="Run-folder path of the inventory report (plan/inventory_report.md)."
    )
    chart_path: RunPath | None = Field(
        None,
        description="Run-folder path of the compute-share chart (plan/compute_share.png); null when none was drawn.",
    )

    def candidate(self, name: str) -> Candidate | None:
        return next((c for c in self.candidates if c.name == name), None)

    def selected(self) -> list[Candidate]:
        return [c for c in self.candidates if c.name in self.first_batch]


class Seed(Record):
    """A subtree whose calls the study records: named by the driver, or found in a profile."""

    name: SafeName
    module_path: str
    description: str = ""
    group: str = ""


class StudyRun(Record):
    """The one instrumented run of the main path that feeds the profile and the contracts."""

    inputs_hash: str
    main_path_json: RunPath
    seeds: Annotated[list[Seed], DETAIL] = Field(default_factory=list)
    # "driver": its seed candidates; "profile": the heaviest subtrees of a discovery run's profile.
    seeds_from: Literal["driver", "profile"] = "driver"
    contracts_captured: list[str] = Field(default_factory=list)
    seconds: float
    # Per candidate, the ranges the driver read from the built model (for the shape strategy).
    source_limits: Annotated[dict[str, list[QuantityLimit | QuantitySchedule]], DETAIL] = Field(default_factory=dict)
    # The weights the model ran with (omskills.models.weights): the files its build read with their
    # sha256, what its driver declares, or "random" (None in records written before it was kept).
    weights: str | None = None
