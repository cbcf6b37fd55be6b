"""Parity of one compiled candidate against PyTorch: tiered gates, per-output figures, verdicts.

Float outputs are judged by cosine similarity and max absolute error against tiered gates
(`ParityGates`, data not code, so a task record carries the gates it was judged by); integer and
boolean outputs must match exactly. `omskills.compare.parity` computes these records.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Annotated, Literal

from omskills.errors import InputError
from omskills.records.base import Record
from omskills.records.details import DETAIL
from pydantic import model_validator

Verdict = Literal["pass", "review", "fail"]
VERDICT_RANK: dict[str, int] = {"pass": 0, "review": 1, "fail": 2}


def verdict_rank(verdict: str) -> int:
    """0 for pass, 1 for review, 2 for fail: higher is worse."""
    return VERDICT_RANK[verdict]


class ParityGates(Record):
    """Tiered gates for float outputs; defaults are the fp32 gates of the onnx-atc-pipeline issue.

    pass:   cosine >= pass_min_cosine   and max_abs < pass_max_abs x scale
    review: cosine >= review_min_cosine and max_abs < review_max_abs x scale
    fail:   anything else

    scale is the reference's largest magnitude, or 1 when smaller: fp32 rounding grows with the
    values, so box coordinates in pixels (hundreds) carry errors hundreds of times those of
    logits near 1 for the same relative precision.
    """

    pass_min_cosine: float = 0.9999
    pass_max_abs: float = 1e-4
    review_min_cosine: float = 0.999
    review_max_abs: float = 1e-3
    # Not a gate: max_rel divides by max(|reference|, relative_floor) so that exact zeros in
    # the reference report a large-but-finite relative error instead of inf.
    relative_floor: float = 1e-6

    @model_validator(mode="after")
    def _review_is_looser_than_pass(self) -> ParityGates:
        if self.review_min_cosine > self.pass_min_cosine or self.review_max_abs < self.pass_max_abs:
            raise ValueError("review gates must be looser than pass gates")
        return self

    def verdict(self, cosine: float, max_abs: float, magnitude: float = 1.0) -> tuple[Verdict, str | None]:
        """The tier these metrics reach, and which conditions of the next tier up they miss;
        `magnitude`: the reference's largest absolute value (scales the max-abs gates above 1)."""
        scale = max(1.0, magnitude)
        if cosine >= self.pass_min_cosine and max_abs < self.pass_max_abs * scale:
            return "pass", None
        missed_pass = _missed(cosine, max_abs, self.pass_min_cosine, self.pass_max_abs, scale, "pass")
        if cosine >= self.review_min_cosine and max_abs < self.review_max_abs * scale:
            return "review", missed_pass
        return "fail", _missed(cosine, max_abs, self.review_min_cosine, self.review_max_abs, scale, "review")


# fp16 keeps 11 significant bits (a relative step of 4.9e-4); a pipeline of fp16 operators loses a few
# more. What an emulated precision plan's float outputs are held to (`ModelDriver.precision_checks`).
FP16_GATES = ParityGates(pass_min_cosine=0.999, pass_max_abs=1e-2, review_min_cosine=0.995, review_max_abs=3e-2)


def _missed(cosine: float, max_abs: float, min_cosine: float, max_abs_below: float, scale: float, tier: str) -> str:
    misses = []
    if cosine < min_cosine:
        misses.append(f"cosine {cosine:.6g} < {min_cosine:g}")
    if max_abs >= max_abs_below * scale:
        scaled = f" x {scale:.3g} (the reference's largest magnitude)" if scale > 1.0 else ""
        misses.append(f"max_abs {max_abs:.3g} >= {max_abs_below:g}{scaled}")
    return f"{' and '.join(misses)} ({tier} gate)"


class OutputParity(Record):
    """How one output of the candidate compares with the reference."""

    name: str
    shape: list[int]  # the reference's shape
    dtype: str  # the reference's dtype
    cosine: float | None = None  # float outputs
    max_abs: float | None = None
    max_rel: float | None = None  # float outputs, against max(|reference|, gates.relative_floor)
    mismatch_fraction: float | None = None  # exact (integer/bool) outputs: share of elements that differ
    verdict: Verdict
    reason: str | None = None  # why it is not a pass


class ParityReport(Record):
    """Parity of every output of one call: the worst verdict wins."""

    outputs: Annotated[list[OutputParity], DETAIL]
    verdict: Verdict
    worst_cosine: float | None = None
    worst_max_abs: float | None = None
    gates: Annotated[ParityGates, DETAIL]
    # Set when ONNX Runtime takes the batch in chunks of this many items (the task record's batch_split):
    # the probe ran the samples' first chunks, one per shape of chunk.
    batch_chunks_of: int | None = None

    @classmethod
    def of(cls, outputs: list[OutputParity], gates: ParityGates) -> ParityReport:
        cosines = [o.cosine for o in outputs if o.cosine is not None]
        max_abs = [o.max_abs for o in outputs if o.max_abs is not None]
        return cls(
            outputs=outputs,
            verdict=overall_verdict(outputs),
            worst_cosine=min(cosines) if cosines else None,
            worst_max_abs=max(max_abs) if max_abs else None,
            gates=gates,
        )


def overall_verdict(outputs: Iterable[OutputParity]) -> Verdict:
    """The worst verdict; comparing nothing proves nothing, so an empty list is an error."""
    verdicts = [o.verdict for o in outputs]
    if not verdicts:
        raise InputError("outputs: no outputs to judge")
    return max(verdicts, key=verdict_rank)
