"""Comparators for main-path outputs: one per metric of `OutputCheck`, found in one registry.

Each takes the check and the reference and spliced outputs of one step (name -> array) and
returns a `CheckResult`. Items of an output can be matched across the runs by a key output
(object ids): an item the spliced run lacks counts as the worst value.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np
from omskills.compare.decision import decide
from omskills.compare.parity import compare_arrays
from omskills.records.parity import Verdict
from omskills.records.verify import AGREEMENTS, CheckResult, OutputCheck, worst_tier
from omskills.registry import Registry

Outputs = Mapping[str, np.ndarray]
Comparator = Callable[[OutputCheck, Outputs, Outputs], CheckResult]

COMPARATORS: Registry[Comparator] = Registry("output comparator")


def _result(
    check: OutputCheck,
    value: float | None,
    passed: bool,
    detail: str | None = None,
    cosine: float | None = None,
    tier: Verdict | None = None,
) -> CheckResult:
    return CheckResult(
        output=check.output,
        metric=check.metric,
        value=value,
        cosine=cosine,
        passed=passed,
        gating=check.gating,
        detail=detail,
        tier=tier,
    )


def _missing(check: OutputCheck, reference: Outputs, spliced: Outputs) -> CheckResult | None:
    if check.optional and check.output not in reference and check.output not in spliced:
        return _result(check, None, True, "absent from both runs on this step")
    names = [check.output] + ([check.key] if check.key else [])
    absent = [
        f"{name} ({side})"
        for name in names
        for side, outs in (("reference", reference), ("spliced", spliced))
        if name not in outs
    ]
    return _result(check, None, False, f"no output {', '.join(absent)}") if absent else None


def _pairs(
    check: OutputCheck, reference: Outputs, spliced: Outputs
) -> tuple[list[tuple[np.ndarray, np.ndarray]], list[str]]:
    """(reference item, spliced item) pairs: matched by key when the check has one, else the whole arrays."""
    ref, got = np.asarray(reference[check.output]), np.asarray(spliced[check.output])
    if check.key is None:
        return [(ref, got)], []
    ref_keys = np.asarray(reference[check.key]).reshape(-1).tolist()
    got_keys = np.asarray(spliced[check.key]).reshape(-1).tolist()
    pairs, unmatched = [], []
    for i, key in enumerate(ref_keys):
        if key in got_keys:
            pairs.append((ref[i], got[got_keys.index(key)]))
        else:
            unmatched.append(str(key))
    return pairs, unmatched


def exact(check: OutputCheck, reference: Outputs, spliced: Outputs) -> CheckResult:
    if (missing := _missing(check, reference, spliced)) is not None:
        return missing
    pairs, unmatched = _pairs(check, reference, spliced)
    worst, details = (1.0 if unmatched else 0.0), [f"items {unmatched} of the reference are missing"] * bool(unmatched)
    for ref, got in pairs:
        ref, got = np.asarray(ref), np.asarray(got)
        if ref.shape != got.shape:
            worst = 1.0
            details.append(f"shape {list(got.shape)} != reference {list(ref.shape)}")
        elif ref.size and (differs := ref != got).any():
            worst = max(worst, float(differs.mean()))
            details.append(f"{int(differs.sum())} of {ref.size} differ")
    return _result(check, worst, worst == 0.0, "; ".join(details) or None)


def tensor(check: OutputCheck, reference: Outputs, spliced: Outputs) -> CheckResult:
    if (missing := _missing(check, reference, spliced)) is not None:
        return missing
    pairs, unmatched = _pairs(check, reference, spliced)
    worst_abs, worst_cos, verdicts, reasons = 0.0, 1.0, [], []
    for ref, got in pairs:
        parity = compare_arrays(check.output, ref, got, check.gates)
        verdicts.append(parity.verdict)
        worst_abs = max(worst_abs, parity.max_abs if parity.max_abs is not None else np.inf)
        worst_cos = min(worst_cos, parity.cosine if parity.cosine is not None else 1.0)
        if parity.reason:
            reasons.append(parity.reason)
    passed = "fail" not in verdicts and not unmatched
    if unmatched:
        reasons.append(f"items {unmatched} of the reference are missing")
    tier = "fail" if unmatched else worst_tier(verdicts)
    return _result(check, worst_abs, passed, "; ".join(dict.fromkeys(reasons)) or None, cosine=worst_cos, tier=tier)


def iou(check: OutputCheck, reference: Outputs, spliced: Outputs) -> CheckResult:
    if (missing := _missing(check, reference, spliced)) is not None:
        return missing
    pairs, unmatched = _pairs(check, reference, spliced)
    values = [_iou(ref, got) for ref, got in pairs] + [0.0] * len(unmatched)
    worst = min(values, default=1.0)  # no items on either side: nothing differs
    detail = f"items {unmatched} of the reference are missing" if unmatched else None
    return _result(check, worst, worst >= check.threshold, detail)  # type: ignore[operator]


def _iou(a: np.ndarray, b: np.ndarray) -> float:
    a, b = np.asarray(a, dtype=bool), np.asarray(b, dtype=bool)
    if a.shape != b.shape:
        return 0.0
    union = np.logical_or(a, b).sum()
    return 1.0 if union == 0 else float(np.logical_and(a, b).sum() / union)


def max_abs(check: OutputCheck, reference: Outputs, spliced: Outputs) -> CheckResult:
    if (missing := _missing(check, reference, spliced)) is not None:
        return missing
    pairs, unmatched = _pairs(check, reference, spliced)
    worst = 0.0
    for ref, got in pairs:
        ref, got = np.asarray(ref, dtype=np.float64), np.asarray(got, dtype=np.float64)
        if ref.shape != got.shape:
            return _result(check, None, False, f"shape {list(got.shape)} != reference {list(ref.shape)}")
        if ref.size:
            worst = max(worst, float(np.abs(ref - got).max()))
    passed = worst <= check.threshold and not unmatched  # type: ignore[operator]
    return _result(check, worst, passed, f"items {unmatched} of the reference are missing" if unmatched else None)


def decision(check: OutputCheck, reference: Outputs, spliced: Outputs) -> CheckResult:
    """A thresholded continuous output judged away from its threshold (`compare.decision`): the
    least agreement over items, near-threshold flips and divergent elements counted."""
    if (missing := _missing(check, reference, spliced)) is not None:
        return missing
    pairs, unmatched = _pairs(check, reference, spliced)
    worst, near, divergent, passed, details = 1.0, 0, 0, not unmatched, []
    for ref, got in pairs:
        figures = decide(ref, got, check.decision_at)  # type: ignore[arg-type]
        if figures is None:
            worst, passed = 0.0, False
            details.append(f"shape {list(np.shape(got))} != reference {list(np.shape(ref))}")
            continue
        worst, near, divergent = (
            min(worst, figures.agreement),
            near + figures.near_threshold_flips,
            divergent + figures.divergent,
        )
        passed = passed and figures.passes(check.threshold)  # type: ignore[arg-type]
    if unmatched:
        worst = 0.0
        details.append(f"items {unmatched} of the reference are missing")
    if near:
        details.append(f"{near} near-threshold flip(s): the reference sat within tolerance of {check.decision_at:g}")
    if divergent:
        details.append(f"{divergent} element(s) moved beyond their tolerance")
    result = _result(check, worst, passed, "; ".join(details) or None)
    return result.model_copy(update={"near_threshold_flips": near, "divergent": divergent})


for _metric, _comparator in (
    ("exact", exact),
    ("tensor", tensor),
    ("iou", iou),
    ("max_abs", max_abs),
    ("decision", decision),
):
    COMPARATORS.register(_metric, _comparator)


def expand(checks: list[OutputCheck], outputs: Outputs) -> list[OutputCheck]:
    """Checks with "*" replaced by one per output: tensor for floats, exact for the rest."""
    expanded: list[OutputCheck] = []
    for check in checks:
        if check.output != "*":
            expanded.append(check)
            continue
        for name, value in outputs.items():
            metric = "tensor" if np.asarray(value).dtype.kind in "fc" else "exact"
            expanded.append(check.model_copy(update={"output": name, "metric": metric, "label": ""}))
    return expanded


def compare_step(checks: list[OutputCheck], reference: Outputs, spliced: Outputs) -> list[CheckResult]:
    """Each check on one step; a metric no comparator is registered for is an error naming it."""
    return [COMPARATORS.get(check.metric)(check, reference, spliced) for check in checks]


def worse(metric: str, a: float | None, b: float | None) -> bool:
    """Whether figure `a` is worse than `b` for this metric (None is the worst). Figures are
    differences, higher is worse, except agreements' (iou, decision)."""
    if a is None:
        return b is not None
    if b is None:
        return False
    return a < b if metric in AGREEMENTS else a > b
