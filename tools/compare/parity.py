"""Parity between a reference output (PyTorch) and a candidate (ONNX Runtime, OM, ...).

Float outputs are judged by cosine similarity and max absolute error against tiered gates
(`ParityGates`, data not code, so a task record can carry the gates it was judged by);
integer and boolean outputs (ids, counts, masks already thresholded) must match exactly.
All arithmetic is float64, so the metric itself adds no rounding to what it measures.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Literal

import numpy as np
from pydantic import model_validator

from omskills.errors import InputError
from omskills.records.base import Record

Verdict = Literal["pass", "review", "fail"]
_SEVERITY: dict[str, int] = {"pass": 0, "review": 1, "fail": 2}


class ParityGates(Record):
    """Tiered gates for float outputs; defaults are the fp32 gates of the onnx-atc-pipeline issue.

    pass:   cosine >= pass_min_cosine   and max_abs < pass_max_abs
    review: cosine >= review_min_cosine and max_abs < review_max_abs
    fail:   anything else
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

    def verdict(self, cosine: float, max_abs: float) -> tuple[Verdict, str | None]:
        """The tier these metrics reach, and which conditions of the next tier up they miss."""
        if cosine >= self.pass_min_cosine and max_abs < self.pass_max_abs:
            return "pass", None
        missed_pass = _missed(cosine, max_abs, self.pass_min_cosine, self.pass_max_abs, "pass")
        if cosine >= self.review_min_cosine and max_abs < self.review_max_abs:
            return "review", missed_pass
        return "fail", _missed(cosine, max_abs, self.review_min_cosine, self.review_max_abs, "review")


def _missed(cosine: float, max_abs: float, min_cosine: float, max_abs_below: float, tier: str) -> str:
    misses = []
    if cosine < min_cosine:
        misses.append(f"cosine {cosine:.6g} < {min_cosine:g}")
    if max_abs >= max_abs_below:
        misses.append(f"max_abs {max_abs:.3g} >= {max_abs_below:g}")
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

    outputs: list[OutputParity]
    verdict: Verdict
    worst_cosine: float | None = None
    worst_max_abs: float | None = None
    gates: ParityGates
    # Set when ONNX Runtime ran each batch in chunks of this many items (the task record's batch_split).
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
    return max(verdicts, key=_SEVERITY.__getitem__)


def compare_arrays(
    name: str, reference: np.ndarray, candidate: np.ndarray, gates: ParityGates | None = None
) -> OutputParity:
    """Compare one candidate output with its reference."""
    gates = gates or ParityGates()
    ref, cand = np.asarray(reference), np.asarray(candidate)
    base = {"name": name, "shape": list(ref.shape), "dtype": str(ref.dtype)}
    if ref.shape != cand.shape:
        return OutputParity(**base, verdict="fail", reason=f"shape {list(cand.shape)} != reference {list(ref.shape)}")
    ref_is_float, cand_is_float = _is_float(ref), _is_float(cand)
    if ref_is_float != cand_is_float:
        return OutputParity(**base, verdict="fail", reason=f"dtype {cand.dtype} != reference {ref.dtype}")
    if not ref_is_float:
        return _compare_exact(base, ref, cand)
    return _compare_float(base, ref, cand, gates)


def compare_outputs(
    reference: Mapping[str, np.ndarray], candidate: Mapping[str, np.ndarray], gates: ParityGates | None = None
) -> ParityReport:
    """Compare every reference output with the candidate's output of the same name.

    An output the candidate lacks fails; extra candidate outputs are not judged.
    """
    gates = gates or ParityGates()
    results = []
    for name, ref in reference.items():
        if name not in candidate:
            ref = np.asarray(ref)
            missing = {"name": name, "shape": list(ref.shape), "dtype": str(ref.dtype)}
            results.append(OutputParity(**missing, verdict="fail", reason="missing from candidate"))
        else:
            results.append(compare_arrays(name, ref, candidate[name], gates))
    return ParityReport.of(results, gates)


def _is_float(array: np.ndarray) -> bool:
    return array.dtype.kind in "fc"


def _compare_exact(base: dict, ref: np.ndarray, cand: np.ndarray) -> OutputParity:
    differs = ref != cand
    mismatch = float(differs.mean()) if differs.size else 0.0
    max_abs = float(np.abs(ref.astype(np.float64) - cand.astype(np.float64)).max()) if ref.size else 0.0
    if mismatch == 0.0:
        return OutputParity(**base, max_abs=max_abs, mismatch_fraction=0.0, verdict="pass")
    reason = f"{int(differs.sum())} of {differs.size} elements differ (exact comparison)"
    return OutputParity(**base, max_abs=max_abs, mismatch_fraction=mismatch, verdict="fail", reason=reason)


def _compare_float(base: dict, ref: np.ndarray, cand: np.ndarray, gates: ParityGates) -> OutputParity:
    ref64, cand64 = _as_real_float64(ref), _as_real_float64(cand)
    nan_ref, nan_cand = int(np.isnan(ref64).sum()), int(np.isnan(cand64).sum())
    if nan_ref or nan_cand:
        return OutputParity(**base, verdict="fail", reason=f"NaN values: reference {nan_ref}, candidate {nan_cand}")
    # An infinity is a match only where both sides hold the same one (e.g. -inf attention
    # masks); anywhere else no finite metric can describe the difference.
    same_inf = np.isinf(ref64) & (ref64 == cand64)
    stray_inf = (np.isinf(ref64) | np.isinf(cand64)) & ~same_inf
    if stray_inf.any():
        return OutputParity(**base, verdict="fail", reason=f"{int(stray_inf.sum())} infinite values differ")
    finite = ~same_inf
    ref64, cand64 = ref64[finite], cand64[finite]

    diff = np.abs(ref64 - cand64)
    max_abs = float(diff.max()) if diff.size else 0.0
    max_rel = float((diff / np.maximum(np.abs(ref64), gates.relative_floor)).max()) if diff.size else 0.0
    cosine = _cosine(ref64, cand64)
    verdict, reason = gates.verdict(cosine, max_abs)
    return OutputParity(**base, cosine=cosine, max_abs=max_abs, max_rel=max_rel, verdict=verdict, reason=reason)


def _as_real_float64(array: np.ndarray) -> np.ndarray:
    flat = array.reshape(-1)
    if np.iscomplexobj(flat):
        flat = np.concatenate([flat.real, flat.imag])
    return flat.astype(np.float64)


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    norm_a, norm_b = float(np.linalg.norm(a)), float(np.linalg.norm(b))
    if norm_a == 0.0 and norm_b == 0.0:
        return 1.0  # two zero vectors are the same vector
    if norm_a == 0.0 or norm_b == 0.0:
        return 0.0  # nothing in common with a zero vector
    # Clip: rounding can push |cos| a hair over 1 for identical vectors.
    return float(np.clip(np.dot(a, b) / (norm_a * norm_b), -1.0, 1.0))
