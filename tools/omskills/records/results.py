"""What the stage functions (and so the skill tools) return beyond the records stored in the task record.

These models live here, apart from the stages that build them, so that a tool script can name its
result type without importing torch, onnx or a driver: discovering the tools (the MCP server's
start, `omskills tool --list`) reads every tool's signature and output schema. Each field carries a
description; it is the tool's output schema an MCP client shows.
"""

from __future__ import annotations

from typing import Generic, Literal, TypeVar

from omskills.records.base import Record
from omskills.records.contracts import BoundaryDecision, ContractSpec
from omskills.records.export import ExportResult
from omskills.records.main_path import OutputSummary
from omskills.records.parity import ParityReport
from omskills.records.precision import PrecisionReport
from omskills.records.toolchain import AtcResult, OpPrecheck, OptimizeResult
from pydantic import BaseModel, Field

# --------------------------------------------------------------------------- study (profile_main_path)


class ModuleShare(Record):
    path: str = Field(description="Module path in the model (e.g. 'backbone.trunk').")
    module_class: str = Field(description="The module's class name.")
    share: float = Field(description="Share of the main path's time spent inside this module (0..1, inclusive time).")
    calls: int = Field(description="How many times the main path called it.")
    calls_per_frame: float | None = Field(
        description="Calls per step of the main path (e.g. per video frame); null without steps."
    )


class ProfileSummary(Record):
    weights: str = Field(
        description=(
            "The weights the model was built with: the files its build read with their sha256, what its driver "
            "declares, or 'random' (the generators seeded with intake.model.seed)."
        )
    )
    scale: str = Field(description="Model scale the run used: 'full' or 'tiny'.")
    frames: int = Field(description="Steps (e.g. video frames) the main path ran.")
    total_seconds: float = Field(description="Wall time of the instrumented main path, in seconds.")
    control_plane_seconds: float = Field(description="Seconds spent outside every module (Python control plane).")
    top_modules: list[ModuleShare] = Field(description="The heaviest modules by inclusive time, heaviest first.")
    seeds_from: Literal["driver", "profile"] = Field(
        description=(
            "Where the seed candidates came from: named by the driver, or the heaviest subtrees of a profile-only run."
        )
    )
    candidate_shares: dict[str, float] = Field(
        default_factory=dict, description="Seed candidate name -> share of the main path's time."
    )
    main_path_json: str = Field(
        description="Run-folder path of the JSON with the main path's outputs (the reference for verify)."
    )


# --------------------------------------------------------------------------- pipeline-adapter


class ContractsResult(Record):
    contracts: list[ContractSpec] = Field(
        description="One I/O contract per graph of the selected candidates (tensors, dims that vary, samples)."
    )
    table_path: str = Field(description="Run-folder path of contracts/contracts.md, the contracts as a table.")


class BoundariesResult(Record):
    decisions: list[BoundaryDecision] = Field(
        description="Per graph: exportability verdict with reasons and the one proposed ATC shape strategy."
    )
    table_path: str = Field(description="Run-folder path of contracts/boundaries.md.")
    control_plane: list[str] = Field(
        default_factory=list, description="What stays in Python around the graphs (control plane)."
    )


# --------------------------------------------------------------------------- onnx-atc-pipeline batches


class CandidateFailure(Record):
    candidate: str = Field(description="The candidate (graph) whose step failed.")
    error: str = Field(description="Why, in one line.")


ResultT = TypeVar("ResultT", bound=BaseModel)


class CandidateBatch(Record, Generic[ResultT]):
    """One step over several candidates: the results, and the candidates that failed with why."""

    results: dict[str, ResultT] = Field(
        default_factory=dict, description="Candidate (graph) name -> the step's result for it."
    )
    failed: list[CandidateFailure] = Field(
        default_factory=list, description="Candidates whose step failed; the others went on."
    )
    skipped: dict[str, str] = Field(
        default_factory=dict,
        description=(
            "Candidates the step did not run for -> why (an earlier step of theirs failed: nothing to work on)."
        ),
    )


ExportBatch = CandidateBatch[ExportResult]
ProbeBatch = CandidateBatch[ParityReport]
OptimizeBatch = CandidateBatch[OptimizeResult]
PrecheckBatch = CandidateBatch[OpPrecheck]
PrecisionBatch = CandidateBatch[PrecisionReport]
AtcBatch = CandidateBatch[AtcResult]


# --------------------------------------------------------------------------- validate_driver


class CandidateCheck(BaseModel):
    name: str = Field(description="Seed candidate name.")
    module_path: str = Field(description="Its module path in the model.")
    share: float = Field(description="Share of the main path's time inside it (0..1).")
    calls: int = Field(description="Calls during the tiny main path.")
    graphs: int = Field(description="Contracts it yields: more than one when dispatched on a non-tensor argument.")
    exportable: bool = Field(description="Whether its contracts are ones a graph can take.")
    reason: str = Field(description="Why (or why not) exportable.")


class DriverCheck(BaseModel):
    ok: bool = Field(description="True when no problem was found.")
    task: str = Field(description="The task record checked.")
    family: str | None = Field(default=None, description="The driver's model family.")
    driver: str | None = Field(default=None, description="The driver class, 'module:Class'.")
    steps: int = Field(default=0, description="Steps the main path ran.")
    step_name: str = Field(default="step", description="What the driver calls one step (e.g. 'frame').")
    outputs: list[OutputSummary] = Field(
        default_factory=list, description="The first step's outputs: name, shape, dtype, summary values."
    )
    comparison: list[str] = Field(default_factory=list, description="Outputs the verification compares.")
    modules: int = Field(default=0, description="nn.Module count of the tiny model.")
    parameters: int = Field(default=0, description="Parameter count of the tiny model.")
    seeds_from: str | None = Field(
        default=None, description="Where the seed candidates came from: 'driver' or 'profile'."
    )
    candidates: list[CandidateCheck] = Field(
        default_factory=list, description="Each seed candidate with its share and exportability."
    )
    problems: list[str] = Field(default_factory=list, description="Everything found missing or wrong, one line each.")
    notes: list[str] = Field(
        default_factory=list, description="What the driver noted while building and running (not problems)."
    )


# --------------------------------------------------------------------------- write_bundle


class RememberedGraph(Record):
    entries: int = Field(description="Calls computed ahead (distinct inputs), answered from memory when deployed.")
    bytes: int = Field(description="Size of the file holding their outputs.")
    path: str = Field(description="That file, relative to the bundle (memo/<graph>.npz).")


class BundleSummary(Record):
    path: str = Field(description="The bundle folder.")
    graphs: list[str] = Field(description="Graphs in the bundle.")
    files: int = Field(description="Files written.")
    bytes: int = Field(description="Total size of the bundle in bytes.")
    om_graphs: list[str] = Field(description="Graphs that ship an OM (built by ATC); the others ship ONNX only.")
    not_deployed: dict[str, str] = Field(description="Candidate -> why it is not in the bundle (stays in PyTorch).")
    required: dict[str, str] = Field(
        description="What the loader must be given that the bundle does not hold (e.g. a model source checkout)."
    )
    remembered: dict[str, RememberedGraph] = Field(
        default_factory=dict,
        description=(
            "Graph -> the calls whose outputs the bundle carries, computed ahead for the inputs given to --precompute "
            "(on ONNX Runtime CPU, fp32): the deployed model answers those calls from memory."
        ),
    )
    not_remembered: dict[str, str] = Field(
        default_factory=dict,
        description=(
            "With --precompute: graph -> why the bundle carries no call of it (an input that comes from session "
            "state, a random op or untraced code; inputs too big to digest; not called on the inputs given)."
        ),
    )


# --------------------------------------------------------------------------- drivers (list_drivers)


class DriverListing(BaseModel):
    family: str = Field(description="The model family name a task record gives as intake.model.family.")
    reference: str = Field(description="The driver class, as 'package.module:Class'.")
    origin: str = Field(
        description="Where the entry comes from: the distribution whose entry point registered it, or code."
    )
    description: str = Field("", description="What the driver adapts, from its class.")
    error: str | None = Field(None, description="Why the driver cannot be loaded here; null when it loads.")
