"""Parity metrics: how a candidate output is judged against its reference."""

from __future__ import annotations

import re

import numpy as np
import pytest
from omskills.compare.parity import compare_arrays, compare_outputs
from omskills.errors import OmskillsError
from omskills.records.parity import OutputParity, ParityGates, ParityReport, overall_verdict
from pydantic import ValidationError


def ones_with_one_element_off(delta: float, size: int = 1000) -> tuple[np.ndarray, np.ndarray]:
    """max_abs is exactly `delta` and the cosine stays ~1, so the max_abs gate decides."""
    reference = np.ones(size, dtype=np.float32)
    candidate = reference.astype(np.float64)
    candidate[size // 2] += delta
    return reference, candidate


def test_identical_arrays_pass_with_perfect_metrics():
    reference = np.random.default_rng(0).standard_normal((4, 8, 16)).astype(np.float32)
    result = compare_arrays("features", reference, reference.copy())
    assert result.verdict == "pass"
    assert result.cosine == pytest.approx(1.0, abs=1e-15)
    assert (result.max_abs, result.max_rel, result.reason) == (0.0, 0.0, None)
    assert (result.shape, result.dtype) == ([4, 8, 16], "float32")


@pytest.mark.parametrize(
    ("delta", "verdict", "reason"),
    [
        (5e-5, "pass", None),
        (5e-4, "review", r"max_abs 0.0005 >= 0.0001 \(pass gate\)"),
        (5e-3, "fail", r"max_abs 0.005 >= 0.001 \(review gate\)"),
    ],
)
def test_max_abs_tiers(delta, verdict, reason):
    result = compare_arrays("y", *ones_with_one_element_off(delta))
    assert result.max_abs == pytest.approx(delta, rel=1e-3)
    assert result.cosine > 0.9999
    assert result.verdict == verdict
    if reason is None:
        assert result.reason is None
    else:
        assert re.fullmatch(reason, result.reason)


def test_cosine_decides_when_values_are_small():
    # Values of ~1e-5: every error is far below 1e-4, yet 3% noise (1 - cosine ~ 4.5e-4) is
    # only reviewable and 10% noise (1 - cosine ~ 5e-3) fails.
    rng = np.random.default_rng(1)
    reference = rng.standard_normal(10_000) * 1e-5
    review = compare_arrays("tiny", reference, reference + rng.standard_normal(10_000) * 3e-7)
    failing = compare_arrays("tiny", reference, reference + rng.standard_normal(10_000) * 1e-6)
    assert review.max_abs < 1e-4 and failing.max_abs < 1e-4
    assert 0.999 <= review.cosine < 0.9999 and review.verdict == "review"
    assert "cosine" in review.reason and "pass gate" in review.reason
    assert failing.cosine < 0.999 and failing.verdict == "fail"
    assert "review gate" in failing.reason


def test_gates_are_data():
    reference, candidate = ones_with_one_element_off(5e-4)
    loose = ParityGates(pass_max_abs=1e-3, review_max_abs=1e-2)
    assert compare_arrays("y", reference, candidate).verdict == "review"
    assert compare_arrays("y", reference, candidate, loose).verdict == "pass"
    with pytest.raises(ValidationError, match="review gates must be looser than pass gates"):
        ParityGates(pass_max_abs=1e-2, review_max_abs=1e-3)


@pytest.mark.parametrize("side", ["reference", "candidate"])
def test_nan_on_either_side_fails(side):
    clean = np.zeros(4, dtype=np.float32)
    dirty = np.array([0.0, np.nan, 0.0, np.nan], dtype=np.float32)
    reference, candidate = (dirty, clean) if side == "reference" else (clean, dirty)
    result = compare_arrays("logits", reference, candidate)
    assert result.verdict == "fail"
    expected = "reference 2, candidate 0" if side == "reference" else "reference 0, candidate 2"
    assert result.reason == f"NaN values: {expected}"


def test_matching_infinities_are_equal_but_stray_ones_fail():
    reference = np.array([-np.inf, 1.0, 2.0], dtype=np.float32)
    assert compare_arrays("masked", reference, reference.copy()).verdict == "pass"
    result = compare_arrays("masked", reference, np.array([-1e30, 1.0, 2.0], dtype=np.float32))
    assert (result.verdict, result.reason) == ("fail", "1 infinite values differ")


def test_shape_mismatch_fails_with_both_shapes():
    result = compare_arrays("masks", np.zeros((1, 3, 4)), np.zeros((1, 4, 3)))
    assert result.verdict == "fail"
    assert result.reason == "shape [1, 4, 3] != reference [1, 3, 4]"
    assert result.cosine is None and result.max_abs is None


def test_all_zero_vectors():
    zeros = np.zeros(16, dtype=np.float32)
    assert compare_arrays("z", zeros, zeros.copy()).cosine == 1.0
    one_sided = compare_arrays("z", zeros, np.full(16, 1e-3, dtype=np.float32))
    assert (one_sided.cosine, one_sided.verdict) == (0.0, "fail")


def test_integer_and_bool_outputs_must_match_exactly():
    ids = np.array([3, 1, 4, 1, 5], dtype=np.int64)
    same = compare_arrays("obj_ids", ids, ids.astype(np.int32))  # int width may change, values may not
    assert (same.verdict, same.mismatch_fraction, same.cosine) == ("pass", 0.0, None)

    off_by_one = compare_arrays("obj_ids", ids, ids + np.array([0, 0, 1, 0, 0]))
    assert off_by_one.verdict == "fail"
    assert off_by_one.mismatch_fraction == pytest.approx(0.2)
    assert off_by_one.reason == "1 of 5 elements differ (exact comparison)"

    mask = np.array([[True, False], [False, True]])
    flipped = compare_arrays("mask", mask, ~mask)
    assert (flipped.verdict, flipped.mismatch_fraction) == ("fail", 1.0)


def test_float_against_integer_is_a_contract_break():
    result = compare_arrays("ids", np.arange(3), np.arange(3).astype(np.float32))
    assert (result.verdict, result.reason) == ("fail", "dtype float32 != reference int64")


def test_overall_verdict_is_the_worst():
    def parity(verdict):
        return OutputParity(name=verdict, shape=[1], dtype="float32", verdict=verdict)

    assert overall_verdict([parity("pass"), parity("pass")]) == "pass"
    assert overall_verdict([parity("pass"), parity("review")]) == "review"
    assert overall_verdict([parity("review"), parity("fail"), parity("pass")]) == "fail"
    with pytest.raises(OmskillsError, match="no outputs to judge"):
        overall_verdict([])


def test_report_over_named_outputs_keeps_worst_figures_and_gates():
    rng = np.random.default_rng(2)
    reference = {"masks": rng.standard_normal((2, 8)), "scores": rng.standard_normal(2), "ids": np.arange(2)}
    candidate = {
        "masks": reference["masks"] + 5e-4,  # review
        "scores": reference["scores"].copy(),  # pass
        "ids": np.arange(2),  # pass (exact)
    }
    report = compare_outputs(reference, candidate)
    assert [o.name for o in report.outputs] == ["masks", "scores", "ids"]
    assert [o.verdict for o in report.outputs] == ["review", "pass", "pass"]
    assert report.verdict == "review"
    assert report.worst_max_abs == pytest.approx(5e-4)
    assert report.worst_cosine == min(o.cosine for o in report.outputs if o.cosine is not None)
    assert report.gates == ParityGates()
    # It is a record: it round-trips through JSON as a task record would store it.
    assert ParityReport.model_validate_json(report.model_dump_json()) == report


def test_an_output_missing_from_the_candidate_fails():
    report = compare_outputs({"a": np.zeros(2), "b": np.zeros(2)}, {"a": np.zeros(2)})
    assert report.verdict == "fail"
    assert report.outputs[1].reason == "missing from candidate"


def test_max_abs_gates_scale_with_the_largest_magnitude_of_the_reference():
    """Box coordinates in pixels carry fp32 errors hundreds of times those of values near 1 for
    the same relative precision: the max-abs gates scale with the reference's largest magnitude."""
    rng = np.random.default_rng(0)
    pixels = rng.uniform(0, 416, 5000)
    noisy = pixels + rng.standard_normal(5000) * 6e-7 * pixels  # fp32-like relative noise
    assert compare_arrays("boxes", pixels, noisy).verdict == "pass"
    off = pixels.copy()
    off[7] += 0.05  # 1.2e-4 of the largest value: beyond the pass gate scaled to 416
    result = compare_arrays("boxes", pixels, off)
    assert result.verdict == "review" and "max_abs 0.05 >= 0.0001 x 416" in result.reason
    # Values within [-1, 1] keep the absolute gates.
    small = compare_arrays("logits", pixels / 416, off / 416 + 2e-4)
    assert small.verdict != "pass"


def test_an_output_over_many_blocks_is_judged_as_one_array(monkeypatch):
    from omskills.compare import parity

    rng = np.random.default_rng(3)
    reference = rng.standard_normal((5, 7)).astype(np.float32)
    candidate = reference + rng.standard_normal((5, 7)).astype(np.float32) * 1e-3
    reference[4, 6] = candidate[4, 6] = -np.inf  # a matching infinity in the last block
    whole = compare_arrays("x", reference, candidate)
    monkeypatch.setattr(parity, "BLOCK", 4)  # 9 blocks, the last one short

    blocked = compare_arrays("x", reference, candidate)

    finite = np.isfinite(reference)
    ref64, cand64 = reference[finite].astype(np.float64), candidate[finite].astype(np.float64)
    cosine = ref64 @ cand64 / (np.linalg.norm(ref64) * np.linalg.norm(cand64))
    assert blocked.cosine == pytest.approx(cosine, abs=1e-12) and blocked.cosine == pytest.approx(whole.cosine)
    assert blocked.max_abs == whole.max_abs == np.abs(ref64 - cand64).max()
    assert blocked.max_rel == whole.max_rel and blocked.verdict == whole.verdict
    candidate[0, 1] = np.inf  # a stray infinity in the first block still fails the whole output
    assert compare_arrays("x", reference, candidate).reason == "1 infinite values differ"
