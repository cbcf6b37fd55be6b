"""Stage 4 records: the spliced main path against the PyTorch reference.

A driver says how two runs are compared as a list of `OutputCheck`s: which output of each step,
which metric, which gate. The engine's comparators (`omskills.compare.outputs`) turn them into
one `CheckResult` per check and step; the verdict is pass when every gating check passes on
every step, both runs have the same steps, and no spliced call fell back to PyTorch.
"""

from __future__ import annotations

from omskills.records.base import Record
from omskills.records.export import FallbackEvent, SpliceStats
from omskills.records.parity import ParityGates
from pydantic import Field, model_validator

# A comparator registered in omskills.compare.outputs.COMPARATORS. The built-in ones: exact (equal
# arrays: ids, labels, counts), tensor (cosine / max abs against ParityGates), iou (boolean region
# maps of the same items, per item, at least `threshold`) and max_abs (largest absolute difference
# at most `threshold`: coordinates, scores). Figures are differences (higher is worse) except iou's.
MetricName = str


class OutputCheck(Record):
    """How one output of every step is compared; `output` "*" means every output (tensor metric
    for floats, exact for the rest)."""

    output: str
    metric: MetricName
    # Items (dim 0) of the output are matched across runs by the values of this output, e.g.
    # object ids: items the other run lacks count as the worst value.
    key: str | None = None
    threshold: float | None = None  # iou: the least IoU; max_abs: the largest difference
    gates: ParityGates | None = None  # tensor: default ParityGates()
    gating: bool = True  # False: reported beside the verdict, not part of it
    label: str = ""  # what reports call it, e.g. "object ids"

    @model_validator(mode="after")
    def _threshold_where_needed(self) -> "OutputCheck":
        if self.metric in ("iou", "max_abs") and self.threshold is None:
            raise ValueError(f"metric {self.metric} needs a threshold")
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


class StepParity(Record):
    index: int
    checks: list[CheckResult]
    torch_seconds: float
    spliced_seconds: float

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks if c.gating)


class CheckSummary(Record):
    """A check over every step: its worst figure and whether it held on all of them."""

    output: str
    metric: MetricName
    title: str
    worst: float | None
    passed: bool
    gating: bool


class CandidateVerification(Record):
    name: str
    status: str
    backend: str
    probe: dict[str, float | str | None]  # verdict, cosine, max_abs
    torch_ms_per_call: float | None
    backend_ms_per_call: float | None
    calls: int
    fallbacks: int


class MainPathParity(Record):
    steps: int
    steps_equal: bool  # both runs produced the same step indices
    checks: list[CheckSummary]
    fallbacks: int
    torch_s_per_step: float
    spliced_s_per_step: float
    latency_ratio: float  # spliced / torch, same process, same steps

    @property
    def verdict(self) -> str:
        """pass: both runs have the same steps, every gating check held on all of them, no fallback."""
        held = self.steps_equal and all(c.passed for c in self.checks if c.gating) and self.fallbacks == 0
        return "pass" if held else "fail"

    def summary(self) -> str:
        parts = [f"{c.title} worst {figure(c.worst, c.metric)}{'' if c.passed else ' FAILED'}" for c in self.checks]
        return "; ".join(parts)


def figure(value: float | None, metric: str) -> str:
    """A check's figure as reports print it: an IoU to 4 places, a difference in exponent form."""
    if value is None:
        return "-"
    return f"{value:.4f}" if metric == "iou" else f"{value:.2e}"


class VerifyReport(Record):
    task_id: str
    weights: str
    scale: str
    backend: str
    step_name: str = "step"
    backend_per_candidate: dict[str, str]
    not_spliced: dict[str, str] = Field(default_factory=dict)  # candidate -> why it stayed in PyTorch
    candidates: list[CandidateVerification]
    comparison: list[OutputCheck]
    main_path: MainPathParity
    per_step: list[StepParity]
    splice_stats: list[SpliceStats]
    fallback_events: list[FallbackEvent]
    verification_settings: list[str]
    # "fp32", or "emulated": every spliced graph ran its ATC precision mode emulated on CPU
    precision: str = "fp32"
    precision_modes: dict[str, str] = Field(default_factory=dict)  # graph -> mode (and keep count) emulated
    report_json: str
    report_html: str
    # Every step's outputs of each run (models.api.save_run), to compare other runs with bit for bit.
    outputs_pytorch: str | None = None
    outputs_spliced: str | None = None
    verdict: str  # "pass" when the steps match, every gating check passes and no call fell back
