"""Nothing lost: concurrent writers of one task record, a record cut short, a corrupted artefact,
a copied run folder, and a record's mode and comments across rewrites.

Real processes throughout (CLI tools and one MCP server). The run folders are copies of the
session's tiny adaptation (never written in place); the record-only cases use the repository's
commented task record and the cheap check_environment tool.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import anyio
import pytest
import yaml
from conftest import REPO, TASK, copy_run, omskills
from omskills.orchestrator.mcp_client import connect
from omskills.records.task import load_record, render_record

# Graphs of the tiny SAM 3 adaptation that precheck_ops reads in well under a second each.
WRITERS_CLI = 4
WRITERS_MCP = 4


def tool(name: str, task: Path, *flags: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return omskills("tool", name, "--task", str(task), *flags, cwd=cwd)


def graphs_by_size(task: Path) -> list[str]:
    record = load_record(task)
    return sorted(record.exports, key=lambda g: record.exports[g].bytes)


# -- concurrent writers --------------------------------------------------------------------


async def _mcp_prechecks(workspace: Path, task: Path, graphs: list[str], errlog) -> list[bool]:
    errors: list[bool] = []
    async with connect(workspace, errlog=errlog) as client:

        async def one(graph: str) -> None:
            outcome = await client.call("precheck_ops", {"task": str(task), "candidate": graph})
            errors.append(outcome.is_error)

        async with anyio.create_task_group() as group:
            for graph in graphs:
                group.start_soon(one, graph)
    return errors


def test_concurrent_cli_and_mcp_writers_keep_every_result(tiny_adaptation, tmp_path):
    run = copy_run(tiny_adaptation, tmp_path / "run")
    task = run / "task.yaml"
    graphs = graphs_by_size(task)[: WRITERS_CLI + WRITERS_MCP]
    assert len(graphs) == WRITERS_CLI + WRITERS_MCP, graphs
    # No precheck in the record to begin with: every one found afterwards was written by a writer here.
    data = yaml.safe_load(task.read_text())
    for chain in data["toolchain"].values():
        chain["precheck"] = None
    data["decisions"] = []
    task.write_text(yaml.safe_dump(data, sort_keys=False))

    cli_graphs, mcp_graphs = graphs[:WRITERS_CLI], graphs[WRITERS_CLI:]
    script = REPO / "skills" / "onnx-atc-pipeline" / "scripts" / "precheck_ops.py"
    # Half through `omskills tool`, half through the script itself: both are ways users call tools.
    cli = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                "import sys; from omskills.orchestrator.cli import main; sys.exit(main())",
                "tool",
                "precheck_ops",
                "--task",
                str(task),
                "--candidate",
                g,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        if i % 2 == 0
        else subprocess.Popen(
            [sys.executable, str(script), "--task", str(task), "--candidate", g],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i, g in enumerate(cli_graphs)
    ]
    with (tmp_path / "server.stderr").open("w") as errlog:
        mcp_errors = anyio.run(_mcp_prechecks, run, task, mcp_graphs, errlog)
    outs = [p.communicate(timeout=600) for p in cli]
    assert [p.returncode for p in cli] == [0] * WRITERS_CLI, [err[-2000:] for _, err in outs]
    assert mcp_errors == [False] * WRITERS_MCP, (tmp_path / "server.stderr").read_text()[-3000:]

    record = load_record(task)
    kept = sorted(g for g in graphs if record.toolchain_of(g).precheck is not None)
    assert kept == sorted(graphs)
    decided = sorted(d.what.split(":")[0] for d in record.decisions if d.by == "precheck_ops")
    assert decided == sorted(graphs)
    leftovers = [p.name for p in run.glob(".task.yaml.*") if p.name != ".task.yaml.lock"]
    assert not leftovers, f"temporary record files left behind: {leftovers}"


# -- a record cut short --------------------------------------------------------------------


def _old_order(text: str) -> str:
    """The record as omskills wrote it before stages came last: stages right after the intake."""
    data = yaml.safe_load(text)
    head = {k: data.pop(k) for k in ("schema_version", "id", "intake")}
    return yaml.safe_dump({**head, "stages": data.pop("stages"), **data}, sort_keys=False)


def test_a_record_cut_before_its_boundaries_reruns_the_boundaries_instead_of_failing(tiny_adaptation, tmp_path):
    run = copy_run(tiny_adaptation, tmp_path / "run")
    task = run / "task.yaml"
    before = load_record(task)
    text = _old_order(task.read_text())
    cut = text.index("\nboundaries:") + 1  # `truncate` that happened to land between two sections
    task.write_text(text[:cut])
    assert load_record(task).boundaries == {} and load_record(task).stages["boundaries"].status == "done"

    result = tool("analyze_boundaries", task)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "KeyError" not in result.stderr
    assert "stage boundaries says done but its results are missing (boundaries for" in result.stderr
    after = load_record(task)
    assert sorted(after.boundaries) == sorted(before.boundaries)
    assert after.stages["boundaries"].started != before.stages["boundaries"].started  # redone
    # The study is still done for a step that needs it: capturing contracts reuses it.
    captured = tool("capture_contracts", task)
    assert captured.returncode == 0, captured.stderr[-3000:]
    assert load_record(task).stages["study"].started == before.stages["study"].started  # not redone


def test_a_record_cut_inside_its_stages_redoes_only_the_steps_whose_status_was_lost(tiny_adaptation, tmp_path):
    run = copy_run(tiny_adaptation, tmp_path / "run")
    task = run / "task.yaml"
    before = load_record(task)
    graph = graphs_by_size(task)[0]
    text = task.read_text()
    assert text.rstrip().splitlines()[-1].startswith("  ") and "\nstages:\n" in text  # stages come last
    probe_step = f"  probe:{graph}:original: "
    cut = text.index(probe_step)
    task.write_text(text[:cut])  # every stage entry from this probe on is gone
    truncated = load_record(task)
    assert f"probe:{graph}:original" not in truncated.stages and f"export:{graph}" in truncated.stages

    result = tool("probe_onnx", task, "--candidate", graph)
    assert result.returncode == 0, result.stderr[-3000:]
    after = load_record(task)
    assert after.stages[f"probe:{graph}:original"].status == "done"
    assert after.stages[f"probe:{graph}:original"].started != before.stages[f"probe:{graph}:original"].started
    exported = tool("export_onnx", task, "--candidate", graph)
    assert exported.returncode == 0, exported.stderr[-3000:]
    assert load_record(task).stages[f"export:{graph}"].started == before.stages[f"export:{graph}"].started  # reused


# -- a corrupted artefact ------------------------------------------------------------------


def test_a_corrupted_onnx_is_not_reused_and_its_export_is_redone(tiny_adaptation, tmp_path):
    run = copy_run(tiny_adaptation, tmp_path / "run")
    task = run / "task.yaml"
    graph = graphs_by_size(task)[0]
    record = load_record(task)
    onnx_file = run / record.exports[graph].path
    onnx_file.write_bytes(os.urandom(onnx_file.stat().st_size))  # same size: only the sha256 can tell

    probe = tool("probe_onnx", task, "--candidate", graph)
    assert probe.returncode == 2, probe.stdout[-2000:]
    assert f"{record.exports[graph].path} changed on disk (sha256 differs from the record)" in probe.stderr
    assert f"export:{graph}" in probe.stderr

    export = tool("export_onnx", task, "--candidate", graph)
    assert export.returncode == 0, export.stderr[-3000:]
    assert f"stage export:{graph}: {record.exports[graph].path} changed on disk" in export.stderr
    assert "redoing it" in export.stderr
    probe = tool("probe_onnx", task, "--candidate", graph)
    assert probe.returncode == 0, probe.stderr[-3000:]
    after = load_record(task)
    assert after.toolchain_of(graph).probes["original"].verdict == "pass"
    assert after.stages[f"export:{graph}"].started != record.stages[f"export:{graph}"].started  # redone


# -- a copied run folder -------------------------------------------------------------------


def _strings(value) -> list[str]:
    if isinstance(value, dict):
        return [s for v in value.values() for s in _strings(v)]
    if isinstance(value, list):
        return [s for v in value for s in _strings(v)]
    return [value] if isinstance(value, str) else []


def test_a_copied_run_folder_works_on_its_own_files(tiny_adaptation, tmp_path):
    original = copy_run(tiny_adaptation, tmp_path / "original")
    copy = copy_run(original, tmp_path / "copy")
    # The original's models go away: a copy that still read them would fail.
    shutil.rmtree(original / "onnx")
    task = copy / "task.yaml"
    graph = graphs_by_size(task)[0]
    for name, args in [
        ("optimize_onnx", ["--candidate", graph]),
        ("probe_onnx", ["--candidate", graph]),
        ("precheck_ops", ["--candidate", graph]),
        ("convert_atc", ["--candidate", graph]),
    ]:
        result = tool(name, task, *args)
        assert result.returncode == 0, f"{name}: {result.stderr[-3000:]}"
    text = task.read_text()
    assert str(original) not in text and str(tiny_adaptation) not in text
    record = load_record(task)
    # Every path the record holds for the run's files resolves inside the copy.
    assert record.preferred_model(copy, graph).resolve().is_relative_to(copy.resolve())
    chain = record.toolchain_of(graph)
    assert chain.precheck is not None and not Path(chain.precheck.model).is_absolute()
    assert chain.atc is not None and not Path(chain.atc.script).is_absolute()
    assert not any(s.startswith(str(tmp_path)) for s in _strings(record.model_dump(mode="json")))


# -- mode and comments ---------------------------------------------------------------------


def test_a_rewritten_record_keeps_its_mode_and_its_comments(tmp_path):
    task = tmp_path / "task.yaml"
    shutil.copy(TASK, task)
    task.chmod(0o640)
    comments = [line.strip() for line in TASK.read_text().splitlines() if line.strip().startswith("#")]
    assert len(comments) >= 4

    result = tool("check_environment", task)
    assert result.returncode == 0, result.stderr[-2000:]
    assert stat.S_IMODE(task.stat().st_mode) == 0o640
    text = task.read_text()
    assert [line.strip() for line in text.splitlines() if line.strip().startswith("#")] == comments
    record = load_record(task)
    assert record.environment is not None and record.stages["environment"].status == "done"
    # The intake, unchanged, is kept as the user wrote it.
    user_intake = TASK.read_text().split("intake:", 1)[1].split("\ndecisions:", 1)[0]
    assert user_intake.rstrip() in text


def test_a_changed_intake_keeps_its_comments_and_says_the_new_values(tmp_path):
    source = load_record(TASK)
    source.intake.model.scale = "tiny"
    source.intake.inputs["frames"] = 2
    text = render_record(source, TASK.read_text())
    assert "# The whole model goes to the device" in text and text.startswith("# SAM 3")
    written = tmp_path / "task.yaml"
    written.write_text(text)
    again = load_record(written)
    assert again.intake == source.intake
    assert again.intake.model.scale == "tiny" and again.intake.inputs["frames"] == 2


def test_a_record_another_writer_replaced_is_read_afresh_and_one_read_back_matches_a_fresh_parse(tmp_path):
    from omskills.records.task import parse_record, save_record, updating

    task = tmp_path / "task.yaml"
    shutil.copy(TASK, task)
    with updating(task) as record:
        record.decide("test", "first", "written by this process")
    # Another writer (a plain file write: no lock, no knowledge of this process) changes a value
    # without changing the text's length.
    text = task.read_text()
    assert "written by this process" in text
    task.write_text(text.replace("written by this process", "written by another writer"))
    assert load_record(task).decisions[-1].why == "written by another writer"
    # What this process saved and reads back is what a fresh parse of the file gives.
    with updating(task) as record:
        record.decide("test", "second", "again from this process")
    assert load_record(task).model_dump() == parse_record(yaml.safe_load(task.read_text()), task).model_dump()
    save_record(load_record(task), task)  # a save of what was read changes nothing
    assert task.read_text() == render_record(parse_record(yaml.safe_load(task.read_text()), task), task.read_text())


def test_the_adapted_run_kept_the_comments_of_the_users_record(tiny_adaptation):
    text = (tiny_adaptation / "task.yaml").read_text()
    assert "# The whole model goes to the device" in text
    # A new record gets the mode open() gives a new file, not mkstemp's 0600.
    assert stat.S_IMODE((tiny_adaptation / "task.yaml").stat().st_mode) == 0o666 & ~_umask()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@pytest.mark.parametrize("section", ["intake", "contracts"])
def test_stages_are_written_after_the_results_they_summarise(tiny_adaptation, section):
    keys = [
        line.split(":")[0]
        for line in (tiny_adaptation / "task.yaml").read_text().splitlines()
        if line and line[0].isalpha()
    ]
    assert keys[-1] == "stages" and keys.index(section) < keys.index("stages")
