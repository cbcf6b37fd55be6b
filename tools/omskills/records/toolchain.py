"""Records of the ONNX -> OM toolchain (stage 3): inspection, optimisation variants, the
operator precheck against ATC's list, and ATC conversion.

The ATC option model (`AtcOptions`, with its validation) lives in `omskills.ascend.atc`, next to the
code that turns it into a command line; this module only holds what the tools report.
"""

from __future__ import annotations

from typing import Annotated, Literal

from omskills.records.base import Record
from omskills.records.details import DETAIL
from omskills.records.names import AtcArgv, RunPath
from omskills.records.parity import OutputParity, Verdict
from pydantic import Field

# -- ONNX Runtime on this machine ---------------------------------------------------------


class BatchSplit(Record):
    """ONNX Runtime runs this candidate's calls in chunks of at most `max_batch` batch items.

    Set by probe_onnx when the whole batch did not fit in memory; optimise and verify then run
    the candidate the same way. The OM and its ATC gears are not affected.
    """

    max_batch: int = Field(ge=1)
    input_axes: dict[str, int]  # batched input -> its batch axis (inputs not named are fed whole)
    output_axes: dict[str, int]  # every output -> the axis its chunks are joined on
    reason: str


# Why a graph probed before the batch-independence check is not split (nothing says its items are independent).
BATCH_INDEPENDENCE_UNCHECKED = (
    "whether its batch items are computed independently was not checked (a record written before the check)"
)


class BatchIndependence(Record):
    """Whether each batch item of a graph with batch gears is computed on its own, as serving a
    batch that is no gear in gear-sized calls assumes (runtime.batch_independence).

    Set by probe_onnx: two items of a captured sample run together and one by one on ONNX Runtime.
    A graph whose items interact (attention across the batch, batch statistics) is not split.
    """

    independent: bool
    reason: str  # what ran and what came of it: "batch items interact: <output> differs by X ..." when not


# -- inspect_onnx ---------------------------------------------------------------------------


class OnnxTensorInfo(Record):
    """One graph input or output as declared in the ONNX file."""

    name: str
    dtype: str  # numpy spelling ("float32", "int64", ...); "unknown" when the file does not say
    # Static sizes are ints, symbolic ones keep their name ("batch"), undeclared ones are "?".
    shape: list[int | str] | None  # None: no shape declared at all


class ExternalDataInfo(Record):
    files: list[str] = Field(default_factory=list)  # relative to the model's folder, as stored in the model
    bytes: int = 0  # tensor bytes held outside the .onnx file
    missing: list[str] = Field(default_factory=list)  # referenced files that are not there


class OnnxSummary(Record):
    path: str = Field(description="The .onnx file summarised.")
    file_bytes: int = Field(description="Size of the .onnx file alone, in bytes.")
    total_bytes: int = Field(
        description="Size of the .onnx file plus the tensor bytes it keeps in external data files."
    )
    ir_version: int = Field(description="The ONNX IR version the file declares.")
    producer: str | None = Field(
        None,
        description=(
            "The producer's name and version the file records (e.g. 'pytorch 2.9.0'); null when it records none."
        ),
    )
    opsets: dict[str, int] = Field(description="Operator-set domain ('ai.onnx' for the default domain) -> its version.")
    inputs: list[OnnxTensorInfo] = Field(
        description=(
            "The graph's inputs (initializers left out): name, dtype, "
            "shape with symbolic dims by name and undeclared ones as '?'."
        )
    )
    outputs: list[OnnxTensorInfo] = Field(
        description="The graph's outputs: name, dtype, shape with symbolic dims by name and undeclared ones as '?'."
    )
    symbolic_dims: list[str] = Field(
        default_factory=list, description="Names of the symbolic dims in the inputs and outputs, sorted."
    )
    node_count: int = Field(
        description="Nodes of the main graph (If/Loop/Scan bodies and local functions counted apart)."
    )
    subgraph_node_count: int = Field(0, description="Nodes inside If/Loop/Scan bodies, at any depth.")
    op_histogram: dict[str, int] = Field(
        description=(
            "Op type -> node count over the main graph and its subgraphs, most frequent first; "
            "ops of other domains as 'domain::Op'."
        )
    )
    local_functions: list[str] = Field(
        default_factory=list, description="The model-local functions, as 'domain::name'."
    )
    initializer_count: int = Field(description="Initializers (weights and constants) of the main graph.")
    external_data: ExternalDataInfo = Field(
        description="The files holding tensors outside the .onnx file, their bytes, and any that are missing."
    )


# -- optimize_onnx --------------------------------------------------------------------------

VariantName = Literal["original", "onnxslim", "auto_optimizer"]
# unchanged: the optimiser left the graph as it was (nothing saved); marginal: on a big graph it
# changed too few nodes to be worth a probe (nothing saved); not_checked: built, but a more
# optimised variant built on it passed first, so it was never probed.
VariantStatus = Literal["ok", "unchanged", "marginal", "not_checked", "failed", "unavailable"]
CheckName = Literal["onnx_checker", "ort_load", "outputs_produced", "parity"]


class VariantCheck(Record):
    name: CheckName
    passed: bool
    detail: str | None = None


class KnowledgeOutcome(Record):
    """What one auto_optimizer knowledge did to the model."""

    name: str
    # rejected: it applied, but the result failed strict ONNX shape inference, so it was undone
    outcome: Literal["applied", "not_matched", "failed", "rejected"]
    error: str | None = None


class VariantResult(Record):
    name: VariantName
    status: VariantStatus
    path: RunPath | None = None
    built_from: str | None = None  # the model file the variant was made from
    reason: str | None = None  # why failed / unavailable, or what to watch when ok
    node_count: int | None = None
    seconds: float | None = None  # time to produce the variant (0 for the original)
    checks: Annotated[list[VariantCheck], DETAIL] = Field(default_factory=list)
    samples_probed: int = 0
    parity_verdict: Verdict | None = None  # None: no samples were given, parity not probed
    parity: Annotated[list[OutputParity], DETAIL] = Field(default_factory=list)  # per output, its worst sample
    knowledges: Annotated[list[KnowledgeOutcome], DETAIL] = Field(default_factory=list)  # auto_optimizer only


class OptimizeResult(Record):
    original: str
    variants: Annotated[list[VariantResult], DETAIL]
    # Preference auto_optimizer -> onnxslim -> original among variants that pass every check
    # and whose parity is no worse than the original's.
    preferred: VariantName | None = None
    preferred_path: RunPath | None = None
    why: str


# -- precheck_ops ---------------------------------------------------------------------------

OpStatus = Literal["supported", "constrained", "unsupported"]


class OpCheckRow(Record):
    op_type: str
    domain: str  # "" for the default ONNX domain
    count: int
    status: OpStatus
    nodes: list[str]  # node names (first 50; `count` is the full number)
    reason: str | None = None
    constraints: str | None = None  # the documented constraints, when there are any
    opsets: str | None = None  # the opsets the table accepts for this op
    range_from: str | None = None  # "op page" or "assumed" (see tools/omskills/ascend/data/atc_onnx_ops.README.md)
    source: str | None = None


class PitfallHit(Record):
    """A known ATC precision pitfall (tools/omskills/ascend/data/precision_pitfalls.yaml) that concerns this graph."""

    id: str
    count: int
    nodes: list[str]  # first 50
    modes: list[str]  # the precision modes it concerns
    symptom: str
    workaround: str
    keep_nodes: list[str] = Field(default_factory=list)  # nodes convert_atc keeps (--keep_dtype) under those modes
    source: str
    note: str | None = None


class OpPrecheck(Record):
    model: str  # the graph checked, as given: a label, never opened again
    soc: str
    opset: int  # the model's default-domain opset, which ATC's parser keys on
    table: str  # which document the table comes from
    verdict: Verdict  # fail: an op is unsupported; review: constraints apply; pass: neither
    counts: dict[str, int]  # status -> number of op types
    rows: Annotated[list[OpCheckRow], DETAIL]
    pitfalls: Annotated[list[PitfallHit], DETAIL] = Field(
        default_factory=list
    )  # known precision pitfalls that concern this graph


# -- convert_atc ----------------------------------------------------------------------------

AtcStatus = Literal["converted", "failed", "not_run"]


class AtcInstall(Record):
    atc: str  # the atc executable
    set_env: str | None = None  # CANN's set_env.sh, sourced before atc when known
    toolkit_home: str | None = None


class AtcErrorAdvice(Record):
    code: str  # "E19010", or "message" when matched on the text only
    message: str  # the log line
    advice: str


class AtcResult(Record):
    status: AtcStatus
    reason: str | None = None
    command: Annotated[AtcArgv, DETAIL]  # argv of atc
    script: RunPath  # ready-to-run shell script with the same command
    atc: str | None = None  # which atc ran
    log: RunPath | None = None
    exit_code: int | None = None
    seconds: float | None = None
    om_path: RunPath | None = None
    om_sha256: str | None = None
    om_bytes: int | None = None
    errors: list[AtcErrorAdvice] = Field(default_factory=list)
