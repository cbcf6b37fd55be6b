"""Two runs of a continuous output that a decision thresholds (mask logits > 0, a score above the
detection threshold), judged where the decision is made rather than by the largest difference.

An absolute difference says nothing by itself: a logit of -500 that becomes -788 decides the
same pixel; a logit of 0.001 that becomes -0.001 flips it, and no precision can promise otherwise.
So each element of the reference gets a tolerance:

    tolerance = REL_TOL x the item's RMS  +  LOCAL_SHARE x its local range

where the local range is the largest minus the smallest reference value in its 3x3 neighbourhood
of the last two axes (items of rank 2 or more: maps), 0 otherwise. The first term is what the
output's scale allows (1 % of its RMS: fp16 keeps 11 bits, a pipeline of them loses a few); the
second lets a boundary between -1024 and +1024 move by under half a cell, which changes one
boundary element by hundreds and is no divergence.

- an element *diverges* when it moved more than its tolerance plus its margin (its distance to
  the threshold): far from the threshold a value may move a lot, near it only a little; one that
  does not diverge may have crossed the threshold, but by no more than its tolerance;
- a flip that does not diverge is a *near-threshold flip*: reported, never a failure;
- the figure is the IoU of the positive side with only divergent elements counted as
  disagreement (1 - divergent elements of the union / the union), and the check passes when it
  reaches the check's threshold. Divergent elements on the negative side of both runs change no
  decision: they are counted, not judged.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

REL_TOL = 1e-2
LOCAL_SHARE = 0.5
MARGIN_SHARE = 1.0


@dataclass(frozen=True)
class DecisionFigures:
    agreement: float  # 1 - divergent elements of the positive union / the union (1 when it is empty)
    near_threshold_flips: int
    divergent: int
    elements: int

    def passes(self, least: float) -> bool:
        return self.agreement >= least


def decide(reference: np.ndarray, candidate: np.ndarray, at: float) -> DecisionFigures | None:
    """The figures of one item; None when the shapes differ."""
    ref, got = _finite(reference), _finite(candidate)
    if ref.shape != got.shape:
        return None
    if not ref.size:
        return DecisionFigures(1.0, 0, 0, 0)
    margin = np.abs(ref - at)
    divergent = np.abs(got - ref) > tolerances(ref) + MARGIN_SHARE * margin
    flips = (ref > at) != (got > at)
    union = (ref > at) | (got > at)
    size = int(union.sum())
    agreement = 1.0 if size == 0 else 1.0 - float((divergent & union).sum()) / size
    return DecisionFigures(agreement, int((flips & ~divergent).sum()), int(divergent.sum()), int(ref.size))


def tolerances(reference: np.ndarray) -> np.ndarray:
    """Each element's tolerance (the module doc's formula)."""
    scale = float(np.sqrt(np.mean(np.square(reference)))) if reference.size else 0.0
    tolerance = np.full(reference.shape, REL_TOL * scale)
    if reference.ndim >= 2:
        tolerance += LOCAL_SHARE * local_range(reference)
    return tolerance


def local_range(values: np.ndarray) -> np.ndarray:
    """Largest minus smallest value in each element's 3x3 neighbourhood of the last two axes."""
    padded = np.pad(values, [(0, 0)] * (values.ndim - 2) + [(1, 1), (1, 1)], mode="edge")
    rows, cols = values.shape[-2:]
    shifted = [padded[..., i : i + rows, j : j + cols] for i in range(3) for j in range(3)]
    return np.max(shifted, axis=0) - np.min(shifted, axis=0)


def _finite(values: np.ndarray) -> np.ndarray:
    """float64, infinities at float64's own limits (a -inf mask stays far below any threshold)."""
    return np.nan_to_num(np.asarray(values, dtype=np.float64), nan=0.0)
