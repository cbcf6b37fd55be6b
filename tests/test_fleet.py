"""`omskills fleet`: many adaptations as Ray tasks on a real two-node Ray cluster (loopback).

The cluster is `ray start --head` plus one worker node, each offering 5 GB of Ray's memory
resource and two CPUs: an adaptation asks for 3 GB, so memory, not CPUs, keeps each node to one
at a time. Four toy adaptations run through it, one of them made to fail.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import psutil
import pytest
import yaml
from test_drivers import TOY_DRIVER

pytest.importorskip("ray", reason="Ray is the optional [fleet] extra")

CLI = [sys.executable, "-c", "import sys; from omskills.orchestrator.cli import main; sys.exit(main())"]
RAY = Path(sys.executable).with_name("ray")
NODE_MEMORY = 5_000_000_000
BROKEN = """

class BrokenDriver(ToyDriver):
    family = "toy-broken"

    def load(self, spec):
        from omskills.errors import InputError

        raise InputError("checkpoint: /nonexistent/toy.pt does not exist")


class HugeDriver(ToyDriver):
    family = "toy-huge"
    adaptation_memory_gb = {"tiny": 900.0}
"""
STEPS_KEPT_ON_RESUME = ("study", "plan", "boundaries", "export:", "probe:", "optimize:", "precision:")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def ray_env(temp: Path) -> dict[str, str]:
    """Token authentication with this cluster's own token: nothing read from or written to ~/.ray."""
    return {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN_PATH": str(temp / "token")}  # fmt: skip


def ray_start(*args: str, temp: Path) -> None:
    started = subprocess.run(
        [str(RAY), "start", "--node-ip-address=127.0.0.1", "--num-cpus=2", f"--memory={NODE_MEMORY}",
         "--object-store-memory=100000000", *args],
        capture_output=True, text=True, env=ray_env(temp), timeout=180,
    )  # fmt: skip
    assert started.returncode == 0, started.stdout[-2000:] + started.stderr[-2000:]


@pytest.fixture(scope="module")
def cluster():
    """A head and a worker node on loopback; only this cluster's processes are stopped after."""
    # Ray's unix sockets live under its temp folder: the path must stay short (108 bytes at most).
    temp = Path(tempfile.mkdtemp(prefix="omsray", dir="/tmp"))
    (temp / "token").write_text(secrets.token_hex(32))
    address = f"127.0.0.1:{free_port()}"
    try:
        ray_start("--head", f"--port={address.split(':')[1]}", "--include-dashboard=false", "--disable-usage-stats",
                  f"--temp-dir={temp}", temp=temp)  # fmt: skip
        ray_start(f"--address={address}", temp=temp)
        yield address, ray_env(temp)
    finally:
        stop_processes_naming(temp)
        shutil.rmtree(temp, ignore_errors=True)


def stop_processes_naming(temp: Path) -> None:
    """The cluster's processes (each names its session folder under `temp`) and their children."""
    ours = {p for p in psutil.process_iter(["cmdline"]) if str(temp) in " ".join(p.info["cmdline"] or [])}
    for proc in list(ours):
        try:
            ours.update(proc.children(recursive=True))
        except psutil.Error:
            pass
    for proc in ours:
        try:
            proc.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(ours, timeout=15)
    for proc in alive:
        proc.kill()


@pytest.fixture(scope="module")
def records(tmp_path_factory) -> list[Path]:
    folder = tmp_path_factory.mktemp("records")
    (folder / "toy.py").write_text(TOY_DRIVER + BROKEN)
    made = []
    for name, driver in (
        ("toy-a", "ToyDriver"),
        ("toy-b", "ToyDriver"),
        ("toy-c", "ToyDriver"),
        ("toy-broken", "BrokenDriver"),
    ):
        path = folder / f"{name}.yaml"
        model = {"driver": f"toy.py:{driver}", "scale": "tiny"}
        path.write_text(yaml.safe_dump({"id": name, "intake": {"model": model, "inputs": {"batch": 64, "steps": 2}}}))
        made.append(path)
    return made


def fleet(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, "fleet", *args], capture_output=True, text=True, timeout=1200, env=env)


def finished_steps(run: Path) -> dict[str, str]:
    """The steps done, each with when it started: a step redone starts again."""
    stages = yaml.safe_load((run / "task.yaml").read_text())["stages"]
    return {k: v["started"] for k, v in stages.items() if v["status"] == "done" and k.startswith(STEPS_KEPT_ON_RESUME)}


def test_without_an_address_a_local_ray_instance_runs_one_task_per_cpu_with_a_token_of_its_own(records, tmp_path):
    # First in the file: the module's cluster is not up yet, so this instance is the only one.
    home = tmp_path / "home"
    home.mkdir()
    env = {**os.environ, "HOME": str(home), "RAY_USAGE_STATS_ENABLED": "0"}
    two = [str(records[0]), str(records[1])]
    result = fleet(*two, "--cpus", "1", "--memory-gb", "2", "--out", str(tmp_path / "out"), env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((tmp_path / "out" / "fleet.json").read_text())
    assert report["address"] == "local" and report["nodes"] == 1
    assert all(r["adaptation"]["memory_from"] == "--memory-gb" for r in report["results"])
    assert all(r["attempts"][0]["row"]["verdict"] == "pass" for r in report["results"])
    first, second = sorted((r["attempts"][0]["started"], r["attempts"][0]["ended"]) for r in report["results"])
    assert second[0] >= first[1], "two tasks ran at once on one CPU"
    assert not (home / ".ray").exists(), "Ray wrote its token into the user's home"


@pytest.fixture(scope="module")
def first_run(cluster, records, tmp_path_factory):
    out = tmp_path_factory.mktemp("fleet")
    address, env = cluster
    result = fleet(*map(str, records), "--address", address, "--out", str(out), env=env)
    report = json.loads((out / "fleet.json").read_text())
    return out, result, {r["adaptation"]["name"]: r for r in report["results"]}


def test_three_adaptations_pass_and_the_broken_one_fails_with_its_reason_after_one_retry_elsewhere(first_run):
    out, result, results = first_run
    assert result.returncode == 1, result.stderr[-3000:]
    for name in ("toy-a", "toy-b", "toy-c"):
        [attempt] = results[name]["attempts"]
        assert attempt["row"]["verdict"] == "pass" and attempt["row"]["failure"] is None, attempt
    broken = results["toy-broken"]["attempts"]
    assert [a["number"] for a in broken] == [1, 2]
    assert broken[0]["node_id"] != broken[1]["node_id"], "the retry ran on the node that failed"
    assert all("checkpoint: /nonexistent/toy.pt does not exist" in a["row"]["failure"] for a in broken)
    table = (out / "fleet.md").read_text()
    assert "3 of 4 pass" in table and "checkpoint: /nonexistent/toy.pt does not exist" in table


def test_memory_not_cpus_keeps_each_node_to_one_adaptation_at_a_time(first_run):
    _, _, results = first_run
    attempts = [a for r in results.values() for a in r["attempts"]]
    assert {a["node_id"] for a in attempts} and len({a["node_id"] for a in attempts}) == 2
    for node in {a["node_id"] for a in attempts}:
        spans = sorted((a["started"], a["ended"]) for a in attempts if a["node_id"] == node)
        assert all(later[0] >= earlier[1] for earlier, later in zip(spans, spans[1:])), spans
    assert all(r["adaptation"]["memory_from"] == "default for scale tiny" for r in results.values())


def test_progress_says_each_state_change_with_a_live_count(first_run):
    _, result, _ = first_run
    lines = [line for line in result.stderr.splitlines() if line.startswith("[fleet] ")]
    assert any(re.search(r"toy-a: attempt 1 running on \S+ \([0-9a-f]{8}\) \|", line) for line in lines)
    assert any(re.search(r"toy-broken: failed on \S+ \([0-9a-f]{8}\): .* trying again \|", line) for line in lines)
    assert lines[-1].endswith("| 0 running, 3 passed, 1 failed, 0 waiting")


def test_a_rerun_resumes_every_run_folder_without_redoing_finished_steps(first_run, cluster, records):
    out, _, results = first_run
    before = {name: finished_steps(out / name) for name in ("toy-a", "toy-b", "toy-c")}
    assert all(before.values())
    address, env = cluster
    again = fleet(*map(str, records), "--address", address, "--out", str(out), env=env)
    assert again.returncode == 1, again.stderr[-3000:]
    report = {r["adaptation"]["name"]: r for r in json.loads((out / "fleet.json").read_text())["results"]}
    for name in ("toy-a", "toy-b", "toy-c"):
        assert finished_steps(out / name) == before[name]
        assert report[name]["attempts"][-1]["row"]["verdict"] == "pass"
        # The second run asks for what the first measured, not the scale's default.
        assert report[name]["adaptation"]["memory_from"].startswith("measured peak")


def test_an_adaptation_no_node_can_hold_fails_at_once_naming_the_memory(cluster, records, tmp_path):
    huge = records[0].with_name("toy-huge.yaml")
    record = yaml.safe_load(records[0].read_text())
    record["id"], record["intake"]["model"]["driver"] = "toy-huge", "toy.py:HugeDriver"
    huge.write_text(yaml.safe_dump(record))
    address, env = cluster
    result = fleet(str(huge), "--address", address, "--out", str(tmp_path), env=env)
    assert result.returncode == 1
    [entry] = json.loads((tmp_path / "fleet.json").read_text())["results"]
    [attempt] = entry["attempts"]
    assert attempt["row"]["failure"] == (
        "memory: needs 900.0 GB (the toy-huge driver's estimate for scale tiny); the largest node offers 5.0 GB"
    )
    assert not (tmp_path / "toy-huge").exists()


def test_without_ray_fleet_says_how_to_install_it_in_one_line(records):
    blocked = "import sys; sys.modules['ray'] = None; from omskills.orchestrator.cli import main; sys.exit(main())"
    result = subprocess.run([sys.executable, "-c", blocked, "fleet", str(records[0])], capture_output=True, text=True)
    assert result.returncode == 2
    assert (
        result.stderr.strip()
        == "omskills: error: omskills fleet needs Ray, an optional extra: pip install -e '.[fleet]'"
    )


def test_soc_fan_out_shares_the_first_socs_study_and_redoes_only_what_the_soc_changes(cluster, records, tmp_path):
    address, env = cluster
    result = fleet(
        str(records[0]), "--soc", "Ascend910B4", "Ascend310P3", "--address", address, "--out", str(tmp_path), env=env
    )
    assert result.returncode == 0, result.stderr[-3000:]
    first, second = (
        yaml.safe_load((tmp_path / f"toy-a-{soc}" / "task.yaml").read_text()) for soc in ("Ascend910B4", "Ascend310P3")
    )
    assert (first["intake"]["target"]["soc"], second["intake"]["target"]["soc"]) == ("Ascend910B4", "Ascend310P3")
    for step in ("study", "plan", *(k for k in first["stages"] if k.startswith(("export:", "probe:")))):
        assert second["stages"][step]["started"] == first["stages"][step]["started"], step
    graphs = [k.removeprefix("atc:") for k in second["stages"] if k.startswith("atc:")]
    assert graphs and all(second["toolchain"][g]["precheck"]["soc"] == "Ascend310P3" for g in graphs)
    scripts = list((tmp_path / "toy-a-Ascend310P3" / "om").rglob("convert_*.sh"))
    assert scripts and all("--soc_version=Ascend310P3" in s.read_text() for s in scripts)


def test_a_soc_is_checked_before_it_names_a_run_folder(records, tmp_path):
    result = fleet(str(records[0]), "--soc", "../../etc", "--out", str(tmp_path / "out"))
    assert result.returncode == 2
    assert result.stderr.startswith("omskills: error: --soc: unknown SoC '../../etc'")
    assert not (tmp_path / "out").exists() and not (tmp_path / "etc").exists()


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (("--cpus", "0"), "--cpus: 0: a fleet runs one task per CPU"),
        (("--cpus", "-2"), "--cpus: -2"),
        (("--memory-gb", "nan"), "--memory-gb: nan is not a positive number"),
        (("--memory-gb", "inf"), "--memory-gb: inf is not a positive number"),
        (("--address", "127.0.0.1:1"), "--address: nothing answers at 127.0.0.1:1 within 10 s"),
        (("--address", "no-port"), "--address: 'no-port' is not host:port"),
    ],
)
def test_fleet_arguments_are_checked_in_one_line_before_anything_runs(records, tmp_path, args, said):
    result = fleet(str(records[0]), *args, "--out", str(tmp_path / "out"))
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and said in lines[0], result.stderr
    assert not (tmp_path / "out" / "toy-a").exists()


def test_a_record_id_the_fleets_own_files_use_is_refused(tmp_path, records):
    record = tmp_path / "clash.yaml"
    record.write_text(records[0].read_text().replace("id: toy-a", "id: fleet.json"))
    (tmp_path / "toy.py").write_text((records[0].parent / "toy.py").read_text())
    result = fleet(str(record), "--out", str(tmp_path / "out"))
    assert result.returncode == 2 and "record id(s) ['fleet.json']: the fleet's own files" in result.stderr
