"""Parity between a reference output (PyTorch) and a candidate (ONNX Runtime, OM, ...).

All arithmetic is float64, so the metric itself adds no rounding to what it measures. The
records (gates, per-output figures, verdicts) are in `omskills.records.parity`.
"""

from __future__ import annotations

from collections.abc import Mapping

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
    cosine = cosine_of(ref64, cand64)
    magnitude = float(np.abs(ref64).max()) if ref64.size else 0.0
    verdict, reason = gates.verdict(cosine, max_abs, magnitude)
    return OutputParity(**base, cosine=cosine, max_abs=max_abs, max_rel=max_rel, verdict=verdict, reason=reason)


def _as_real_float64(array: np.ndarray) -> np.ndarray:
    flat = array.reshape(-1)
    if np.iscomplexobj(flat):
        flat = np.concatenate([flat.real, flat.imag])
    return flat.astype(np.float64)


def cosine_of(a: np.ndarray, b: np.ndarray) -> float:
    """Cosine similarity of two flat float64 arrays (1 for two zero vectors, 0 against one)."""
    norm_a, norm_b = float(np.linalg.norm(a)), float(np.linalg.norm(b))
    if norm_a == 0.0 and norm_b == 0.0:
        return 1.0  # two zero vectors are the same vector
    if norm_a == 0.0 or norm_b == 0.0:
        return 0.0  # nothing in common with a zero vector
    # Clip: rounding can push |cos| a hair over 1 for identical vectors.
    return float(np.clip(np.dot(a, b) / (norm_a * norm_b), -1.0, 1.0))
