"""check_environment: what this machine can run, written to the task record."""

from __future__ import annotations

import stat
import textwrap
from pathlib import Path

import pytest
from omskills.errors import TaskRecordError
from omskills.host.environment import probe_cann, probe_environment, probe_npu
from omskills.host.toolkit import load_tool, skills_root
from omskills.records.environment import STAGES
from omskills.records.task import TaskRecord, load_record, save_record

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
    record = TaskRecord.model_validate({
        "id": "env-test",
        "intake": {"model": model, "inputs": {"video": "builtin:shapes", "prompt": "objects"},
                   "target": {"soc": "Ascend310P3"}},
    })
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


def test_fake_ascend_toolchain_is_detected(tmp_path, monkeypatch):
    """A CANN layout, `atc` and `npu-smi` on PATH: the atc stage opens, the SoC is read."""
    home = tmp_path / "Ascend" / "ascend-toolkit" / "latest"
    (home / "x86_64-linux").mkdir(parents=True)
    (home.parent / "set_env.sh").write_text("export ASCEND_TOOLKIT_HOME=...\n")
    (home / "x86_64-linux" / "ascend_toolkit_install.info").write_text("package_name=Ascend-cann-toolkit\nversion=8.0.RC2\n")
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
    path.write_text(textwrap.dedent("""\
        id: no-intake
        stages: {}
        """))
    before = path.read_bytes()
    with pytest.raises(TaskRecordError, match="intake"):
        TOOL(task=str(path))
    assert path.read_bytes() == before
