"""Records of Ascend precision: per-node comparisons, the first node over the gate, calibration, the keep list
proposed for one ATC precision mode, and the emulated results without and with it.

Emulated figures come from ONNX Runtime on CPU computing the way the chosen mode makes Ascend's
units compute (see `omskills.ascend.emulation`); their `backend` says so, and none is an NPU
result. A comparison against tensors from another run (an OM's dump from an NPU, the PyTorch
module's outputs) names that run in `candidate` and `backend`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from omskills.records.base import Record
from omskills.records.details import DETAIL
from omskills.records.names import SafeName
from pydantic import Field, model_validator

# How one node computes under an emulated mode. fp16: float inputs and outputs rounded to fp16
# (cube ops accumulate in fp32 between the two roundings); fp16_in: inputs rounded, output kept
# fp32 (cube ops under force_fp32 / cube_fp16in_fp32out); fp32: untouched.
NodePrecision = Literal["fp16", "fp16_in", "fp32"]
# local: the node, fed exact inputs (fp32 ones for an emulation, the other run's own for a dump
# or PyTorch), still differs; accumulated: its inputs already carried the error; undetermined:
# the other run kept no inputs of it (an output-only dump, a fused op).
ErrorOrigin = Literal["local", "accumulated", "undetermined"]
EMULATED_BACKEND = "onnxruntime:CPUExecutionProvider (Ascend precision emulated, not an NPU)"


class PrecisionGates(Record):
    """When an emulated tensor is close enough to its fp32 value: a node is flagged below
    `node_min_cosine`; a graph passes when every output reaches `output_min_cosine` with no
    overflow and no NaN."""

    node_min_cosine: float = Field(default=0.999, gt=0, le=1)
    output_min_cosine: float = Field(default=0.999, gt=0, le=1)


class TensorError(Record):
    """One tensor of the emulated run against the same tensor of the fp32 run."""

    tensor: str
    cosine: float  # over the elements finite in both runs (0 when none is)
    # Over elements finite in both runs (JSON has no inf): `overflow` and `nan` count the rest.
    max_abs: float
    ref_max_abs: float  # the largest finite |value| of the fp32 tensor, for scale
    overflow: int = 0  # elements infinite in the emulated tensor and finite in fp32
    nan: int = 0  # elements NaN in the emulated tensor and not in fp32


class NodeComparison(Record):
    node: str
    op_type: str
    precision: NodePrecision | None = None  # under an emulated mode; None against another run
    source: str | None = None  # where the other run's tensor came from (dump file, module path)
    worst: TensorError  # its output that fares worst
    # The node (a module's nodes, against PyTorch) run alone on exact inputs: what it loses by itself.
    local: TensorError | None = None
    flagged: bool = False  # worst crosses the node gate (or overflowed)


class LayerFinding(Record):
    """The first node, in graph order, whose error crosses the gate."""

    node: str
    op_type: str
    origin: ErrorOrigin  # local: the node itself loses it; accumulated: its inputs already carried it
    worst: TensorError
    local: TensorError | None = None


class LayerComparison(Record):
    """Every float node output of one graph, two runs, node by node."""

    model: str = Field(description="Run-folder path of the ONNX graph compared.")
    reference: str = Field(description="The baseline run: the graph in fp32 on ONNX Runtime (CPU).")
    candidate: str = Field(
        description=(
            "The run judged against it: a precision mode emulated (with how many nodes kept), "
            "an NPU dump's folder, or a PyTorch module."
        )
    )
    backend: str = Field(description="What computed the judged run; an emulation says it is not an NPU result.")
    nodes_compared: int = Field(description="Nodes whose float outputs were compared.")
    nodes_flagged: int = Field(
        description="Compared nodes whose worst output crosses the node gate (cosine under it, an overflow or a NaN)."
    )
    first: LayerFinding | None = Field(
        None,
        description=(
            "The first flagged node in graph order, and whether its error is local, accumulated or undetermined; "
            "null when none is flagged."
        ),
    )
    outputs: Annotated[list[TensorError], DETAIL] = Field(
        default_factory=list,
        description=(
            "The graph's outputs, judged run against fp32: cosine, max abs difference, overflowed and NaN elements "
            "(against a dump, the outputs it kept)."
        ),
    )
    outputs_pass: bool = Field(
        description=(
            "Whether every compared graph output meets the output gate (its cosine, no overflow, no NaN); "
            "with no output compared, whether no node is flagged."
        )
    )
    overflow: int = Field(
        0,
        description=(
            "Elements infinite in the judged run and finite in fp32, summed over each compared node's worst output."
        ),
    )
    unmatched: int = Field(
        0,
        description=(
            "Tensors of the other run that match no float node output, or whose shape cannot be brought to it "
            "(a fused op's output, a layout ATC changed); a few are named in notes. 0 for an emulation."
        ),
    )
    notes: list[str] = Field(
        default_factory=list,
        description=(
            "What the comparison left out or assumed (unmatched tensors, dump files skipped, the sample the OM ran on)."
        ),
    )
    flagged: Annotated[list[NodeComparison], DETAIL] = Field(
        default_factory=list, description="The flagged nodes, lowest cosine first (at most 50)."
    )


class EmulatedResult(Record):
    """One graph under one mode (and keep list): what the graph's outputs lose against fp32."""

    cosine: float  # worst over outputs
    max_abs: float  # worst over outputs
    overflow: int  # node-output elements that overflowed fp16
    nan: int = 0
    passed: bool
    fp16_nodes: int  # nodes computing with fp16 inputs under this mode
    first: LayerFinding | None = None


class CalibrationKeep(Record):
    """A node the calibration pass keeps at its original dtype before any emulation, and why."""

    node: str
    op_type: str
    rule: Literal["overflow", "headroom", "squares", "mean_of_large_sum", "weight_range", "constant_underflow"]
    figure: float = Field(description="What the rule measured: a magnitude, or a magnitude times a reduction depth.")
    limit: float = Field(description="The rule's limit the figure reached.")


class GraphCalibration(Record):
    """The graph's first emulated passes on its recorded inputs, observed: the largest magnitude of
    every float tensor (before its fp16 rounding) and weight, the depth of its mean reductions, and
    the nodes whose values leave fp16's useful range (`ascend.calibration` states each rule and its
    limit)."""

    sample: str = Field(description="The recorded call the pass ran on.")
    tensors: int = Field(description="Float tensors whose largest magnitude was read.")
    largest: float = Field(description="The largest magnitude of any float node output.")
    keep: Annotated[list[CalibrationKeep], DETAIL] = Field(default_factory=list)
    passes: int = Field(1, description="Emulated passes read: the next one after a pass that kept more.")
    seconds: float = 0.0

    @property
    def nodes(self) -> list[str]:
        return list(dict.fromkeys(k.node for k in self.keep))


class CubeMacs(Record):
    """Multiply-accumulates of the graph's Cube operators (MatMul, Gemm, Conv, ConvTranspose,
    Einsum) on the recorded call, and those a precision mode with its keep list runs in fp16."""

    total: int = 0
    fp16: int = 0
    by_node: Annotated[dict[str, int], DETAIL] = Field(
        default_factory=dict
    )  # Cube node -> its MACs, to count other keep lists

    @property
    def fp16_share(self) -> float:
        return self.fp16 / self.total if self.total else 1.0


class ModePrecision(Record):
    """One ATC precision mode for one graph: emulated with the calibration's keep list, the nodes
    the graph-local search kept besides, and emulated again with them."""

    mode: str
    result: EmulatedResult  # with the calibration's keep list (nothing else kept)
    keep: Annotated[list[str], DETAIL] = Field(
        default_factory=list
    )  # every node kept at its original dtype: calibration + search
    keep_op_types: Annotated[list[str], DETAIL] = Field(default_factory=list)  # their ONNX op types, for the report
    searched: Annotated[list[str], DETAIL] = Field(default_factory=list)  # the nodes the graph-local search added
    with_keep: EmulatedResult | None = None  # with `keep`, when the search added nodes
    search_runs: int = 0  # graph runs the search made (side-by-side comparison included)
    note: str | None = None  # why no keep list, or what emulation cannot show


class PrecisionReport(Record):
    """Every emulated mode for one graph, and the options it proposes for ATC."""

    model: str
    sample: str  # the captured sample it ran on
    backend: str = EMULATED_BACKEND
    gates: PrecisionGates = Field(default_factory=PrecisionGates)
    calibration: Annotated[GraphCalibration | None, DETAIL] = None  # None: emulated before calibration existed
    macs: CubeMacs = Field(default_factory=CubeMacs)  # fp16: under the chosen mode and keep list
    modes: Annotated[list[ModePrecision], DETAIL]
    chosen_mode: str  # the fastest mode whose emulated result passes (with its keep list)
    chosen_keep: Annotated[list[str], DETAIL] = Field(default_factory=list)
    why: str
    # Slower modes left out because a faster one already passed (emulating a 2 GB graph is minutes).
    not_evaluated: Annotated[list[str], DETAIL] = Field(default_factory=list)
    # What each mode's emulated outputs are compared with.
    reference: str = "the graph in fp32 on ONNX Runtime"
    assumptions: Annotated[str, DETAIL]  # what emulation cannot see (ATC's own lowering: see the pitfalls in precheck)

    def mode(self, name: str) -> ModePrecision | None:
        return next((m for m in self.modes if m.mode == name), None)


class PlanAttempt(Record):
    """One spliced run of the main path with some graphs emulated, judged by the driver's checks."""

    purpose: str = Field(description="Why this run: the chosen modes, finding the graphs at fault, or a fixed plan.")
    emulated: dict[str, str] = Field(description="Graph -> the mode it was emulated in; the others ran in fp32.")
    verdict: Literal["pass", "fail"]
    summary: str = Field(description="The checks' worst figures over the main path.")
    seconds: float


class PlanTime(Record):
    """Predicted NPU time of the Cube operators of every graph per main-path run (the cost model's
    per-SoC rates; predicted, not measured): this plan, everything in fp16, everything in fp32."""

    soc: str
    plan_ms: float | None = Field(description="None: no rate for some precision the plan runs (see source).")
    all_fp16_ms: float | None
    all_fp32_ms: float | None
    source: str = Field(description="The rates used and what they rest on.")


class GraphAttribution(Record):
    """One graph's share of a failed end-to-end run, from what its own emulation lost on its recorded
    inputs (teacher forcing: fp32 inputs, no upstream error) against its graph-local tolerance."""

    graph: SafeName
    own_error: float = Field(description="1 - cosine of its worst output, emulated on its recorded fp32 inputs.")
    tolerance: float = Field(description="1 - the graph-local gate's cosine it was emulated against.")
    score: float = Field(description="own_error / tolerance: how much of its local budget it used.")
    fp16_macs: int = Field(0, description="Cube MACs it runs in fp16 (0: it keeps every dtype and cannot be at fault).")


class PrecisionPlan(Record):
    """The ATC precision plan of every deployed graph, checked end to end on the main path with
    every graph in its mode (emulated on CPU, not an NPU result): what passed, what moved, why."""

    verdict: Literal["pass", "fail", "not_judged"] = Field(
        description=(
            "pass: the main path, every graph emulated in `modes`, passes the driver's precision checks; "
            "fail: it did not within the budget of runs (the graphs at fault then convert with "
            "must_keep_origin_dtype); not_judged: every graph keeps its dtypes, which the fp32 verification judges."
        )
    )
    modes: dict[str, str] = Field(description="Graph -> the ATC precision mode it converts with (and nodes kept).")
    moved: dict[str, str] = Field(
        default_factory=dict,
        description="Graph -> how and why the end-to-end check changed it (a longer keep list, or a safer mode).",
    )
    at_fault: list[str] = Field(default_factory=list, description="Graphs the attribution named after a failed run.")
    attribution: Annotated[list[GraphAttribution], DETAIL] = Field(
        default_factory=list, description="After a failed run: every emulated graph's share, highest first."
    )
    attempts: Annotated[list[PlanAttempt], DETAIL] = Field(
        default_factory=list, description="Every spliced run the check made, in order: the plan, then the fixed plan."
    )
    reference: str = Field(
        "",
        description="Where the PyTorch outputs the runs are judged against come from (the study's run, or a run here).",
    )
    fallbacks: int = Field(
        0,
        description=(
            "Calls the emulated runs sent to PyTorch (outside a graph's shapes): reported, handled by the shape "
            "strategy, never by a slower precision mode."
        ),
    )
    fp16_mac_share: float = Field(1.0, description="Cube MACs in fp16 over every graph of the plan (1: no Cube op).")
    predicted: PlanTime | None = Field(
        None, description="Predicted NPU time of the plan against all-fp16 and all-fp32."
    )
    runs: int = Field(description="Spliced main-path runs made (the budget's unit).")
    budget: int = Field(description="The most spliced runs the check was allowed.")
    seconds: float = Field(description="The whole check: every attempt, the attribution, the report.")
    why: str = Field(description="The outcome in one sentence: which plan passed, or why none did.")

    @model_validator(mode="before")
    @classmethod
    def _without_the_bisection(cls, data: Any) -> Any:
        """A record written when the check bisected graphs on the main path still loads (its step is
        redone: the check's inputs changed); the bisection's finding has no field any more."""
        if isinstance(data, dict) and "narrowed_to" in data:
            data = {k: v for k, v in data.items() if k != "narrowed_to"}
        return data
