"""Main-path output checks: how a driver's outputs of one step are compared between two runs."""

from __future__ import annotations

import numpy as np
import pytest
from omskills.compare.outputs import compare_step, expand, worse
from omskills.records.verify import CheckSummary, MainPathParity, OutputCheck

IDS = OutputCheck(output="ids", metric="exact")
REGIONS = OutputCheck(output="regions", metric="iou", key="ids", threshold=0.99)
BOXES = OutputCheck(output="boxes", metric="max_abs", key="ids", threshold=0.01)
SCORES = OutputCheck(output="scores", metric="tensor")


def step(ids, regions, boxes, scores):
    return {
        "ids": np.asarray(ids),
        "regions": np.asarray(regions, dtype=bool),
        "boxes": np.asarray(boxes, dtype=float),
        "scores": np.asarray(scores, dtype=np.float32),
    }


def squares(*corners):
    out = np.zeros((len(corners), 8, 8), dtype=bool)
    for k, (r, c) in enumerate(corners):
        out[k, r : r + 4, c : c + 4] = True
    return out


REFERENCE = step([3, 7], squares((0, 0), (4, 4)), [[0, 0, 1, 1], [2, 2, 1, 1]], [0.5, 0.25])


def test_identical_steps_pass_every_check_with_perfect_figures():
    results = compare_step([IDS, REGIONS, BOXES, SCORES], REFERENCE, REFERENCE)
    assert [(r.output, r.value, r.passed) for r in results] == [
        ("ids", 0.0, True),
        ("regions", 1.0, True),
        ("boxes", 0.0, True),
        ("scores", 0.0, True),
    ]


def test_items_are_matched_by_their_key_not_their_position():
    swapped = step([7, 3], squares((4, 4), (0, 0)), [[2, 2, 1, 1], [0, 0, 1, 1]], [0.25, 0.5])
    ids, regions, boxes = compare_step([IDS, REGIONS, BOXES], REFERENCE, swapped)
    assert not ids.passed and ids.value == 1.0  # the order of ids differs
    assert regions.passed and regions.value == 1.0 and boxes.passed and boxes.value == 0.0


def test_exact_items_are_matched_by_key_when_the_check_has_one():
    labels = OutputCheck(output="labels", metric="exact", key="ids")
    reference = {"ids": np.asarray([3, 7]), "labels": np.asarray([1, 2])}
    [same] = compare_step([labels], reference, {"ids": np.asarray([7, 3]), "labels": np.asarray([2, 1])})
    [other] = compare_step([labels], reference, {"ids": np.asarray([7, 3]), "labels": np.asarray([1, 2])})
    assert same.passed and not other.passed and other.value == 1.0


def test_a_missing_item_counts_as_the_worst_value_and_names_it():
    fewer = step([3], squares((0, 0)), [[0, 0, 1, 1]], [0.5])
    _, regions, boxes = compare_step([IDS, REGIONS, BOXES], REFERENCE, fewer)
    assert regions.value == 0.0 and not regions.passed and "items ['7']" in regions.detail
    assert not boxes.passed


def test_a_region_that_moved_lowers_the_iou_below_its_gate():
    moved = step([3, 7], squares((0, 1), (4, 4)), [[0, 0, 1, 1], [2, 2, 1, 1]], [0.5, 0.25])
    [regions] = compare_step([REGIONS], REFERENCE, moved)
    assert regions.value == pytest.approx(12 / 20) and not regions.passed


def test_coordinates_within_their_tolerance_pass_and_beyond_fail():
    near = dict(REFERENCE, boxes=REFERENCE["boxes"] + 0.005)
    far = dict(REFERENCE, boxes=REFERENCE["boxes"] + 0.02)
    assert compare_step([BOXES], REFERENCE, near)[0].passed
    assert not compare_step([BOXES], REFERENCE, far)[0].passed


def test_a_continuous_output_is_judged_by_the_parity_tiers():
    off = dict(REFERENCE, scores=REFERENCE["scores"] + np.float32(5e-3))
    [check] = compare_step([SCORES], REFERENCE, off)
    assert not check.passed and check.value == pytest.approx(5e-3, rel=1e-3) and "review gate" in check.detail


def test_an_output_the_step_lacks_fails_naming_the_side():
    [check] = compare_step([OutputCheck(output="logits", metric="tensor")], REFERENCE, REFERENCE)
    assert not check.passed and check.detail == "no output logits (reference), logits (spliced)"


def test_every_output_star_becomes_tensor_checks_for_floats_and_exact_for_the_rest():
    checks = expand([OutputCheck(output="*", metric="tensor")], REFERENCE)
    assert [(c.output, c.metric) for c in checks] == [
        ("ids", "exact"),
        ("regions", "exact"),
        ("boxes", "tensor"),
        ("scores", "tensor"),
    ]


def _main_path(*checks: tuple[bool, bool], fallbacks: int = 0, steps_equal: bool = True) -> MainPathParity:
    return MainPathParity(
        steps=2,
        steps_equal=steps_equal,
        fallbacks=fallbacks,
        torch_s_per_step=1.0,
        spliced_s_per_step=1.0,
        latency_ratio=1.0,
        checks=[
            CheckSummary(output=f"o{i}", metric="max_abs", title=f"o{i}", worst=1.0, passed=passed, gating=gating)
            for i, (passed, gating) in enumerate(checks)
        ],
    )


def test_a_reported_check_that_fails_leaves_the_verdict_to_the_gating_ones():
    reported = OutputCheck(output="scores", metric="max_abs", threshold=0.0, gating=False)
    [check] = compare_step([reported], REFERENCE, dict(REFERENCE, scores=REFERENCE["scores"] + 1))
    assert not check.passed and not check.gating
    assert _main_path((True, True), (False, False)).verdict == "pass"
    assert _main_path((False, True), (True, False)).verdict == "fail"


def test_a_fallback_or_different_steps_fail_the_main_path_whatever_the_checks():
    assert _main_path((True, True), fallbacks=1).verdict == "fail"
    assert _main_path((True, True), steps_equal=False).verdict == "fail"


def test_lower_iou_and_higher_differences_are_worse():
    assert worse("iou", 0.5, 0.9) and not worse("iou", 0.9, 0.5)
    assert worse("max_abs", 0.2, 0.1) and worse("tensor", None, 0.1)


def test_metrics_that_need_a_gate_refuse_to_be_declared_without_one():
    with pytest.raises(ValueError, match="metric iou needs a threshold"):
        OutputCheck(output="regions", metric="iou")


def _decision_check(**extra) -> OutputCheck:
    return OutputCheck(output="logits", metric="decision", threshold=0.99, decision_at=0.0, **extra)


def test_a_flip_where_the_reference_sat_at_the_threshold_is_a_near_threshold_flip_not_a_divergence():
    """Logits within +-0.2 of the threshold, moved by 0.001: pixels at the threshold flip, as a tiny
    SAM 3.1's did on random weights; nothing diverges and the decided pixels agree."""
    rng = np.random.default_rng(0)
    reference = rng.uniform(-0.2, 0.2, (1, 64, 64)).astype(np.float32)
    spliced = reference + rng.uniform(-1e-3, 1e-3, reference.shape).astype(np.float32)
    flipped = int(((reference > 0) != (spliced > 0)).sum())
    assert flipped > 0
    result = compare_step([_decision_check()], {"logits": reference}, {"logits": spliced})[0]
    assert result.passed and result.value == 1.0 and result.divergent == 0
    assert result.near_threshold_flips == flipped and "near-threshold flip" in result.detail


def test_a_saturated_boundary_that_moves_by_under_a_pixel_is_no_divergence_but_a_flip_far_from_it_is():
    """Logits saturated at +-1024 with a boundary between: a boundary pixel going from -476 to +646
    is a boundary moving by under half a pixel; a pixel deep inside flipping is a divergence."""
    reference = np.full((1, 16, 16), -1024.0, np.float32)
    reference[0, :, 9:] = 1024.0
    reference[0, :, 8] = -476.0  # the boundary column
    moved = reference.copy()
    moved[0, 3, 8] = 646.0
    result = compare_step([_decision_check()], {"logits": reference}, {"logits": moved})[0]
    assert result.passed and result.near_threshold_flips == 1 and result.divergent == 0

    broken = reference.copy()
    broken[0, :8, 2] = 1024.0  # a column deep in the negative region turns positive
    result = compare_step([_decision_check()], {"logits": reference}, {"logits": broken})[0]
    # 8 divergent pixels in a positive union of 7 x 16 + 8 = 120.
    assert not result.passed and result.divergent == 8 and result.value == pytest.approx(1 - 8 / 120)
    assert "moved beyond their tolerance" in result.detail


def test_a_few_pixels_that_diverge_in_a_large_region_pass_and_a_lost_small_object_fails():
    """The figure is the positive region's IoU counting only divergent pixels: a handful in a large
    region (a small component a post-processing rule removed in one run) stays above 0.99; a
    small object lost entirely does not, however small it is against the whole map."""
    reference = np.full((1, 64, 64), -5.0, np.float32)
    reference[0, 8:40, 8:40] = 5.0  # 1024 pixels
    few = reference.copy()
    few[0, 50:52, 50:52] = 5.0  # 4 far pixels turn positive
    result = compare_step([_decision_check()], {"logits": reference}, {"logits": few})[0]
    assert result.passed and result.value == pytest.approx(1 - 4 / 1028)
    small = np.full((1, 64, 64), -5.0, np.float32)
    small[0, 2:5, 2:5] = 5.0  # a 9-pixel object
    lost = np.full_like(small, -5.0)
    result = compare_step([_decision_check()], {"logits": small}, {"logits": lost})[0]
    # Its rim is boundary (excused as a half-pixel move); its centre is not, and fails the check.
    assert not result.passed and result.value == pytest.approx(1 - 1 / 9) and result.near_threshold_flips == 8


def test_a_value_far_from_its_threshold_may_move_a_lot_one_near_it_only_a_little():
    far = np.array([-500.0, -300.0, 400.0, -600.0])
    moved = far + np.array([-288.0, 0.0, 0.0, 0.0])  # -500 -> -788: it stays far on its side
    assert compare_step([_decision_check()], {"logits": far}, {"logits": moved})[0].divergent == 0
    near = np.array([0.05, -0.1, 0.08, -0.06])
    moved = near + np.array([0.85, 0.0, 0.0, 0.0])  # 0.05 -> 0.9: far more than its margin
    assert compare_step([_decision_check()], {"logits": near}, {"logits": moved})[0].divergent == 1


def test_a_decision_check_needs_the_value_it_thresholds_at():
    with pytest.raises(ValueError, match="decision_at"):
        OutputCheck(output="logits", metric="decision", threshold=0.99)
