"""Records of what a spliced run moved between host and device, and the link time it predicts."""

from __future__ import annotations

from typing import Annotated, Literal

from omskills.records.base import Record
from omskills.records.details import DETAIL
from omskills.records.glue import SlotUse
from omskills.records.names import AtcArgv, RunPath, SafeName
from omskills.records.precision import EmulatedResult
from pydantic import Field


class GraphTraffic(Record):
    """One graph's backend calls over a step (or a run)."""

    graph: SafeName = Field(description="The graph (candidate) the calls went to.")
    calls: int = Field(description="Backend calls (fallbacks to PyTorch move nothing and are not counted).")
    bytes_in: int = Field(description="Bytes of the inputs the calls sent: what a host copies to the device.")
    bytes_out: int = Field(
        description=(
            "Bytes of the outputs the calls copied back to the host; an output the study saw no host code "
            "read stays on the device and counts only when it is read after all."
        )
    )
    copies: int = Field(
        0, description="Tensors copied in or out by the calls (each a host<->device copy on the target)."
    )
    handed_in: int = Field(
        0,
        description=(
            "Input bytes that were another graph's output, passed on unchanged by the code between them: "
            "a hand-off that could stay on the device."
        ),
    )
    handed_copies: int = Field(0, description="How many of the input copies were such hand-offs.")
    handed_from: dict[str, int] = Field(
        default_factory=dict, description="Producing graph -> bytes of `handed_in` it produced."
    )
    resident_copies: int = Field(
        0,
        description=(
            "Input copies not made: hand-offs given to the runtime as the producing session's own value "
            "(counted, not predicted)."
        ),
    )
    resident_in: int = Field(0, description="Bytes of those inputs.")
    input_sources: dict[str, str] = Field(
        default_factory=dict,
        description=(
            "Input -> '<graph>/<output>' when every call was given that output of that graph unchanged; '' when "
            "host code gave it at least once (or different outputs fed it)."
        ),
    )
    merged_calls: int = Field(
        0,
        description=(
            "Calls answered inside another graph's call by a merged graph (no launch, no input copied); "
            "their outputs still cross back and are counted in bytes_out."
        ),
    )
    merged_into: str | None = Field(None, description="The graph whose calls computed it, when merged.")


class StepTraffic(Record):
    """Every graph's calls in one step of the main path."""

    step: int | None = Field(description="The step's index; None for calls after the last step (teardown).")
    graphs: list[GraphTraffic] = Field(description="Per graph called in the step.")

    @property
    def calls(self) -> int:
        """Backend calls in the step."""
        return sum(g.calls for g in self.graphs)

    @property
    def bytes_crossing(self) -> int:
        """Bytes crossing the link in the step, both ways."""
        return sum(g.bytes_in + g.bytes_out for g in self.graphs)

    @property
    def copies(self) -> int:
        """Tensors copied in or out in the step."""
        return sum(g.copies for g in self.graphs)

    @property
    def handed_copies(self) -> int:
        """Input copies in the step that were hand-offs."""
        return sum(g.handed_copies for g in self.graphs)

    @property
    def handed_in(self) -> int:
        """Input bytes in the step that were another graph's output, unchanged."""
        return sum(g.handed_in for g in self.graphs)

    @property
    def resident_copies(self) -> int:
        """Input copies in the step that a device-resident hand-off avoided."""
        return sum(g.resident_copies for g in self.graphs)


class LinkCost(Record):
    """The host<->device link of the target, as the cost model sees it."""

    soc: str = Field(description="The target SoC (intake.target.soc).")
    bandwidth_gb_s: float | None = Field(
        gt=0,
        description=(
            "Host<->device copy bandwidth per direction, GB/s; None where host and NPU share memory (no link to cross)."
        ),
    )
    round_trip_us: float = Field(
        ge=0,
        description=(
            "Fixed cost of one synchronous host<->device operation (a launch, or a copy whatever its size), "
            "microseconds."
        ),
    )
    source: str = Field(
        description="Where the figures come from: intake.target, or the published figures they rest on."
    )


class MergeProposal(Record):
    """Whether a graph could run inside the same call as the graph that feeds it, and why (not)."""

    graph: SafeName = Field(description="The graph whose calls a merge would remove.")
    upstream: str | None = Field(description="The graph whose outputs it reads unchanged, if any (the largest source).")
    mergeable: bool = Field(
        description=(
            "True when every input byte is `upstream`'s output passed on unchanged "
            "and the two are called equally often."
        )
    )
    reason: str = Field(description="Why it can or cannot merge, from the counted calls and hand-offs.")
    calls_saved_per_step: float = Field(0.0, description="Backend calls per step the merge would remove.")
    bytes_saved_per_step: float = Field(0.0, description="Input bytes per step that would no longer cross the link.")
    io_map: dict[str, str] = Field(
        default_factory=dict,
        description=(
            "When mergeable: each of its inputs -> the upstream graph's output that fed it, unchanged, in every call."
        ),
    )
    recipes: Annotated[dict[str, str], DETAIL] = Field(
        default_factory=dict,
        description=(
            "When the host code between the two is to be taken into the merged graph (a widened boundary): each "
            "input -> the digest of how the host computes it from the upstream graph's outputs (records.glue)."
        ),
    )
    slots: Annotated[list[SlotUse], DETAIL] = Field(
        default_factory=list, description="With `recipes`: the slots those recipes rest on (records.glue.SlotUse)."
    )


class TrafficReport(Record):
    """Calls and bytes of the spliced run, and the host<->device time they predict on the target."""

    per_step: Annotated[list[StepTraffic], DETAIL] = Field(description="Each step's calls and bytes per graph.")
    per_graph: Annotated[list[GraphTraffic], DETAIL] = Field(
        description="Each graph's calls and bytes over the whole run."
    )
    link: Annotated[LinkCost, DETAIL] = Field(description="The link figures the prediction uses.")
    calls_per_step: float = Field(description="Mean backend calls per step.")
    copies_per_step: float = Field(description="Mean tensors copied in or out per step.")
    bytes_per_step: float = Field(description="Mean bytes crossing the link per step, both ways.")
    handed_in_per_step: float = Field(
        description="Mean input bytes per step that were another graph's output, unchanged."
    )
    predicted_link_s_per_step: float = Field(
        description=(
            "Predicted (not measured) host<->device seconds per step: "
            "(calls + copies) x round trip + bytes / bandwidth."
        )
    )
    predicted_link_s_per_step_handed_off: float = Field(
        description=("The same prediction with every unchanged hand-off kept on the device (its copy in not made).")
    )
    resident_copies_per_step: float = Field(
        0.0,
        description=(
            "Mean input copies per step avoided by handing an output on as the runtime's own value (counted)."
        ),
    )
    merges: Annotated[list[MergeProposal], DETAIL] = Field(
        default_factory=list,
        description=(
            "Per called graph, whether it could merge with the graph feeding it, from the counts "
            "(verify builds the merged graphs of those that can and reports them apart)."
        ),
    )
    label: str = Field(
        "predicted by a cost model from counted calls and bytes, not measured on a device",
        description="What the predicted figures are.",
    )


class MergedGraph(Record):
    """Graphs composed into one (a chain of merge proposals taken), and what became of it."""

    name: SafeName = Field(description="The composed graph's name: '<first>_to_<last>'.")
    graphs: list[SafeName] = Field(
        description=(
            "The members in call order: the first's calls run the composed graph; each later one is answered inside "
            "that call when its inputs are the member before it's outputs, unchanged."
        )
    )
    io_maps: Annotated[list[dict[str, str]], DETAIL] = Field(
        description="Per member after the first: each input -> the output of the member before it."
    )
    prefixes: list[str] = Field(
        default_factory=list,
        description=(
            "Per member after the first: the prefix of its names (inputs, outputs) inside the composed graph."
        ),
    )
    recipes: Annotated[list[dict[str, str]], DETAIL] = Field(
        default_factory=list,
        description=(
            "Per member after the first: {} when it reads the member before it's outputs unchanged; for a widened "
            "boundary, each input -> the digest of the host code the composed graph computes it by (a call is "
            "answered inside the composed graph only when the host computed its inputs that way)."
        ),
    )
    slots: Annotated[list[list[SlotUse]], DETAIL] = Field(
        default_factory=list,
        description=(
            "Per member after the first, for a widened boundary: the slots its recipes rest on, in order; those "
            "not constant are inputs of the composed graph named '<upstream>_glue_<member>.slot_<k>'."
        ),
    )
    glue_graphs: list[RunPath | None] = Field(
        default_factory=list,
        description="Per member after the first: the run-folder path of the glue graph composed before it, if any.",
    )
    onnx_path: RunPath | None = Field(None, description="Run-folder path of the composed ONNX graph.")
    atc_command: AtcArgv = Field(default_factory=list, description="The ATC command for the composed graph.")
    atc_script: RunPath | None = Field(
        None,
        description=(
            "Run-folder path of the ATC script for the composed graph (the first member's shape strategy; the slowest "
            "of the members' chosen precision modes, emulated once more as one graph: see `precision`)."
        ),
    )
    precision_mode: str | None = Field(None, description="The --precision_mode of that script.")
    keep_dtype_nodes: Annotated[list[str], DETAIL] = Field(
        default_factory=list,
        description=("Nodes the script keeps at their dtype (--keep_dtype): each member's own, with its prefix."),
    )
    precision: EmulatedResult | None = Field(
        None,
        description=(
            "The composed graph emulated once in that mode with that keep list, against its fp32 run on the first "
            "member's first captured inputs (ONNX Runtime CPU, not an NPU); None when the mode keeps every dtype."
        ),
    )
    status: Literal["verified", "failed", "refused"] = Field(
        description=(
            "'verified': the main path with it spliced in passed its checks with no fallback and it answered every "
            "later member's calls; 'failed': it was built but that run did not show it; "
            "'refused': it could not be built."
        )
    )
    reason: str = Field(description="Why it was verified, failed or refused.")


class MergedRun(Record):
    """The main path again with the merged graphs spliced in: its parity and its traffic."""

    graphs: list[MergedGraph] = Field(description="Every chain of merge proposals taken, built or not.")
    not_taken: dict[str, str] = Field(
        default_factory=dict,
        description=(
            "Mergeable graphs left out of every chain -> why (a graph runs inside one other graph's call at most)."
        ),
    )
    verdict: str = Field(
        description="The run's verdict by the same checks as the main verification ('pass' or 'fail'; "
        "'not run' when nothing could be built)."
    )
    fallbacks: int = Field(description="Calls PyTorch ran in that run.")
    checks: str = Field(
        "", description="Each check's worst figure in that run, as the main verification prints its own."
    )
    traffic: TrafficReport | None = Field(
        None, description="Its traffic (the 'after' of the merge), None if not counted."
    )
    outputs: RunPath | None = Field(
        None,
        description=(
            "Run-folder path of the .npz with every step's outputs of that run: what a deployment serving the "
            "verified chains gives, bit for bit (a composed graph may round differently from its graphs apart)."
        ),
    )
    label: str = Field(
        "the same backend as the main verification; merged graphs composed from the exported graphs",
        description="What ran.",
    )
