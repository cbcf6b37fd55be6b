"""Foundation (issue 2): the real SAM 3 main path on CPU, reproducible, with clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml
from conftest import TASK, omskills


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory) -> list[Path]:
    outs = []
    for i in range(2):
        out = tmp_path_factory.mktemp(f"mp{i}")
        result = omskills("main-path", str(TASK), "--scale", "tiny", "--frames", "2", "--out", str(out))
        assert result.returncode == 0, result.stderr[-3000:]
        outs.append(out)
    return outs


def _outputs(step: dict) -> dict:
    return {o["name"]: o for o in step["outputs"]}


def test_main_path_tracks_forced_objects_and_reports_random_weights(two_runs):
    report = json.loads((two_runs[0] / "main_path.json").read_text())
    assert report["weights"] == "random" and report["scale"] == "tiny" and report["step_name"] == "frame"
    assert report["num_steps"] == 2 and [s["index"] for s in report["steps"]] == [0, 1]
    assert all(_outputs(step)["obj_ids"]["values"] for step in report["steps"]), (
        "an object is tracked through every frame"
    )
    masks = _outputs(report["steps"][0])["masks"]
    assert masks["dtype"] == "bool" and masks["shape"][1:] == [480, 640] and masks["true_count"] > 0
    assert any("force_top_k_detections=2" in line for line in report["verification"])
    assert (two_runs[0] / report["pictures"][0]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_portability_findings_name_file_and_line(two_runs):
    findings = json.loads((two_runs[0] / "main_path.json").read_text())["portability_findings"]
    kinds = {f["kind"] for f in findings}
    assert {"cuda_call", "pin_memory", "autocast"} <= kinds
    assert all(f["file"].endswith(".py") and f["line"] > 0 for f in findings if f["kind"] != "cpu_fallback")


def test_same_seed_gives_identical_outputs(two_runs):
    a, b = (json.loads((out / "main_path.json").read_text()) for out in two_runs)
    assert [s["outputs"] for s in a["steps"]] == [s["outputs"] for s in b["steps"]]
    ma, mb = (np.load(out / "outputs.npz") for out in two_runs)
    assert sorted(ma.files) == sorted(mb.files) and "1/masks" in ma.files
    assert all(np.array_equal(ma[k], mb[k]) for k in ma.files)


def _write(tmp_path: Path, change) -> Path:
    data = yaml.safe_load(TASK.read_text())
    change(data)
    path = tmp_path / "task.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.parametrize(
    "change, expected",
    [
        (lambda d: d["intake"]["inputs"].update(video="/no/such/video.mp4"), "video not found: /no/such/video.mp4"),
        (lambda d: d["intake"]["inputs"].update(frames="many"), "intake.inputs.frames"),
        (lambda d: d["intake"]["model"].update(colour="red"), "intake.model.colour: unknown field"),
        (
            lambda d: d["intake"]["model"].update(checkpoint="/no/such/sam3.pt"),
            "checkpoint file not found: /no/such/sam3.pt",
        ),
        (lambda d: d.pop("intake"), "intake: field required"),
    ],
)
def test_bad_input_is_one_clear_line_and_non_zero_exit(tmp_path, change, expected):
    result = omskills("main-path", str(_write(tmp_path, change)), "--scale", "tiny", "--out", str(tmp_path / "out"))
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert expected in last and "Traceback" not in result.stderr


def test_unknown_scale_is_refused(tmp_path):
    result = omskills("main-path", str(TASK), "--scale", "huge")
    assert result.returncode == 2 and "invalid choice: 'huge'" in result.stderr
