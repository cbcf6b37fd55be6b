"""Parity between a reference output (PyTorch) and a candidate (ONNX Runtime, OM, ...).

All arithmetic is float64, so the metric itself adds no rounding to what it measures. The
records (gates, per-output figures, verdicts) are in `omskills.records.parity`.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import numpy as np
from omskills.records.parity import OutputParity, ParityGates, ParityReport


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
    stats = _FloatStats()
    for r, c in zip(float64_blocks(ref), float64_blocks(cand), strict=True):
        stats.add(r, c, gates.relative_floor)
    if stats.nan_ref or stats.nan_cand:
        return OutputParity(
            **base, verdict="fail", reason=f"NaN values: reference {stats.nan_ref}, candidate {stats.nan_cand}"
        )
    if stats.stray_inf:
        return OutputParity(**base, verdict="fail", reason=f"{stats.stray_inf} infinite values differ")
    cosine = stats.cosine()
    verdict, reason = gates.verdict(cosine, stats.max_abs, stats.magnitude)
    return OutputParity(
        **base, cosine=cosine, max_abs=stats.max_abs, max_rel=stats.max_rel, verdict=verdict, reason=reason
    )


# Elements compared at a time: a float64 copy of a whole full-scale backbone output (85 M elements)
# and the temporaries beside it took seconds and GBs per output; blocks of 4 M keep both small.
BLOCK = 1 << 22


def float64_blocks(array: np.ndarray) -> Iterator[np.ndarray]:
    """The array's elements, flat, in float64 blocks; a complex array as its real and imaginary
    parts side by side (every figure here is a sum or a maximum, so their order does not matter)."""
    flat = np.ascontiguousarray(array).reshape(-1)
    if np.iscomplexobj(flat):
        flat = flat.view(flat.real.dtype)
    for start in range(0, max(flat.size, 1), BLOCK):
        yield flat[start : start + BLOCK].astype(np.float64)


@dataclass
class _FloatStats:
    """Running figures of a float comparison. An infinity is a match only where both sides hold the
    same one (e.g. -inf attention masks); anywhere else no finite metric can describe the difference."""

    nan_ref: int = 0
    nan_cand: int = 0
    stray_inf: int = 0
    max_abs: float = 0.0
    max_rel: float = 0.0
    magnitude: float = 0.0
    dot: float = 0.0
    norm2_ref: float = 0.0
    norm2_cand: float = 0.0

    def add(self, ref: np.ndarray, cand: np.ndarray, relative_floor: float) -> None:
        self.nan_ref += int(np.isnan(ref).sum())
        self.nan_cand += int(np.isnan(cand).sum())
        inf_ref, inf_cand = np.isinf(ref), np.isinf(cand)
        if inf_ref.any() or inf_cand.any():
            same_inf = inf_ref & (ref == cand)
            self.stray_inf += int(((inf_ref | inf_cand) & ~same_inf).sum())
            ref, cand = ref[~same_inf], cand[~same_inf]
        if not ref.size or self.nan_ref or self.nan_cand or self.stray_inf:
            return  # the verdict is decided; only the counts go on
        diff = np.abs(ref - cand)
        self.max_abs = max(self.max_abs, float(diff.max()))
        self.max_rel = max(self.max_rel, float((diff / np.maximum(np.abs(ref), relative_floor)).max()))
        self.magnitude = max(self.magnitude, float(np.abs(ref).max()))
        self.dot += float(np.dot(ref, cand))
        self.norm2_ref += float(np.dot(ref, ref))
        self.norm2_cand += float(np.dot(cand, cand))

    def cosine(self) -> float:
        return cosine_from(self.dot, math.sqrt(self.norm2_ref), math.sqrt(self.norm2_cand))


def cosine_from(dot: float, norm_a: float, norm_b: float) -> float:
    """Cosine similarity from a dot product and two norms (1 for two zero vectors, 0 against one)."""
    if norm_a == 0.0 and norm_b == 0.0:
        return 1.0  # two zero vectors are the same vector
    if norm_a == 0.0 or norm_b == 0.0:
        return 0.0  # nothing in common with a zero vector
    # Clip: rounding can push |cos| a hair over 1 for identical vectors.
    return float(np.clip(dot / (norm_a * norm_b), -1.0, 1.0))
