"""check_environment: what this machine can run, written to the task record."""

from __future__ import annotations

import logging
import os
import stat
import textwrap
from pathlib import Path

import pytest
import yaml
from omskills.ascend.probe import probe_cann, probe_npu
from omskills.errors import InputError, TaskRecordError
from omskills.host.toolkit import load_tool, skills_root
from omskills.machine.probe import probe_environment
from omskills.models.registry import bind_intake, resolved_spec
from omskills.records.environment import STAGES
from omskills.records.stages import StageResult
from omskills.records.task import TaskRecord, load_record, save_record
from omskills.records.toolchain import AtcResult, OpPrecheck
from omskills.records.toolchain_stage import CandidateToolchain

TOOL = load_tool(skills_root() / "om-deployer" / "scripts" / "check_environment.py").func

NPU_SMI_INFO = """\
+------------------------------------------------------------------------------------------------+
| npu-smi 23.0.0                   Version: 23.0.0                                               |
+---------------------------+---------------+----------------------------------------------------+
| NPU   Name                | Health        | Power(W)    Temp(C)           Hugepages-Usage(page)|
| Chip                      | Bus-Id        | AICore(%)   Memory-Usage(MB)  HBM-Usage(MB)        |
+===========================+===============+====================================================+
| 0     910B4               | OK            | 86.5        40                0    / 0             |
| 0                         | 0000:C1:00.0  | 0           0    / 0          2862 / 32768         |
+===========================+===============+====================================================+
"""


def write_record(folder: Path, **model_fields) -> Path:
    model = {"family": "sam3", "builder": "build_sam3_video_model", "scale": "tiny"} | model_fields
    record = TaskRecord.model_validate(
        {
            "id": "env-test",
            "intake": {
                "model": model,
                "inputs": {"video": "builtin:shapes", "prompt": "objects"},
                "target": {"soc": "Ascend310P3"},
            },
        }
    )
    path = folder / "task.yaml"
    save_record(record, path)
    return path


def executable(path: Path, body: str) -> Path:
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


@pytest.fixture(scope="module")
def this_machine(tmp_path_factory):
    """The tool run once on this machine (no Ascend toolchain here)."""
    path = write_record(tmp_path_factory.mktemp("env"))
    return TOOL(task=str(path)), path


def test_reports_every_stage_with_a_reason(this_machine):
    report, _ = this_machine
    assert [s.stage for s in report.stages] == list(STAGES)
    assert all(s.reason for s in report.stages)


def test_without_cann_the_atc_and_om_stages_cannot_run(this_machine, monkeypatch):
    report, _ = this_machine
    if report.atc or report.cann.home:
        pytest.skip(f"this machine has an Ascend toolchain ({report.atc or report.cann.home})")
    atc = report.stage("atc")
    assert not atc.can_run and "atc not on PATH" in atc.reason
    assert not report.can_run("om_run") and "ais_bench" in report.stage("om_run").reason
    assert "om" not in report.backends


def test_onnxruntime_cpu_backend_and_python_stages_are_available(this_machine):
    report, _ = this_machine
    assert "onnxruntime:CPUExecutionProvider" in report.backends
    assert report.package("onnxruntime").importable and report.package("onnxruntime").version
    assert report.torch.version and report.python.startswith("3.11")
    for stage in ("inventory", "profile", "contracts", "export", "optimize", "precheck", "verify"):
        assert report.can_run(stage), report.stage(stage).reason


def test_the_report_is_written_to_the_task_record(this_machine):
    report, path = this_machine
    record = load_record(path)
    assert record.environment == report
    assert record.stages["environment"].status == "done"


def test_a_rerun_on_the_same_machine_reuses_its_probe_and_another_machine_state_probes_again(
    tmp_path, monkeypatch, caplog
):
    path = write_record(tmp_path)
    first = TOOL(task=str(path))
    with caplog.at_level(logging.INFO, logger="omskills.stages.environment"):
        again = TOOL(task=str(path))
    assert again.probed_at == first.probed_at and again.packages == first.packages
    assert f"the probe of {first.probed_at} reused" in caplog.text
    # Another PATH may hold another atc, another interpreter other packages: the machine is probed again.
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="omskills.stages.environment"):
        third = TOOL(task=str(path))
    assert "reused" not in caplog.text and third.probed_at >= first.probed_at


def test_fake_ascend_toolchain_is_detected(tmp_path, monkeypatch):
    """A CANN layout, `atc` and `npu-smi` on PATH: the atc stage opens, the SoC is read."""
    home = tmp_path / "Ascend" / "ascend-toolkit" / "latest"
    (home / "x86_64-linux").mkdir(parents=True)
    (home.parent / "set_env.sh").write_text("export ASCEND_TOOLKIT_HOME=...\n")
    (home / "x86_64-linux" / "ascend_toolkit_install.info").write_text(
        "package_name=Ascend-cann-toolkit\nversion=8.0.RC2\n"
    )
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    executable(bin_dir / "atc", "echo atc\n")
    executable(bin_dir / "npu-smi", f"cat <<'EOF'\n{NPU_SMI_INFO}EOF\n")
    monkeypatch.setenv("PATH", f"{bin_dir}:{Path('/usr/bin')}:{Path('/bin')}")
    monkeypatch.setenv("ASCEND_TOOLKIT_HOME", str(home))

    cann = probe_cann(ascend_root=tmp_path / "Ascend")
    assert (cann.home, cann.found_by, cann.version) == (str(home), "ASCEND_TOOLKIT_HOME", "8.0.RC2")
    assert cann.set_env == str(home.parent / "set_env.sh")
    assert probe_npu().soc == "Ascend910B4"

    intake = load_record(write_record(tmp_path)).intake
    report = probe_environment(intake, ascend_root=tmp_path / "Ascend")
    assert report.can_run("atc") and report.atc == str(bin_dir / "atc")
    assert not report.can_run("om_run")  # ais_bench / aclruntime are still missing
    assert any("Ascend310P3" in note and "Ascend910B4" in note for note in report.notes)


def test_a_backend_registered_at_test_time_shows_in_the_report(monkeypatch):
    """The report's backends are what the `omskills.backends` registry's entries say they run here."""
    from omskills.runtime import BACKENDS, OnnxRuntimeBackend

    class AbacusBackend(OnnxRuntimeBackend):
        kind = "abacus"

        @classmethod
        def runs_here(cls) -> list[str]:
            return ["abacus:beads"]

    monkeypatch.setattr(BACKENDS, "_code", dict(BACKENDS._code))
    monkeypatch.setattr(BACKENDS, "_loaded", dict(BACKENDS._loaded))
    BACKENDS.register("abacus", AbacusBackend)
    report = probe_environment()
    assert "abacus:beads" in report.backends
    assert "onnxruntime:CPUExecutionProvider" in report.backends
    assert "abacus:beads" in report.stage("verify").reason


def test_cann_installed_but_not_sourced_says_what_to_source(tmp_path, monkeypatch):
    home = tmp_path / "Ascend" / "cann-8.5.0"
    home.mkdir(parents=True)
    (home / "set_env.sh").write_text("")
    (home / "version.info").write_text("Version=8.5.0\n")
    monkeypatch.delenv("ASCEND_TOOLKIT_HOME", raising=False)
    monkeypatch.delenv("ASCEND_HOME_PATH", raising=False)
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    report = probe_environment(ascend_root=tmp_path / "Ascend")
    assert report.cann.version == "8.5.0"
    atc = report.stage("atc")
    assert not atc.can_run and f"source {home / 'set_env.sh'}" in atc.reason


def test_missing_model_source_closes_the_model_stages(tmp_path):
    report = TOOL(task=str(write_record(tmp_path, source=str(tmp_path / "no-such-checkout"))))
    for stage in ("inventory", "profile", "contracts"):
        assert not report.can_run(stage)
        assert "no-such-checkout" in report.stage(stage).reason
    assert report.can_run("export")


def test_a_record_without_intake_is_an_error_and_stays_untouched(tmp_path):
    path = tmp_path / "task.yaml"
    path.write_text(
        textwrap.dedent("""\
        id: no-intake
        stages: {}
        """)
    )
    before = path.read_bytes()
    with pytest.raises(TaskRecordError, match="intake"):
        TOOL(task=str(path))
    assert path.read_bytes() == before


# -- the gate: what the task asks, checked before any model runs -------------------------------

NET_DRIVER = """\
def build_model(spec):
    import torch
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))

def run_main_path(model, inputs):
    import torch
    return model(torch.zeros(1, 4))
"""


def test_the_gate_says_what_it_checked(this_machine):
    report, _ = this_machine
    assert "intake.inputs.video: builtin:shapes, 30 frames, the first 8 used" in report.checked
    assert any(
        line.startswith("intake.model.builder: sam3.model_builder.build_sam3_video_model") for line in report.checked
    )
    # Before any build the gate cannot know what the builder reads: it says how the label will be found.
    assert (
        "intake.model.checkpoint: none (the weights are what the builder makes: the files it reads are named "
        "with their sha256 when the model is built, random from seed 0 if it reads none)"
    ) in report.checked


def test_an_unknown_soc_names_the_closest_known_ones():
    from omskills.ascend.atc import check_soc, soc_problem
    from omskills.errors import InputError

    assert soc_problem("Ascend910B4") is None
    with pytest.raises(InputError, match=r"^intake.target.soc: unknown SoC 'Ascend910b4' .*did you mean Ascend910B4"):
        check_soc("Ascend910b4", "intake.target.soc")


def test_the_builtin_clip_refuses_more_frames_than_it_has_before_drawing_one():
    from omskills.errors import InputError
    from omskills.models.media import BUILTIN_CLIP_FRAMES, load_video

    with pytest.raises(InputError, match=f"has {BUILTIN_CLIP_FRAMES['shapes']} frames, 1000000000 asked"):
        load_video("builtin:shapes", 1_000_000_000, field="intake.inputs.video")


def test_a_video_whose_container_does_not_record_its_length_is_counted_only_as_far_as_needed(tmp_path, monkeypatch):
    """improps says 0 frames for such a container: the gate decodes, stopping one frame past those asked."""
    import dataclasses

    import imageio.v3 as iio
    import numpy as np
    from omskills.models.registry import family_driver

    clip = tmp_path / "clip.gif"
    iio.imwrite(clip, np.stack([np.full((8, 8, 3), 40 * i, dtype=np.uint8) for i in range(5)]), loop=0)
    props = iio.improps(clip)
    assert props.shape[0] == 5  # the gif records it; the test pretends it does not
    monkeypatch.setattr(iio, "improps", lambda path: dataclasses.replace(props, shape=(0, *props.shape[1:])))
    decoded = []
    real_imiter = iio.imiter

    def counting_imiter(path):
        for frame in real_imiter(path):
            decoded.append(frame)
            yield frame

    monkeypatch.setattr(iio, "imiter", counting_imiter)
    driver = family_driver("sam3")
    inputs = lambda frames: driver.parse_inputs({"video": "clip.gif", "prompt": "objects", "frames": frames})  # noqa: E731
    found = driver.check_inputs(inputs(2), tmp_path)
    assert found == [f"intake.inputs.video: {clip}, more than 2 frames, the first 2 used"]
    assert len(decoded) == 3
    decoded.clear()
    with pytest.raises(InputError, match=r"^intake.inputs.frames: 8 frames asked, but the video .*clip.gif has 5$"):
        driver.check_inputs(inputs(8), tmp_path)
    assert len(decoded) == 5


def test_a_checkpoint_that_fits_passes_and_one_that_does_not_is_one_line(tmp_path):
    import torch

    (tmp_path / "net.py").write_text(NET_DRIVER)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    torch.save(model.state_dict(), tmp_path / "fits.pt")
    torch.save({"model": {"encoder.weight": torch.zeros(1)}}, tmp_path / "other.pt")
    record = {"id": "net", "intake": {"model": {"driver": "net.py", "checkpoint": "fits.pt"}}}
    path = tmp_path / "task.yaml"
    path.write_text(yaml.safe_dump(record))
    report = TOOL(task=str(path))
    assert f"intake.model.checkpoint: {tmp_path / 'fits.pt'}, 4 tensors, its keys fit the full model" in report.checked

    record["intake"]["model"]["checkpoint"] = "other.pt"
    path.write_text(yaml.safe_dump(record))
    before = path.read_bytes()
    with pytest.raises(InputError) as refused:
        TOOL(task=str(path))
    assert str(refused.value) == (
        f"intake.model.checkpoint: {tmp_path / 'other.pt'} does not fit the full net model: "
        "4 missing key(s) (e.g. 0.bias, 0.weight, 2.bias), 1 unexpected key(s) (e.g. encoder.weight)"
    )
    assert path.read_bytes() == before


def test_a_sam3_checkpoint_of_other_keys_is_counted_against_the_model_at_the_scale_asked(tmp_path):
    """The tiny SAM 3 is built on the meta device for its keys: no weights are allocated."""
    import torch

    torch.save({"model": {"detector.unknown.weight": torch.zeros(2)}}, tmp_path / "sam3.pt")
    path = write_record(tmp_path, checkpoint="sam3.pt")
    before = path.read_bytes()
    with pytest.raises(InputError) as refused:
        TOOL(task=str(path))
    message = str(refused.value)
    assert message.startswith(f"intake.model.checkpoint: {tmp_path / 'sam3.pt'} does not fit the tiny sam3 model: ")
    # The count is the tiny model's own key count, as the driver lists it (so no figure is written here).
    record = load_record(path)
    expected = bind_intake(record.intake, tmp_path).driver.expected_state_keys(
        resolved_spec(record.intake.model, tmp_path)
    )
    assert expected and "detector.unknown.weight" not in expected
    assert f"{len(expected)} missing key(s) (e.g. detector." in message
    assert "1 unexpected key(s) (e.g. detector.unknown.weight)" in message
    assert "\n" not in message and len(message) < 600
    assert path.read_bytes() == before


def _precheck(soc: str) -> OpPrecheck:
    return OpPrecheck(
        model="onnx/g/g.onnx",
        soc=soc,
        opset=17,
        table="test table",
        verdict="pass",
        counts={"supported": 0, "constrained": 0, "unsupported": 0},
        rows=[],
    )


def test_sam3_keys_are_held_against_a_checkpoint_only_for_a_builder_that_loads_them_as_saved():
    """build_sam3_image_model renames the keys on load (detector./tracker. prefixes): the gate leaves them
    to it rather than compare raw names that would never match."""
    from omskills.models.registry import family_driver
    from omskills.records.intake import ModelSpec

    spec = ModelSpec.model_validate({"family": "sam3", "builder": "build_sam3_image_model", "scale": "tiny"})
    assert family_driver("sam3").expected_state_keys(spec) is None


def test_a_changed_soc_drops_the_atc_results_and_prechecks_written_for_the_old_one(tmp_path):
    path = write_record(tmp_path)  # target.soc Ascend310P3
    record = load_record(path)
    command = ["atc", "--model=g.onnx", "--framework=5", "--output=om/g", "--soc_version=Ascend910B4"]
    record.toolchain = {
        "g": CandidateToolchain(
            atc=AtcResult(status="not_run", command=command, script="om/g/atc.sh"), precheck=_precheck("Ascend910B4")
        ),
        "h": CandidateToolchain(
            atc=AtcResult(status="not_run", command=[*command[:4], "--soc_version=Ascend310P3"], script="om/h/atc.sh"),
            precheck=_precheck("Ascend310P3"),
        ),
        "k": CandidateToolchain(precheck=_precheck("Ascend910B4")),  # prechecked for the old SoC, never converted
    }
    record.stages["atc:g"] = StageResult(status="not_run")
    record.stages["atc:h"] = StageResult(status="not_run")
    save_record(record, path)
    TOOL(task=str(path))
    after = load_record(path)
    assert after.toolchain["g"].atc is None and "atc:g" not in after.stages and after.toolchain["g"].precheck is None
    assert after.toolchain["k"].precheck is None
    # Written for the target SoC: kept.
    assert (
        after.toolchain["h"].atc is not None and "atc:h" in after.stages and after.toolchain["h"].precheck is not None
    )
    dropped = [d.what for d in after.decisions if d.by == "check_environment"]
    assert dropped == ["ATC results dropped for g; operator prechecks dropped for g, k"]
