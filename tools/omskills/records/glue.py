"""Records of the host code between two deployed graphs (the glue of a hop) and what became of it."""

from __future__ import annotations

from typing import Annotated, Literal

from omskills.records.base import Record
from omskills.records.details import DETAIL
from omskills.records.names import RunPath, SafeName
from pydantic import Field

GlueKind = Literal["tensor-only", "data-dependent", "python-state", "varies-per-call", "several-sources"]
HopDecision = Literal["widened", "kept in Python"]


class GlueCost(Record):
    """What a hop's glue costs per step where it runs now, and what moving it would save and cost."""

    host_ms_per_step: float = Field(description="Host time of the glue's torch operations per step (measured).")
    fed_bytes_per_step: float = Field(
        description="Bytes per step of the consumer's inputs the glue computes: what crosses the link to it now."
    )
    fed_copies_per_step: float = Field(description="Input copies per step those inputs take.")
    consumer_calls_per_step: float = Field(description="Calls of the consumer per step.")
    touched_bytes_per_step: float = Field(
        description="Bytes the glue's operations read and write per step: what the device would move to run it."
    )
    link_saved_ms_per_step: float = Field(
        description=(
            "Predicted (not measured) link time a widened boundary saves per step: the consumer's launches and "
            "input copies, (calls x (1 + inputs)) x round trip + bytes / link bandwidth."
        )
    )
    device_ms_per_step: float = Field(
        description=(
            "Predicted (not measured) device time of the moved glue per step: touched bytes / the device's "
            "memory bandwidth (glue is reshapes, scales and joins: memory-bound)."
        )
    )


class HopGlue(Record):
    """The host code between one deployed graph's outputs and the next graph's inputs."""

    producer: SafeName = Field(description="The graph whose outputs the glue reads.")
    consumer: SafeName = Field(description="The graph whose inputs the glue computes.")
    inputs: list[str] = Field(description="The consumer's inputs computed by the glue (not handed on unchanged).")
    passed: list[str] = Field(
        default_factory=list, description="The consumer's inputs that are the producer's outputs, unchanged."
    )
    ops: list[str] = Field(description="The glue's torch operations, in order (one call's).")
    sites: Annotated[list[str], DETAIL] = Field(
        default_factory=list, description="Where the host code runs them (file:line, innermost frame outside torch)."
    )
    kind: GlueKind = Field(
        description=(
            "'tensor-only': torch operations on the producer's outputs and constants, the same in every call (can "
            "go into a graph); 'data-dependent': host code read values into Python or made a shape from values; "
            "'python-state': it reads tensors that are not the producer's outputs or constants (state, user "
            "inputs); 'varies-per-call': the operations differ between calls; 'several-sources': it also reads "
            "another graph's outputs."
        )
    )
    why: str = Field(description="What the kind rests on, from the capture.")
    cost: GlueCost = Field(description="Its cost per step, and the cost model's figures for moving it.")
    decision: HopDecision = Field(description="What the boundary optimisation did with it.")
    decision_why: str = Field(description="Why.")
    glue_onnx: RunPath | None = Field(None, description="Run-folder path of the glue exported as its own graph.")
    recipes: Annotated[dict[str, str], DETAIL] = Field(
        default_factory=dict,
        description=(
            "Consumer input -> the digest of the operations that computed it from the producer's outputs: a "
            "call is answered inside the widened graph only when the host computed its inputs the same way."
        ),
    )


class GlueReport(Record):
    """Every hop between deployed graphs seen in one spliced run, with its glue."""

    hops: list[HopGlue] = Field(description="Per (producer, consumer) pair whose glue the run saw.")
    steps: int = Field(description="Steps of the run the capture saw.")
    label: str = Field(
        "captured from a spliced run of the main path (the deployed graphs on ONNX Runtime); link and device "
        "times predicted by the cost model, not measured on a device",
        description="What the figures are.",
    )
