"""What a deployment carries: the graphs that replace PyTorch modules, their files, their contracts.

A `DeployManifest` is read from a verified task record (the run folder is its root), or stored as
`bundle.json` at the root of a bundle that `omskills bundle` wrote. Every path in it is relative
to that root, so a bundle can be moved.
"""

from __future__ import annotations

from pathlib import Path

from omskills.records.base import Record
from omskills.records.contracts import ContractSpec, ShapeStrategy
from omskills.records.glue import SlotUse
from omskills.records.intake import Intake
from omskills.records.names import RunPath, SafeName
from omskills.records.toolchain import BatchIndependence, BatchSplit
from pydantic import Field

# Raised when the bundle layout or the meaning of a field changes; a loader refuses other formats.
BUNDLE_FORMAT = 1


def external_data_path(model: Path) -> Path:
    """Where omskills saves a large graph's weights: "<name>.onnx.data" beside it."""
    return model.with_name(model.name + ".data")


def onnx_files(model: Path) -> list[Path]:
    """The files an ONNX model is stored in: the .onnx, and its external weights when it has them."""
    data = external_data_path(model)
    return [model, data] if data.is_file() else [model]


class ArtifactFile(Record):
    path: RunPath  # relative to the manifest's root
    bytes: int
    sha256: str | None = None  # set in a bundle, checked when it loads


class Artifact(Record):
    """One compiled form of a graph (ONNX or OM): its main file first, then the files it needs."""

    files: list[ArtifactFile] = Field(min_length=1)

    @property
    def path(self) -> str:
        return self.files[0].path


class DeployedGraph(Record):
    name: SafeName  # the graph (a plan candidate, or one of a dispatched candidate's graphs)
    plan_candidate: SafeName
    module_path: str
    contract: ContractSpec
    strategy: ShapeStrategy | None = None  # the ATC shape strategy the OM is built with
    # How ONNX Runtime on the CPU runs the batch (probe_onnx found the whole batch does not fit).
    batch_split: BatchSplit | None = None
    # Whether its batch items are computed independently: a batch that is no gear runs as gear-sized
    # calls only when they are (None: not checked, a bundle written before; it is not split).
    batch_independence: BatchIndependence | None = None
    onnx: Artifact
    om: Artifact | None = None  # None: ATC has not built it (no CANN where the adaptation ran)
    precision_mode: str | None = None  # the ATC precision mode chosen in emulation
    keep_dtype_nodes: list[str] = Field(default_factory=list)
    atc_script: RunPath | None = None
    # Outputs computed ahead for inputs known when the bundle was written (`bundle --precompute`,
    # splicing.memo): the deployed model answers those calls from memory.
    remembered: ArtifactFile | None = None


class DeployedMerge(Record):
    """Deployed graphs composed into one and verified on the main path (verify's merged run): a
    call of the first runs it, and the calls of the others that follow, each given the outputs of
    the one before it unchanged, are answered from that call."""

    name: SafeName
    graphs: list[SafeName]  # the members, in call order
    io_maps: list[dict[str, str]]  # per member after the first: its input -> the output of the member before it
    prefixes: list[str]  # per member after the first: the prefix of its names in the composed graph
    # Per member after the first: {} for an unchanged hand-off; for a widened boundary, its input -> the
    # digest of the host code computing it (answered inside the composed graph only when that matches).
    recipes: list[dict[str, str]] = Field(default_factory=list)
    slots: list[list[SlotUse]] = Field(default_factory=list)  # per member after the first: what its recipes rest on
    onnx: Artifact
    precision_mode: str | None = None  # the slowest of the members' chosen modes
    atc_script: RunPath | None = None


class DeployManifest(Record):
    format: int = BUNDLE_FORMAT
    # The task record's schema the contracts were written under (records.task.SCHEMA_VERSION).
    contract_schema: int
    omskills_version: str
    task_id: str
    created: str
    intake: Intake  # the model to build, the inputs of the example and the target device, paths relative to the root
    weights: str  # the weights label the graphs were verified with (omskills.models.weights)
    verified: str  # the verify verdict the graphs come from, with its figures
    graphs: list[DeployedGraph]
    # Chains of graphs served by one composed graph each on ONNX Runtime (an OM of one is built from its script).
    merged: list[DeployedMerge] = Field(default_factory=list)
    not_deployed: dict[str, str] = Field(default_factory=dict)  # candidate -> why it stays in PyTorch
    # What a bundle could not carry and its loader must be given: "source" (a checkout of the model's
    # code) or "checkpoint" -> what it was.
    required: dict[str, str] = Field(default_factory=dict)

    def graph(self, name: str) -> DeployedGraph:
        found = next((g for g in self.graphs if g.name == name), None)
        if found is None:
            raise KeyError(name)
        return found
