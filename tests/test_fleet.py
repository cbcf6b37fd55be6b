"""`omskills fleet`: many adaptations as Ray tasks on a real two-node Ray cluster (loopback), and
on a local Ray instance of its own (first in the file, and Ctrl-C).

The cluster is `ray start --head` plus one worker node, each offering 5 GB of Ray's memory
resource and two CPUs: the first run's adaptations ask for 3 GB, so memory, not CPUs, keeps each
node to one at a time. Four toy adaptations run through it, one of them made to fail, then again.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest
import yaml
from omskills.orchestrator.fleet_memory import ESTIMATE_MARGIN, GB
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
STEPS_KEPT_ON_RESUME = ("study", "plan", "boundaries", "export:", "probe:", "optimize:", "precision:", "verify")


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


def finished_steps(record: dict) -> dict[str, str]:
    """The steps done, each with when it started: a step redone starts again."""
    stages = record["stages"]
    return {k: v["started"] for k, v in stages.items() if v["status"] == "done" and k.startswith(STEPS_KEPT_ON_RESUME)}


def run_record(out: Path, name: str) -> dict:
    return yaml.safe_load((out / name / "task.yaml").read_text())


def results_by_name(out: Path) -> dict[str, dict]:
    return {r["adaptation"]["name"]: r for r in json.loads((out / "fleet.json").read_text())["results"]}


def wait_for(what, timeout: float, every: float = 0.5):
    """`what()` once it is true, polled; fails the test after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not (found := what()):
        assert time.monotonic() < deadline, f"not within {timeout:.0f} s"
        time.sleep(every)
    return found


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


def test_ctrl_c_ends_the_adaptations_shuts_ray_down_and_reports_what_finished_and_what_did_not(records, tmp_path):
    out, stderr = tmp_path / "out", tmp_path / "stderr.txt"
    two = [str(records[0]), str(records[1])]
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    with stderr.open("w") as sink:
        # A session of its own: SIGINT goes to its whole process group, as a terminal's Ctrl-C does.
        command = [*CLI, "fleet", *two, "--cpus", "1", "--memory-gb", "2", "--out", str(out)]
        proc = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=sink, text=True, env=env, start_new_session=True
        )
        try:
            wait_for(lambda: "toy-a: attempt 1 running" in stderr.read_text(), timeout=300)
            # Interrupted mid-adaptation, once its first step is done.
            wait_for(lambda: "environment gate: ok" in read_if_there(out / "toy-a" / "fleet" / "attempt-1.log"), 300)
            tree = psutil.Process(proc.pid).children(recursive=True)  # Ray's processes, the adaptation's
            assert any(" adapt " in command_line(p) for p in tree)
            os.killpg(proc.pid, signal.SIGINT)
            proc.communicate(timeout=180)
        finally:
            proc.kill()
    assert proc.returncode == 130, stderr.read_text()[-3000:]
    assert "[fleet] interrupted: cancelling 2 task(s)" in stderr.read_text()  # one running, one waiting
    report = json.loads((out / "fleet.json").read_text())
    assert report["interrupted"] is True
    ran, waited = report["results"]
    [attempt] = ran["attempts"]
    assert re.fullmatch(r"interrupted \(SIGINT at \S+\) in attempt 1, after step '[^']+'", ran["interrupted"])
    assert attempt["row"]["failure"].startswith("interrupted: the fleet was stopped (SIGINT at ")
    assert attempt["log"] == "fleet/attempt-1.log" and ran["logs"] == [attempt["log"]]
    assert waited["interrupted"].endswith(") before it started") and waited["attempts"] == []
    table = (out / "fleet.md").read_text()
    assert "0 of 2 pass" in table and "Interrupted: 2 did not finish." in table and ran["interrupted"] in table
    # Nothing the fleet started is left: the adaptation's processes ended, Ray shut down.
    _, alive = psutil.wait_procs(tree, timeout=30)
    assert not alive, [command_line(p)[:200] for p in alive]


def read_if_there(path: Path) -> str:
    return path.read_text(errors="replace") if path.is_file() else ""


def command_line(proc: psutil.Process) -> str:
    try:
        return " ".join(proc.cmdline())
    except psutil.Error:  # it ended meanwhile
        return ""


@pytest.fixture(scope="module")
def first_run(cluster, records, tmp_path_factory):
    """The four records through the cluster, asking 3 GB each: each attempt's log as it was written."""
    out = tmp_path_factory.mktemp("fleet")
    address, env = cluster
    result = fleet(*map(str, records), "--address", address, "--memory-gb", "3", "--out", str(out), env=env)
    results = results_by_name(out)
    logs = {name: {a["log"]: (out / name / a["log"]).read_text() for a in r["attempts"]} for name, r in results.items()}
    return out, result, results, logs


def test_three_adaptations_pass_and_the_broken_one_fails_with_its_reason_after_one_retry_elsewhere(first_run):
    out, result, results, _ = first_run
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
    _, _, results, _ = first_run
    attempts = [a for r in results.values() for a in r["attempts"]]
    assert {a["node_id"] for a in attempts} and len({a["node_id"] for a in attempts}) == 2
    for node in {a["node_id"] for a in attempts}:
        spans = sorted((a["started"], a["ended"]) for a in attempts if a["node_id"] == node)
        assert all(later[0] >= earlier[1] for earlier, later in zip(spans, spans[1:])), spans
    assert all(r["adaptation"]["memory_from"] == "--memory-gb" for r in results.values())


def test_progress_says_each_state_change_with_a_live_count(first_run):
    _, result, _, _ = first_run
    lines = [line for line in result.stderr.splitlines() if line.startswith("[fleet] ")]
    assert any(re.search(r"toy-a: attempt 1 running on \S+ \([0-9a-f]{8}\) \|", line) for line in lines)
    assert any(re.search(r"toy-broken: failed on \S+ \([0-9a-f]{8}\): .* trying again \|", line) for line in lines)
    assert lines[-1].endswith("| 0 running, 3 passed, 1 failed, 0 waiting")


@pytest.fixture(scope="module")
def rerun(first_run, cluster, records):
    """The same fleet again over the first run's folders: the records as the first run left them."""
    out = first_run[0]
    before = {name: run_record(out, name) for name in ("toy-a", "toy-b", "toy-c")}
    address, env = cluster
    result = fleet(*map(str, records), "--address", address, "--out", str(out), env=env)
    return out, before, result, results_by_name(out)


def test_a_rerun_resumes_every_run_folder_without_redoing_finished_steps(rerun):
    out, before, again, report = rerun
    assert again.returncode == 1, again.stderr[-3000:]
    for name in ("toy-a", "toy-b", "toy-c"):
        after = run_record(out, name)
        assert finished_steps(before[name]) and finished_steps(after) == finished_steps(before[name])
        # The same machine state: the gate checked the record again and reused its probe of the machine.
        assert after["environment"]["probed_at"] == before[name]["environment"]["probed_at"]
        assert report[name]["attempts"][-1]["row"]["verdict"] == "pass"
        # The second run asks for what the first measured, not the scale's default.
        assert report[name]["adaptation"]["memory_from"].startswith("measured peak")


def test_a_rerun_numbers_its_attempts_after_the_earlier_ones_and_keeps_every_log(first_run, rerun):
    _, _, earlier, logs_before = first_run
    out, _, _, report = rerun
    for name in ("toy-a", "toy-broken"):
        first = [a["number"] for a in earlier[name]["attempts"]]
        again = [a["number"] for a in report[name]["attempts"]]
        assert first == list(range(1, len(first) + 1)) and again == [len(first) + n for n in first]
        assert report[name]["logs"] == [f"fleet/attempt-{n}.log" for n in first + again]
        assert [a["log"] for a in report[name]["attempts"]] == report[name]["logs"][len(first) :]
        for log, text in logs_before[name].items():
            assert (out / name / log).read_text() == text, f"{name}: {log} was overwritten"
        assert all((out / name / log).stat().st_size for log in report[name]["logs"])


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


@pytest.fixture(scope="module")
def soc_fan_out(cluster, records, tmp_path_factory):
    """toy-a for two SoCs, without --memory-gb: nothing measured yet, so its driver is asked."""
    out = tmp_path_factory.mktemp("socs")
    address, env = cluster
    socs = ("--soc", "Ascend910B4", "Ascend310P3")
    return out, fleet(str(records[0]), *socs, "--address", address, "--out", str(out), env=env)


def test_soc_fan_out_shares_the_first_socs_study_and_redoes_only_what_the_soc_changes(soc_fan_out):
    tmp_path, result = soc_fan_out
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
    # The second SoC's run folder started as a copy of the first's, but its attempts are its own.
    assert results_by_name(tmp_path)["toy-a-Ascend310P3"]["logs"] == ["fleet/attempt-1.log"]


def test_a_task_nothing_measured_asks_for_its_models_estimate_and_one_measured_for_its_peak(soc_fan_out):
    out, result = soc_fan_out
    report = results_by_name(out)
    first, second = report["toy-a-Ascend910B4"], report["toy-a-Ascend310P3"]
    asked, estimate = first["adaptation"]["memory_gb"], first["adaptation"]["memory_estimate"]
    assert asked == round(estimate["need_bytes"] * ESTIMATE_MARGIN / GB, 2)
    assert first["adaptation"]["memory_from"].startswith("the toy-mlp model measured: ")
    assert f"toy-a-Ascend910B4: attempt 1 asks {asked:.1f} GB (the toy-mlp model measured: " in result.stderr
    # What the adaptation then took fit in what it asked for.
    [attempt] = first["attempts"]
    assert 0 < attempt["row"]["peak_tree_gb"] <= asked
    # The second SoC starts from the first one's run folder: it asks for what that run measured.
    peak = json.loads((out / "toy-a-Ascend910B4" / "fleet" / "peak-1.json").read_text())["peak_tree_gb"]
    assert second["adaptation"]["memory_from"] == f"measured peak {peak:.2f} GB of a previous run"
    assert second["adaptation"]["memory_estimate"] is None


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
