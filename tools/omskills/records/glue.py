"""Records of the host code between two deployed graphs (the glue of a hop) and what became of it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Literal

from omskills.records.base import Record
from omskills.records.details import DETAIL
from omskills.records.names import RunPath, SafeName
from pydantic import Field

GlueKind = Literal["tensor-only", "data-dependent", "python-state", "varies-per-call"]
HopDecision = Literal["widened", "kept in Python"]


class GlueCost(Record):
    """What a hop's glue costs per step where it runs now, and what moving it would save and cost."""

    host_ms_per_step: float = Field(description="Host time of the glue's torch operations per step (measured).")
    fed_bytes_per_step: float = Field(
        description=(
            "Bytes per step of the consumer's inputs, and of the producer's outputs those rest on: what crosses "
            "the link for this hop now."
        )
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


class SlotUse(Record):
    """Something a hop's glue rests on that is not the producer's output: a tensor no graph made, or a
    value computed before the producer's call."""

    dtype: str = Field(description="Its dtype.")
    shape: list[int] = Field(description="Its shape.")
    constant: bool = Field(
        description="True when its values were the same in every call: the widened graph holds it as a constant."
    )
    value: str | None = Field(None, description="Its value digest when constant (checked at every call).")
    nbytes: int = Field(description="Its bytes: what the widened graph is fed per call when it is not a constant.")
    source: str | None = Field(
        None,
        description=(
            "When it is an earlier graph call's output ('output:<graph>/<name>') or what an earlier graph call was "
            "given ('input:<graph>/<name>'), the same in every call: a chain composing that graph computes it inside."
        ),
    )

    def chained(self, earlier: Sequence[str]) -> tuple[str, str, str] | None:
        """(kind, graph, name) when a chain whose members before this link are `earlier` computes this
        slot inside: an output of one of them, or an input of one after the first; else None."""
        if self.constant or not self.source:
            return None
        kind, _, where = self.source.partition(":")
        graph, _, name = where.partition("/")
        inside = earlier if kind == "output" else earlier[1:]
        return (kind, graph, name) if graph in inside else None


def composed_prefix(member: str) -> str:
    """The prefix of a later member's names inside a composed graph (`convert.compose`)."""
    return f"{member}."


def glue_name(producer: str, consumer: str) -> str:
    """The name of the glue graph between two members of a chain (its names' prefix in the composed graph)."""
    return f"{producer}_glue_{consumer}"


class HopGlue(Record):
    """The host code between one deployed graph's outputs and the next graph's inputs."""

    producer: SafeName = Field(description="The graph whose outputs the glue reads.")
    consumer: SafeName = Field(description="The graph whose inputs the glue computes.")
    inputs: list[str] = Field(description="The consumer's inputs computed by the glue (not handed on unchanged).")
    passed: list[str] = Field(
        default_factory=list, description="The consumer's inputs that are the producer's outputs, unchanged."
    )
    slots: Annotated[list[SlotUse], DETAIL] = Field(
        default_factory=list,
        description=(
            "For a tensor-only hop, in the recipes' order: what the glue rests on besides the producer's outputs "
            "(constants, and inputs such as another graph's earlier outputs)."
        ),
    )
    ops: list[str] = Field(description="The glue's torch operations, in order (one call's).")
    sites: Annotated[list[str], DETAIL] = Field(
        default_factory=list, description="Where the host code runs them (file:line, innermost frame outside torch)."
    )
    kind: GlueKind = Field(
        description=(
            "'tensor-only': torch operations on the producer's outputs, constants and values made before the "
            "producer's call, the same in every call (can go into a graph); 'data-dependent': host code reads the "
            "producer's values into Python, or makes a shape from values; 'python-state': an operation takes a "
            "Python object, writes through a view, or a value it starts from is gone; 'varies-per-call': the "
            "operations, the producer or the call pattern differ between calls."
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
            "When proposed: consumer input -> the digest of the operations that computed it from the producer's "
            "outputs and the slots (contracts.recipes); a call is answered inside the widened graph only when "
            "the host computed its inputs the same way and each constant slot holds its value."
        ),
    )


class GlueReport(Record):
    """Every hop between deployed graphs seen in one spliced run, with its glue."""

    hops: list[HopGlue] = Field(description="Per (producer, consumer) pair whose glue the run saw.")
    steps: int = Field(description="Steps of the run the capture saw.")
    error: str | None = Field(
        None, description="Why the capture stopped before the run's end (the hops after it are not listed)."
    )
    label: str = Field(
        "captured from a spliced run of the main path (the deployed graphs on ONNX Runtime); link and device "
        "times predicted by the cost model, not measured on a device",
        description="What the figures are.",
    )
