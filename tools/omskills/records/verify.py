"""Stage 4 records: the spliced main path against the PyTorch reference.

A driver says how two runs are compared as a list of `OutputCheck`s: which output of each step,
which metric, which gate. The engine's comparators (`omskills.compare.outputs`) turn them into
one `CheckResult` per check and step; the verdict is pass when every gating check passes on
every step, both runs have the same steps, and no spliced call fell back to PyTorch.
"""

from __future__ import annotations

from typing import Annotated

from omskills.records.base import Record
from omskills.records.details import DETAIL
from omskills.records.export import FallbackEvent, SpliceStats
from omskills.records.glue import GlueReport
from omskills.records.names import RunPath
from omskills.records.parity import ParityGates, Verdict, verdict_rank
from omskills.records.traffic import MergedRun, TrafficReport
from pydantic import Field, model_validator

# A comparator registered in omskills.compare.outputs.COMPARATORS. The built-in ones: exact (equal
# arrays: ids, labels, counts), tensor (cosine / max abs against ParityGates), iou (boolean region
# maps of the same items, per item, at least `threshold`), max_abs (largest absolute difference
# at most `threshold`: coordinates, scores) and decision (a continuous output thresholded at
# `decision_at`, judged away from that threshold: `omskills.compare.decision`). Figures are
# differences (higher is worse) except iou's and decision's (agreements).
MetricName = str
# Metrics whose figure is an agreement (higher is better) rather than a difference.
AGREEMENTS = frozenset({"iou", "decision"})


class OutputCheck(Record):
    """How one output of every step is compared; `output` "*" means every output (tensor metric
    for floats, exact for the rest)."""

    output: str
    metric: MetricName
    # Items (dim 0) of the output are matched across runs by the values of this output, e.g.
    # object ids: items the other run lacks count as the worst value.
    key: str | None = None
    threshold: float | None = None  # iou, decision: the least IoU; max_abs: the largest difference
    # decision: the value a decision compares the output with (0 for logits, a score threshold).
    decision_at: float | None = None
    gates: ParityGates | None = None  # tensor: default ParityGates()
    gating: bool = True  # False: reported beside the verdict, not part of it
    label: str = ""  # what reports call it, e.g. "object ids"
    # True: a step where neither run has the output is no evidence either way (an output only some
    # models of a driver produce); a step where one run lacks it still fails.
    optional: bool = False

    @model_validator(mode="after")
    def _threshold_where_needed(self) -> OutputCheck:
        if self.metric in ("iou", "max_abs", "decision") and self.threshold is None:
            raise ValueError(f"metric {self.metric} needs a threshold")
        if self.metric == "decision" and self.decision_at is None:
            raise ValueError("metric decision needs decision_at (the value the output is thresholded at)")
        return self

    @property
    def title(self) -> str:
        return self.label or f"{self.output} ({self.metric})"


class CheckResult(Record):
    """One check on one step: its figure and whether it passed."""

    output: str
    metric: MetricName
    # exact: fraction of elements that differ (1 when shapes or keys differ); tensor and max_abs:
    # the largest absolute difference; iou: the least IoU over items.
    value: float | None
    cosine: float | None = None  # tensor only
    passed: bool
    gating: bool = True
    detail: str | None = None
    # tensor only: the parity tier the step reached (`ParityGates`). A "review" tier passes the
    # check, and is shown as review, never as pass.
    tier: Verdict | None = None
    # decision only: elements whose side of the threshold changed although the reference sat within
    # tolerance of it (not a divergence), and elements that moved beyond their tolerance.
    near_threshold_flips: int | None = None
    divergent: int | None = None


class StepParity(Record):
    index: int
    checks: list[CheckResult]
    torch_seconds: float
    spliced_seconds: float

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks if c.gating)


class ItemFigure(Record):
    """One item's figure of a keyed check on one step (e.g. one object's mask IoU on one frame):
    the item of the reference run against the spliced run's item with the same key."""

    output: str
    metric: MetricName
    title: str
    key: str  # the check's key output (e.g. object ids)
    item: str  # the item's value in it
    step: int
    value: float | None  # the item missing from the spliced run counts as the worst value
    passed: bool


class CheckSummary(Record):
    """A check over every step: its worst figure and whether it held on all of them."""

    output: str
    metric: MetricName
    title: str
    worst: float | None
    passed: bool
    gating: bool
    tier: Verdict | None = None  # tensor only: the lowest parity tier it reached over the steps

    @property
    def shown(self) -> str:
        """Its worst figure and, unless it is an unqualified pass, what it reached: "4.6e-04 (review tier)"."""
        mark = " FAILED" if not self.passed else " (review tier)" if self.tier == "review" else ""
        return f"{figure(self.worst, self.metric)}{mark}"


def worst_tier(tiers: list[Verdict | None]) -> Verdict | None:
    """The lowest parity tier among those given (None: no tensor check reached any)."""
    reached = [t for t in tiers if t is not None]
    return max(reached, key=verdict_rank) if reached else None


class CandidateVerification(Record):
    name: str
    status: str
    backend: str
    probe: dict[str, float | str | None]  # verdict, cosine, max_abs
    torch_ms_per_call: float | None
    backend_ms_per_call: float | None
    calls: int
    fallbacks: int
    memo_hits: int = 0  # calls answered from memory: the same inputs as an earlier call (splicing.memo)


class MainPathParity(Record):
    steps: int
    steps_equal: bool  # both runs produced the same step indices
    checks: list[CheckSummary]
    fallbacks: int
    torch_s_per_step: float
    spliced_s_per_step: float
    latency_ratio: float  # spliced / torch, same process, same steps
    # The whole pass, session setup included (None in reports written before it was kept).
    torch_pass_s: float | None = None
    spliced_pass_s: float | None = None

    @property
    def verdict(self) -> str:
        """pass: both runs have the same steps, every gating check held on all of them, no fallback."""
        held = self.steps_equal and all(c.passed for c in self.checks if c.gating) and self.fallbacks == 0
        return "pass" if held else "fail"

    @property
    def in_review(self) -> list[str]:
        """The gating checks that passed only in the review tier (their titles)."""
        return [c.title for c in self.checks if c.gating and c.passed and c.tier == "review"]

    @property
    def shown_verdict(self) -> str:
        """The verdict as reports print it: a pass with checks in the review tier names them."""
        review = self.in_review
        return f"pass, review tier: {', '.join(review)}" if self.verdict == "pass" and review else self.verdict

    def summary(self) -> str:
        return "; ".join(f"{c.title} worst {c.shown}" for c in self.checks)


def figure(value: float | None, metric: str) -> str:
    """A check's figure as reports print it: an IoU to 4 places, a difference in exponent form."""
    if value is None:
        return "-"
    return f"{value:.4f}" if metric in AGREEMENTS else f"{value:.2e}"


class VerifyReport(Record):
    task_id: str = Field(description="The task record's id.")
    weights: str = Field(
        description=(
            "The weights the model was built with: the files its build read with their sha256, what its driver "
            "declares, or 'random' (the generators seeded with intake.model.seed)."
        )
    )
    scale: str = Field(description="The model scale verified: 'full' or 'tiny'.")
    backend: str = Field(
        description="The runtime backend the spliced graphs were asked to run on (e.g. 'onnxruntime', 'om')."
    )
    step_name: str = Field("step", description="What the driver calls one step of the main path (e.g. 'frame').")
    backend_per_candidate: Annotated[dict[str, str], DETAIL] = Field(
        description=(
            "Graph -> what really ran it ('<backend>:<device>', with batch chunks or the emulated mode when so); "
            "'pytorch (not spliced)' for candidates left in PyTorch."
        )
    )
    not_spliced: dict[str, str] = Field(
        default_factory=dict,
        description=(
            "First-batch candidates left in PyTorch -> why (not exported, never probed, or the probe failed)."
        ),
    )
    candidates: Annotated[list[CandidateVerification], DETAIL] = Field(
        description=(
            "Per spliced graph: integrated or fallback, what ran it, its probe's verdict, cosine and max abs, "
            "ms per call in PyTorch and on the backend, calls and fallbacks."
        )
    )
    comparison: Annotated[list[OutputCheck], DETAIL] = Field(
        description="The output checks applied to every step (a '*' check expanded to one per output)."
    )
    main_path: MainPathParity = Field(
        description=(
            "The whole main path: steps, each check's worst figure over all steps, fallbacks, "
            "seconds per step of each run and their ratio."
        )
    )
    per_step: Annotated[list[StepParity], DETAIL] = Field(
        description="Every step's check results and the seconds each run took on it."
    )
    traffic: TrafficReport | None = Field(
        None,
        description=(
            "What the spliced graphs moved between host and device, per step and per graph (calls, copies, bytes, "
            "unchanged hand-offs from one graph to another), and the host<->device time that predicts on the target."
        ),
    )
    glue: GlueReport | None = Field(
        None,
        description=(
            "The host code between the deployed graphs, hop by hop (captured from a spliced run): what it does, "
            "whether it can go into a graph, what it costs, and whether its boundary was widened to take it."
        ),
    )
    merged: MergedRun | None = Field(
        None,
        description=(
            "When some graph reads only another's unchanged outputs, or its inputs only through host code that a "
            "widened boundary takes in: the main path again with those chains composed into one graph each (one "
            "call instead of several), its verdict and its traffic."
        ),
    )
    splice_stats: Annotated[list[SpliceStats], DETAIL] = Field(
        description=(
            "Per spliced graph: its calls, those its backend ran, fallbacks by kind with their reasons, "
            "and backend time."
        )
    )
    fallback_events: Annotated[list[FallbackEvent], DETAIL] = Field(
        description="Each call a spliced graph could not send to its backend, so PyTorch ran it, and why."
    )
    verification_settings: list[str] = Field(
        description="The driver's verification settings that are on, said plainly."
    )
    precision: str = Field(
        "fp32",
        description=(
            "'fp32': the graphs as exported; 'emulated': each graph in its chosen ATC precision mode, emulated on "
            "ONNX Runtime CPU (not an NPU result)."
        ),
    )
    precision_modes: dict[str, str] = Field(
        default_factory=dict,
        description=("Graph -> the ATC precision mode emulated for it (and how many nodes it kept); empty for fp32."),
    )
    report_json: RunPath = Field(description="Run-folder path of this report as JSON.")
    report_html: RunPath = Field(
        description="Run-folder path of the self-contained HTML report (its charts and pictures embedded)."
    )
    outputs_pytorch: RunPath | None = Field(
        None,
        description=(
            "Run-folder path of the .npz with every step's outputs of the PyTorch run, "
            "to compare other runs with bit for bit."
        ),
    )
    outputs_spliced: RunPath | None = Field(
        None, description="Run-folder path of the .npz with every step's outputs of the spliced run."
    )

    @property
    def outputs_deployed(self) -> str | None:
        """The outputs a deployment on ONNX Runtime gives: the merged run's when a chain was verified
        (it serves the chains), else the spliced run's."""
        merged = self.merged
        if merged is not None and merged.outputs and any(g.status == "verified" for g in merged.graphs):
            return merged.outputs
        return self.outputs_spliced

    item_figures: Annotated[list[ItemFigure], DETAIL] = Field(
        default_factory=list,
        description=(
            "Per item of every keyed check (e.g. each object, matched by id) and step: "
            "its figure and whether it passed."
        ),
    )
    figures: Annotated[list[RunPath], DETAIL] = Field(
        default_factory=list,
        description=(
            "Run-folder paths of the report's PNG pictures (charts, and steps of both runs side by side); "
            "the HTML embeds them too."
        ),
    )
    notes: list[str] = Field(
        default_factory=list,
        description=(
            "What the run did not do as planned without changing its figures "
            "(a memory optimisation that could not apply)."
        ),
    )
    verdict: str = Field(
        description=(
            "'pass' when both runs have the same steps, every gating check held on all of them "
            "and no call fell back; else 'fail'."
        )
    )
