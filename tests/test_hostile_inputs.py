"""Hostile input is normal input: nothing escapes the workspace, nothing of the user's is deleted,
an interrupted step never stays `running`. The cases a record and a CLI line can carry are rows of
the table in test_bad_inputs.py (one line, exit 2, the record untouched); these are the others:
the HTTP transport, bundles, MCP errors, artefacts changed behind the record's back, leftovers of
killed processes, and names of any shape."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import anyio
import httpx
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from mcp_helpers import write_toy_skill
from omskills.errors import InputError
from omskills.records.names import safe_name

CLI = "import sys; from omskills.orchestrator.cli import main; sys.exit(main())"
REPO = Path(__file__).resolve().parents[1]


def _dead_pid() -> int:
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(done.stdout)


# -- names of any shape never lead outside the run folder ---------------------------------------


@settings(max_examples=400, deadline=None)
@given(
    st.one_of(
        st.text(min_size=1, max_size=300),
        st.lists(
            st.sampled_from(["..", ".", "/", ":", "\x00", "a", "é", "-", "_", "~", "\\"]), min_size=1, max_size=12
        ).map("".join),
    )
)
def test_a_name_the_record_accepts_is_a_file_name_inside_the_run_folder(name):
    run = Path("/work/run")
    try:
        safe_name(name)
    except ValueError:
        return  # refused when the record loads, with the field's name
    for path in (
        run / "onnx" / name / f"{name}.onnx",
        run / "om" / name / f"convert_{name}.sh",
        run / "samples" / f"{name}_0.npz",
    ):
        assert Path(os.path.normpath(path)).is_relative_to(run) and path.name.encode().__len__() <= 255


# -- the HTTP transport ----------------------------------------------------------------------


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


INITIALIZE = {
    "jsonrpc": "2.0",
    "id": 1,
    "method": "initialize",
    "params": {"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "probe", "version": "1"}},
}


async def _post(url: str, host_header: str, origin: str | None, deadline: float) -> int:
    headers = {"Host": host_header, "Accept": "application/json, text/event-stream", "Content-Type": "application/json"}
    if origin:
        headers["Origin"] = origin
    while True:
        try:
            async with httpx.AsyncClient(timeout=10) as client:
                return (await client.post(url, json=INITIALIZE, headers=headers)).status_code
        except httpx.TransportError:
            if time.monotonic() > deadline:
                raise
            await anyio.sleep(0.3)


@pytest.mark.parametrize("host", ["127.0.0.2", "0:0:0:0:0:0:0:1"])
def test_any_loopback_spelling_refuses_a_rebound_host_and_serves_its_own(tmp_path, host):
    write_toy_skill(tmp_path / "skills")
    port = _free_port(host)
    bound = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    server = subprocess.Popen(
        [
            sys.executable,
            "-c",
            CLI,
            "serve",
            "--http",
            bound,
            "--workspace",
            str(tmp_path),
            "--skills-dir",
            str(tmp_path / "skills"),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        url = f"http://{bound}/mcp"
        rebound = anyio.run(_post, url, f"evil.example:{port}", "http://evil.example", time.monotonic() + 60)
        foreign_origin = anyio.run(_post, url, bound, "http://evil.example", time.monotonic() + 60)
        own = anyio.run(_post, url, bound, f"http://{bound}", time.monotonic() + 60)
    finally:
        server.terminate()
        server.wait(timeout=30)
    assert (rebound, foreign_origin, own) == (421, 403, 200)


def test_a_port_in_use_is_one_line(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "-c", CLI, "serve", "--http", f"127.0.0.1:{port}", "--workspace", str(tmp_path)],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [
        f"omskills: error: --http 127.0.0.1:{port}: cannot listen there (Address already in use)"
    ]


# -- bundles -----------------------------------------------------------------------------------


def test_bundle_out_never_removes_a_users_folder_and_refuses_a_symlink(tmp_path):
    from omskills.deploy.bundle import _check_replaceable

    users = tmp_path / "mine"
    users.mkdir()
    (users / "bundle.json").write_text("{}")  # looks like a bundle
    (users / "thesis.tex").write_text("years of work")
    with pytest.raises(Exception, match="holds files omskills did not write"):
        _check_replaceable(users)
    assert (users / "thesis.tex").read_text() == "years of work"
    (tmp_path / "link").symlink_to(users)
    with pytest.raises(Exception, match="is a symbolic link"):
        _check_replaceable(tmp_path / "link")
    # A folder the bundle wrote, with a file a user added since: refused, the file kept.
    ours = tmp_path / "ours"
    ours.mkdir()
    (ours / ".omskills-bundle").write_text("bundle.json\n")
    (ours / "bundle.json").write_text("{}")
    _check_replaceable(ours)  # only what it wrote: may be replaced
    (ours / "notes.txt").write_text("mine")
    with pytest.raises(Exception, match="holds 1 file.s. the bundle did not write .notes.txt"):
        _check_replaceable(ours)


def test_only_a_staging_folder_this_tool_made_for_a_gone_process_is_removed(tmp_path):
    from omskills.deploy.bundle import _new_staging, _remove_dead_staging

    out, dead = tmp_path / "X", _dead_pid()
    users = tmp_path / f".X.writing-{dead}"  # the user's own folder, named like a staging folder
    users.mkdir()
    (users / "notes.txt").write_text("mine")
    forged = tmp_path / f".X.writing-{dead}-{'0' * 16}"  # the right shape, no marker
    forged.mkdir()
    (forged / "notes.txt").write_text("mine too")
    left = _new_staging(out, "writing")  # a killed writer's: its marker names a pid now gone
    marker = left / ".omskills-staging"
    token = left.name.rsplit("-", 1)[1]
    gone = left.rename(tmp_path / f".X.writing-{dead}-{token}")
    (gone / ".omskills-staging").write_text(f"{dead} {token}\n")
    alive = _new_staging(out, "writing")  # this process's own, still running

    _remove_dead_staging(out)

    assert (users / "notes.txt").read_text() == "mine" and (forged / "notes.txt").read_text() == "mine too"
    assert not gone.exists() and alive.is_dir() and not marker.exists()


@pytest.fixture()
def bundle(tmp_path) -> Path:
    from omskills.files import sha256_file
    from omskills.records.deploy import BUNDLE_FORMAT
    from omskills.records.task import SCHEMA_VERSION

    root = tmp_path / "bundle"
    (root / "graphs" / "g").mkdir(parents=True)
    onnx = root / "graphs" / "g" / "g.onnx"
    onnx.write_bytes(b"graph bytes")
    spec = {"name": "x", "tree_path": "args[0]", "shape": [1], "dtype": "float32", "dynamic_dims": {}, "device": "cpu"}
    contract = {
        "candidate": "g",
        "module_path": "g",
        "module_class": "M",
        "parent_path": "",
        "attribute": "g",
        "calls": 1,
        "in_spec": "",
        "out_spec": "",
        "inputs": [spec],
        "outputs": [{**spec, "name": "y", "tree_path": "out"}],
    }
    manifest = {
        "format": BUNDLE_FORMAT,
        "contract_schema": SCHEMA_VERSION,
        "omskills_version": "0",
        "task_id": "t",
        "created": "now",
        "intake": {"model": {"family": "sam3"}},
        "weights": "random",
        "verified": "pass",
        "graphs": [
            {
                "name": "g",
                "plan_candidate": "g",
                "module_path": "g",
                "contract": contract,
                "onnx": {
                    "files": [{"path": "graphs/g/g.onnx", "bytes": onnx.stat().st_size, "sha256": sha256_file(onnx)}]
                },
            }
        ],
    }
    (root / "bundle.json").write_text(json.dumps(manifest))
    return root


def _manifest(root: Path) -> dict:
    return json.loads((root / "bundle.json").read_text())


def test_a_bundle_reads_when_intact(bundle):
    from omskills.deploy.manifest import read_bundle

    assert [g.name for g in read_bundle(bundle).graphs] == ["g"]


@pytest.mark.parametrize(
    "tamper, refused",
    [
        ("artefact-symlink", "is a symbolic link"),
        ("graphs-folder-symlink", "is a symbolic link"),
        ("path-through-symlinked-folder", "is a symbolic link"),
        ("null-hash", "records no sha256"),
        ("path-climbs", "not a path inside the run folder or bundle"),
    ],
)
def test_a_tampered_bundle_is_refused(bundle, tmp_path, tamper, refused):
    from omskills.deploy.manifest import DeployError, read_bundle

    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "g.onnx").write_bytes(b"graph bytes")  # same size, same bytes: only the links are wrong
    manifest = _manifest(bundle)
    files = manifest["graphs"][0]["onnx"]["files"]
    if tamper == "artefact-symlink":
        (bundle / "graphs" / "g" / "g.onnx").unlink()
        (bundle / "graphs" / "g" / "g.onnx").symlink_to(outside / "g.onnx")
    elif tamper == "graphs-folder-symlink":
        shutil.rmtree(bundle / "graphs")
        (outside / "g").mkdir()
        shutil.copy(outside / "g.onnx", outside / "g" / "g.onnx")
        (bundle / "graphs").symlink_to(outside)
    elif tamper == "path-through-symlinked-folder":
        (bundle / "elsewhere").symlink_to(outside)
        files[0]["path"] = "elsewhere/g.onnx"
    elif tamper == "null-hash":
        (bundle / "graphs" / "g" / "g.onnx").write_bytes(b"other bytes")  # same size
        files[0]["sha256"] = None
    else:
        files[0]["path"] = "../outside/g.onnx"
    (bundle / "bundle.json").write_text(json.dumps(manifest))
    with pytest.raises(DeployError, match=refused):
        read_bundle(bundle)


def test_a_manifest_that_is_a_link_or_a_bomb_is_refused_in_one_line(bundle, tmp_path):
    from omskills.deploy.manifest import DeployError, read_bundle

    elsewhere = tmp_path / "elsewhere.json"
    shutil.move(bundle / "bundle.json", elsewhere)
    (bundle / "bundle.json").symlink_to(elsewhere)
    with pytest.raises(DeployError, match="bundle.json is a symbolic link: refused"):
        read_bundle(bundle)
    (bundle / "bundle.json").unlink()
    (bundle / "bundle.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(DeployError, match="nested deeper than a bundle's manifest ever is"):
        read_bundle(bundle)


def test_a_bundles_input_file_outside_it_is_never_read(bundle, tmp_path):
    from omskills.deploy.adapted import load_adapted

    secret = tmp_path / "outside" / "clip.gif"
    secret.parent.mkdir()
    secret.write_bytes(b"GIF89a not yours")
    manifest = _manifest(bundle)
    manifest["intake"]["inputs"] = {"video": str(secret), "prompt": "objects", "frames": 1}
    (bundle / "bundle.json").write_text(json.dumps(manifest))
    with pytest.raises(InputError, match=f"intake.inputs.video: {secret} is outside"):
        load_adapted(bundle, backend="onnxruntime")


# -- ONNX external data -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("location", "length", "refused"),
    [
        ("../../../../etc/passwd", "64", "names external data '../../../../etc/passwd': not a path inside the folder"),
        ("model.onnx.data", "-64", "external data length '-64' is not a byte count"),
    ],
)
def test_external_data_outside_the_models_folder_or_of_no_size_is_refused_not_measured(
    tmp_path, location, length, refused
):
    import numpy as np
    import onnx
    from omskills.onnxfiles.inspect import inspect_onnx
    from onnx import TensorProto, helper, numpy_helper

    (tmp_path / "model.onnx.data").write_bytes(bytes(64))
    weight = numpy_helper.from_array(np.ones((4, 4), np.float32), "w")
    weight.data_location = TensorProto.EXTERNAL
    weight.ClearField("raw_data")
    for key, value in (("location", location), ("offset", "0"), ("length", length)):
        weight.external_data.add(key=key, value=value)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])],
        [weight],
    )
    path = tmp_path / "model.onnx"
    onnx.save(helper.make_model(graph), str(path))
    with pytest.raises(InputError, match=refused):
        inspect_onnx(path)


# -- MCP errors keep their reason ----------------------------------------------------------------


def test_mcp_errors_of_prompts_and_tools_carry_their_reason(tmp_path):
    from mcp.shared.exceptions import MCPError
    from omskills.orchestrator.mcp_client import connect

    async def ask() -> tuple[str, str]:
        async with connect(tmp_path) as client:
            try:
                await client.session.get_prompt("adapt_task", {"task": "nowhere/task.yaml"})
                prompt = "no error"
            except MCPError as err:
                prompt = err.message
            outcome = await client.call("check_environment", {"task": "a\x00b.yaml"})
            return prompt, outcome.text

    prompt, tool = anyio.run(ask)
    assert prompt.startswith("argument 'task':") and "nowhere/task.yaml" in prompt
    assert "NUL byte" in tool


# -- artefacts changed behind the record's back ----------------------------------------------------


def test_same_size_corruption_with_the_time_restored_is_caught(tmp_path):
    from omskills.records.stages import Artifact

    path = tmp_path / "g.onnx"
    path.write_bytes(b"\x08\x07" + bytes(range(256)) * 100)
    recorded = Artifact.of(path, tmp_path)
    stat = path.stat()
    with path.open("r+b") as handle:
        handle.write(b"\x09")  # one byte of the header, same size
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert recorded.problem(tmp_path) == "g.onnx changed on disk (same size and time, other bytes)"


# -- what killed processes leave behind ------------------------------------------------------------


def test_a_step_left_running_by_a_gone_process_is_marked_interrupted_by_the_next_step(tmp_path):
    from omskills.records.stages import StageResult
    from omskills.records.task import load_record, save_record
    from omskills.stages.steps import running_step

    task = tmp_path / "task.yaml"
    task.write_text(yaml.safe_dump({"id": "t", "intake": {"model": {"family": "sam3"}}}))
    record = load_record(task)
    record.stages["study"] = StageResult(status="running", started="earlier", pid=_dead_pid())
    save_record(record, task)
    with running_step(task, "plan", "h"):
        pass
    study = load_record(task).stages["study"]
    assert study.status == "failed" and study.error.startswith("interrupted: the process that ran it (pid ")


def test_a_cancelled_or_interrupted_step_is_failed_with_why_never_left_running(tmp_path):
    from omskills.records.task import load_record
    from omskills.stages.steps import running_step

    task = tmp_path / "task.yaml"
    task.write_text(yaml.safe_dump({"id": "t", "intake": {"model": {"family": "sam3"}}}))
    with pytest.raises(KeyboardInterrupt):
        with running_step(task, "study", "h"):
            raise KeyboardInterrupt
    study = load_record(task).stages["study"]
    assert study.status == "failed" and study.error == (
        f"interrupted: by SIGINT (Ctrl-C); rerun `omskills tool profile_main_path --task {task}` "
        "(or `omskills adapt`) to redo it"
    )


def test_an_export_killed_midway_leaves_no_scratch_folder_after_the_next_export(tmp_path):
    from omskills.convert.export import _remove_dead_scratch

    out = tmp_path / "onnx" / "g" / "g.onnx"
    out.parent.mkdir(parents=True)
    dead = out.parent / f".g-export-{_dead_pid()}-abcd"
    alive = out.parent / f".g-export-{os.getpid()}-efgh"
    for folder in (dead, alive):
        folder.mkdir()
        (folder / "model.onnx").write_bytes(b"partial")
    _remove_dead_scratch(out)
    assert not dead.exists() and alive.exists()


# -- records ---------------------------------------------------------------------------------------


def test_a_record_with_a_byte_order_mark_reads_and_keeps_its_comments(tmp_path):
    from omskills.records.task import load_record, updating

    task = tmp_path / "task.yaml"
    task.write_text(
        "\ufeff# my model, tried on Tuesday\nid: t\nintake:\n  model:\n    family: sam3  # the flagship\n",
        encoding="utf-8",
    )
    assert load_record(task).id == "t"
    with updating(task) as record:
        record.decide("test", "a decision", "to make the record save")
    text = task.read_text(encoding="utf-8")
    assert "# my model, tried on Tuesday" in text and "# the flagship" in text


def test_a_full_disk_on_save_is_one_line_and_the_record_stays_as_it_was(tmp_path):
    task = tmp_path / "task.yaml"
    task.write_text(
        yaml.safe_dump(
            {
                "id": "t",
                "intake": {
                    "model": {"family": "sam3", "scale": "tiny"},
                    "inputs": {"video": "builtin:shapes", "prompt": "x", "frames": 1},
                },
            }
        )
    )
    before = task.read_bytes()
    full_disk = (
        "import errno, sys\n"
        "import omskills.files, omskills.records.task as task\n"
        "def full(path, text): raise OSError(errno.ENOSPC, 'No space left on device', str(path))\n"
        "task.atomic_write_text = full\n"
        "from omskills.orchestrator.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", full_disk, "tool", "check_environment", "--task", str(task)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and "No space left on device" in lines[0], done.stderr[-2000:]
    assert task.read_bytes() == before


# -- lock files are never opened through a link ------------------------------------------------


def test_a_lock_file_planted_as_a_symlink_is_refused_and_its_target_untouched(tmp_path):
    from omskills.host.job_store import ExclusiveLock, JobStore
    from omskills.orchestrator.run_lock import LOCK_NAME, claim_run_folder
    from omskills.records.task import TaskRecordError, load_record, save_record

    outside = tmp_path / "outside.txt"
    outside.write_text("precious")
    run = tmp_path / "run"
    (run / ".omskills" / "jobs").mkdir(parents=True)
    for lock in (run / LOCK_NAME, run / ".task.yaml.lock", run / ".omskills/jobs/.store.lock"):
        lock.symlink_to(outside)
    (run / ".omskills/jobs/exclusive.lock").symlink_to(outside)

    with pytest.raises(InputError, match="is a symbolic link: refused"):
        claim_run_folder(run)
    record = load_record(REPO / "task_records" / "sam3-video-text.yaml")
    with pytest.raises(TaskRecordError, match="lock file .* is a symbolic link: refused"):
        save_record(record, run / "task.yaml")
    with pytest.raises(InputError, match="is a symbolic link: refused"):
        JobStore(run).update("job-20261205-000000-abcdef", lambda job: None)
    with pytest.raises(InputError, match="is a symbolic link: refused"):
        ExclusiveLock(run / ".omskills/jobs").acquire("j", "t", lambda: False, lambda _: None)
    assert outside.read_text() == "precious" and not (run / "task.yaml").exists()


# -- processes are identified, not guessed --------------------------------------------------------


def test_a_planted_job_file_never_has_an_unrelated_process_signalled_nor_an_outside_record_touched(tmp_path):
    """Through the MCP tools a client calls (`cancel_job`, `job_status`, `list_jobs`)."""
    from omskills.host.job_store import JobStore, StoredJob
    from omskills.orchestrator.mcp_client import connect

    workspace = tmp_path / "ws"
    workspace.mkdir()
    store = JobStore(workspace)
    # An unrelated process whose command line says "job_runner" (and names this workspace).
    bystander = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(120)", "-m", "omskills.host.job_runner", str(workspace)]
    )
    outside = tmp_path / "outside" / "task.yaml"
    outside.parent.mkdir()
    outside.write_text("id: theirs\n")
    planted = StoredJob(
        job_id="job-20261205-000000-abcdef", tool="export_onnx", arguments={}, skills_dir="x", ready=True
    )
    store.write(planted.model_copy(update={"pid": bystander.pid, "runner_token": "guessed"}))
    store.write(planted.model_copy(update={"job_id": "job-20261205-000001-abcdef", "task": str(outside)}))
    seen: dict[str, object] = {}

    async def client() -> None:
        async with connect(workspace) as mcp:
            seen["cancel"] = await mcp.call("cancel_job", {"job_id": planted.job_id, "wait_seconds": 0})
            seen["listed"] = await mcp.call("list_jobs", {})
            seen["outside"] = await mcp.call("job_status", {"job_id": "job-20261205-000001-abcdef"})

    try:
        anyio.run(client)
        assert bystander.poll() is None  # never signalled
    finally:
        bystander.kill()
        bystander.wait()
    assert not seen["cancel"].is_error and seen["cancel"].structured["state"] == "failed", seen["cancel"].text
    assert [j["job_id"] for j in seen["listed"].structured["jobs"]] == [planted.job_id]
    assert seen["outside"].is_error and "names a task record outside the workspace" in seen["outside"].text
    assert outside.read_text() == "id: theirs\n" and [p.name for p in outside.parent.iterdir()] == ["task.yaml"]


def test_a_read_only_record_is_never_rewritten(tmp_path):
    record = tmp_path / "task.yaml"
    shutil.copy(REPO / "task_records" / "sam3-video-text.yaml", record)
    record.chmod(0o444)
    before = record.read_bytes()
    done = subprocess.run(
        [sys.executable, "-c", CLI, "tool", "check_environment", "--args", json.dumps({"task": str(record)})],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert done.returncode == 2 and "is read-only: not saved" in done.stderr
    assert record.read_bytes() == before and stat.S_IMODE(record.stat().st_mode) == 0o444


def test_bundle_never_copies_in_a_checkpoint_the_record_names_outside(tiny_adaptation, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(tiny_adaptation, run, symlinks=True)
    secret = tmp_path / "outside" / "secret.pt"
    secret.parent.mkdir()
    secret.write_bytes(b"not yours")
    record = yaml.safe_load((run / "task.yaml").read_text())
    record["intake"]["model"]["checkpoint"] = str(secret)
    (run / "task.yaml").write_text(yaml.safe_dump(record, sort_keys=False))
    done = subprocess.run(
        [sys.executable, "-c", CLI, "bundle", str(run / "task.yaml"), "--out", str(tmp_path / "b")],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2 and "intake.model.checkpoint" in done.stderr and "outside" in done.stderr
    assert not (tmp_path / "b").exists()


def test_adapt_on_a_run_folder_whose_lock_is_a_planted_symlink_stops_in_one_line(tmp_path):
    outside = tmp_path / "outside.txt"
    outside.write_text("precious")
    digest = hashlib.sha256(outside.read_bytes()).hexdigest()
    run = tmp_path / "run"
    run.mkdir()
    (run / ".omskills-adapt.lock").symlink_to(outside)
    record = REPO / "task_records" / "sam3-video-text.yaml"
    done = subprocess.run(
        [sys.executable, "-c", CLI, "adapt", str(record), "--scale", "tiny", "--out", str(run)],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [
        f"omskills: error: {run / '.omskills-adapt.lock'} is a symbolic link: refused, a lock file is never opened "
        "through one"
    ]
    assert hashlib.sha256(outside.read_bytes()).hexdigest() == digest and sorted(os.listdir(run)) == [
        ".omskills-adapt.lock"
    ]


def test_bundle_out_leaves_a_users_folder_named_like_a_dead_writers_staging_folder(tiny_adaptation, tmp_path):
    users = tmp_path / f".X.writing-{_dead_pid()}"
    users.mkdir()
    (users / "thesis.tex").write_text("years of work")
    done = subprocess.run(
        [sys.executable, "-c", CLI, "bundle", str(tiny_adaptation / "task.yaml"), "--out", str(tmp_path / "X")],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert (users / "thesis.tex").read_text() == "years of work" and (tmp_path / "X" / "bundle.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([users.name, "X"])  # no staging folder left
