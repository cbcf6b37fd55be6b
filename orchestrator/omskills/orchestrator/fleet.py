"""Many adaptations at once: each the same resumable `omskills adapt`, in its own run folder, as a
Ray task on a local Ray instance or on a cluster the user already has (`--address`).

- Each task asks Ray for the memory its adaptation needs (`memory_request`), so Ray never packs
  two that do not fit on one node; a task that fits no node fails at once, saying so.
- A failed task is tried once more, on another node where there is one; its reason is kept.
- Run folders live under one folder every worker reaches (a shared file system on a cluster);
  a rerun with the same folder resumes each run (`adapt` skips the steps already done).
- `--soc A B`: the first SoC's adaptation runs whole; each other SoC starts from a copy of that
  run folder, so the study, exports and probes are shared and only the SoC's steps run again.

Ray is an optional extra: `pip install -e '.[fleet]'`.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Literal

from omskills.errors import InputError
from pydantic import BaseModel, Field

from .run_rows import HEADERS, AdaptationRow, cells, row_of_run

RAY_MISSING = "omskills fleet needs Ray, an optional extra: pip install -e '.[fleet]'"
CLI = "import sys; from omskills.orchestrator.cli import main; sys.exit(main())"
GB = 1e9
# Without a measurement: what an adaptation of each scale may take (a tiny zoo model peaked at
# 1.5-2.6 GB of process tree; a full-scale one at about 10 GB).
SCALE_MEMORY_GB = {"tiny": 3.0, "full": 12.0}
MEASURED_MARGIN = 1.25  # over a previous run's measured peak: inputs and load differ between runs
# The study's peak is one process's; the adaptation runs the model again beside ONNX Runtime in its
# tools' processes (export, probe, verify): twice that, as a rule of thumb.
STUDY_FACTOR = 2.0
ATTEMPTS = 2  # a failed task is tried once more
FLEET_FOLDER = "fleet"  # inside a run folder: each attempt's log and measured peak
FLEET_JSON, FLEET_MD = "fleet.json", "fleet.md"  # the report, beside the run folders
FLEET_OWN_NAMES = frozenset({FLEET_JSON, FLEET_MD})  # no record id (a run folder's name) may take them
# How long `--address` may stay silent before the fleet says nothing answers there (Ray retries forever).
ADDRESS_TIMEOUT_S = 10.0


class FleetAdaptation(BaseModel):
    name: str = Field(description="The run folder's name: the record's id, '-<soc>' when fanned out over SoCs.")
    record: Path = Field(description="The task record (absolute).")
    run: Path = Field(description="The run folder (absolute, where every worker reaches it).")
    scale: str | None = Field(None, description="--scale given to adapt.")
    soc: str | None = Field(None, description="--soc given to adapt.")
    seed_from: Path | None = Field(None, description="A run folder this one starts as a copy of (the first SoC's).")
    memory_gb: float = Field(description="The memory the task asks Ray for, GB.")
    memory_from: str = Field(description="Where that figure comes from.")


class Attempt(BaseModel):
    number: int
    node_id: str = Field(description="The Ray node that ran it ('' when the task never started).")
    node_ip: str = Field("", description="The node's address, as Ray reports it.")
    started: float = Field(0.0, description="When it started on its node (seconds since the epoch).")
    ended: float = Field(0.0, description="When it ended (seconds since the epoch).")
    log: str = Field("", description="The attempt's console output, relative to the run folder.")
    row: AdaptationRow


class FleetResult(BaseModel):
    adaptation: FleetAdaptation
    attempts: list[Attempt] = Field(default_factory=list)

    @property
    def passed(self) -> bool:
        return bool(self.attempts) and self.attempts[-1].row.passed


class FleetReport(BaseModel):
    address: str = Field(description="The Ray cluster ('local': an instance started for this run).")
    nodes: int
    started: str
    wall_s: float
    results: list[FleetResult]

    def markdown(self, title: str) -> str:
        head = ["run", *HEADERS[:-1], "attempts (node)", HEADERS[-1]]
        lines = [f"### {title}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for result in self.results:
            row = result.attempts[-1].row if result.attempts else None
            shown = cells(row) if row else ["not run"] + ["-"] * (len(HEADERS) - 1)
            tried = ", ".join(f"{a.number} ({a.node_ip or '-'} {a.node_id[:8]})" for a in result.attempts) or "-"
            lines.append("| " + " | ".join([result.adaptation.name, *shown[:-1], tried, shown[-1]]) + " |")
        passed = sum(r.passed for r in self.results)
        lines += ["", f"{passed} of {len(self.results)} pass; wall {self.wall_s:.0f} s on {self.nodes} node(s)."]
        return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- adaptations


def memory_request(record: Path, run: Path, scale: str | None, unmeasured_gb: float | None = None) -> tuple[float, str]:
    """GB to ask for, and why: a previous run's measured peak, else the study's, else
    `unmeasured_gb` (the user's figure), else the driver's estimate, else the scale's."""
    measured = [json.loads(p.read_text())["peak_tree_gb"] for p in sorted((run / FLEET_FOLDER).glob("peak-*.json"))]
    measured = [m for m in measured if m]
    if measured:
        return round(max(measured) * MEASURED_MARGIN, 2), f"measured peak {max(measured):.2f} GB of a previous run"
    study = _study_peak_gb(run)
    if study:
        return round(study * STUDY_FACTOR, 2), f"twice the study's measured peak ({study:.2f} GB)"
    if unmeasured_gb:
        return unmeasured_gb, "--memory-gb"
    from omskills.models.registry import driver_for
    from omskills.records.task import load_record

    spec = load_record(record).intake.model
    chosen = scale or spec.scale
    driver = driver_for(spec, record.parent)
    estimate = driver.adaptation_memory_gb.get(chosen)
    if estimate:
        return estimate, f"the {driver.family} driver's estimate for scale {chosen}"
    return SCALE_MEMORY_GB[chosen], f"default for scale {chosen}"


def _study_peak_gb(run: Path) -> float | None:
    task = run / "task.yaml"
    if not task.is_file():
        return None
    from omskills.records.main_path import MainPathReport
    from omskills.records.task import load_record

    study = load_record(task).study
    report = run / study.main_path_json if study else None
    if report is None or not report.is_file():
        return None
    return MainPathReport.model_validate_json(report.read_text()).peak_rss_mb / 1024


def plan_adaptations(
    records: Sequence[Path],
    out: Path,
    scale: str | None,
    socs: Sequence[str],
    unmeasured_gb: float | None = None,
) -> list[FleetAdaptation]:
    """One adaptation per record, or per record and SoC; run folders `out/<id>[-<soc>]`."""
    from omskills.ascend.atc import check_soc
    from omskills.records.task import load_record

    for soc in socs:  # a SoC names a run folder: only those ATC knows
        check_soc(soc, "--soc")
    adaptations: list[FleetAdaptation] = []
    for record in records:
        record = record.resolve()
        if not record.is_file():
            raise InputError(f"task record not found: {record}")
        ident = load_record(record).id
        leader: Path | None = None
        for soc in socs or [None]:
            name = f"{ident}-{soc}" if soc else ident
            run = (out / name).resolve()
            memory, why = memory_request(record, leader or run, scale, unmeasured_gb)
            adaptations.append(
                FleetAdaptation(
                    name=name,
                    record=record,
                    run=run,
                    scale=scale,
                    soc=soc,
                    seed_from=leader,
                    memory_gb=memory,
                    memory_from=why,
                )
            )
            leader = leader or run
    names = [adaptation.name for adaptation in adaptations]
    taken = sorted(set(names) & FLEET_OWN_NAMES)
    if taken:
        raise InputError(f"record id(s) {taken}: the fleet's own files in {out} use these names; rename the record(s)")
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise InputError(f"two records share the id(s) {twice}: each run folder is named after its record's id")
    return adaptations


def zoo_records(names: Sequence[str], zoo_index: Path) -> list[Path]:
    """The zoo's task records (all, or those named), from the checkout's index."""
    import yaml

    if not zoo_index.is_file():
        raise InputError(f"--zoo: no zoo index at {zoo_index} (the zoo ships with the checkout)")
    known = [entry["name"] for entry in yaml.safe_load(zoo_index.read_text())["models"]]
    unknown = sorted(set(names) - set(known))
    if unknown:
        raise InputError(f"--zoo: no zoo model named {', '.join(unknown)}; known: {', '.join(known)}")
    return [zoo_index.parent / f"{name}.yaml" for name in known if not names or name in names]


# --------------------------------------------------------------------------- one attempt (on a worker)


def adapt_attempt(adaptation: FleetAdaptation, number: int, starts) -> Attempt:
    """The Ray task: tells the `StartLog` actor it started on this node, then runs the adaptation."""
    import ray

    node_id = ray.get_runtime_context().get_node_id()
    # Not waited for: a task blocked in ray.get gives its CPU back and Ray starts another beside it.
    starts.started.remote(adaptation.name, number, node_id)
    return run_adaptation(adaptation, number, node_id)


def run_adaptation(adaptation: FleetAdaptation, number: int, node_id: str = "local") -> Attempt:
    """`omskills adapt` on the adaptation's record in its run folder, the process tree's memory sampled.
    Its console output goes to `<run>/fleet/attempt-<n>.log`."""
    if adaptation.seed_from is not None and not (adaptation.run / "task.yaml").exists():
        shutil.copytree(adaptation.seed_from, adaptation.run, symlinks=True, dirs_exist_ok=True)
    folder = adaptation.run / FLEET_FOLDER
    folder.mkdir(parents=True, exist_ok=True)
    log = folder / f"attempt-{number}.log"
    command = [sys.executable, "-c", CLI, "adapt", str(adaptation.record), "--out", str(adaptation.run)]
    command += ["--scale", adaptation.scale] if adaptation.scale else []
    command += ["--soc", adaptation.soc] if adaptation.soc else []
    started, began = time.perf_counter(), time.time()
    with log.open("w") as sink:
        proc = subprocess.Popen(
            command, stdout=sink, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"}
        )
        sampler = TreePeak(proc.pid)
        sampler.start()
        try:
            code = proc.wait()
        except BaseException:  # the task was cancelled (Ray raises KeyboardInterrupt in it)
            from omskills.host.parent_watch import end_descendants

            end_descendants()  # this worker's only children: the adaptation's process tree
            raise
        finally:
            sampler.stop()
    wall = time.perf_counter() - started
    (folder / f"peak-{number}.json").write_text(json.dumps({"peak_tree_gb": sampler.peak_gb}))
    output = log.read_text(errors="replace")
    row = row_of_run(adaptation.name, adaptation.run, code, output, wall, sampler.peak_gb)
    return Attempt(
        number=number,
        node_id=node_id,
        started=began,
        ended=time.time(),
        log=log.relative_to(adaptation.run).as_posix(),
        row=row,
    )


class TreePeak(threading.Thread):
    """The peak RSS of a process and all its children, sampled every half second."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid, self.peak_gb, self._stop_event = pid, 0.0, threading.Event()

    def run(self) -> None:
        import psutil

        while not self._stop_event.wait(0.5):
            try:
                root = psutil.Process(self.pid)
                tree = [root, *root.children(recursive=True)]
            except psutil.Error:
                continue
            rss = 0
            for proc in tree:
                try:
                    rss += proc.memory_info().rss
                except psutil.Error:
                    pass
            self.peak_gb = max(self.peak_gb, rss / GB)

    def stop(self) -> None:
        self._stop_event.set()
        self.join(timeout=5)


# --------------------------------------------------------------------------- the fleet (the driver side)

State = Literal["waiting", "running", "passed", "failed"]


class Board:
    """The live count, and one line per change of a task's state."""

    def __init__(self, adaptations: Sequence[FleetAdaptation], echo: Callable[[str], None]) -> None:
        self.states: dict[str, State] = {adaptation.name: "waiting" for adaptation in adaptations}
        self.echo = echo

    def move(self, name: str, state: State, what: str) -> None:
        self.states[name] = state
        counts = {s: list(self.states.values()).count(s) for s in ("running", "passed", "failed", "waiting")}
        count = ", ".join(f"{n} {s}" for s, n in counts.items())
        self.echo(f"[fleet] {name}: {what} | {count}")


def require_ray() -> None:
    """Says how to install Ray when it is missing (without importing it: Ray reads its
    authentication settings once, on import)."""
    import importlib.util

    try:
        found = importlib.util.find_spec("ray") is not None
    except (ImportError, ValueError):  # ValueError: a module entry set to None
        found = False
    if not found:
        raise InputError(RAY_MISSING)


def run_fleet(
    adaptations: Sequence[FleetAdaptation],
    *,
    address: str | None = None,
    local_cpus: int | None = None,
    echo: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True),
) -> FleetReport:
    """Every adaptation as a Ray task; a failed one tried once more on another node. Blocks until all end;
    an interrupt cancels the tasks still pending or running."""
    require_ray()
    started, clock = dt.datetime.now().isoformat(timespec="seconds"), time.perf_counter()
    options = {"address": address} if address else {"num_cpus": local_cpus, "include_dashboard": False}
    if address:
        check_reachable(address)
    with _local_auth_token(address):
        import ray  # after the token settings: Ray reads them on import

        ray.init(logging_level="ERROR", log_to_driver=False, **options)
        try:
            fleet = _Fleet(ray, adaptations, Board(adaptations, echo))
            fleet.run()
            return FleetReport(
                address=address or "local",
                nodes=len(fleet.nodes),
                started=started,
                wall_s=round(time.perf_counter() - clock, 1),
                results=[fleet.results[adaptation.name] for adaptation in adaptations],
            )
        finally:
            ray.shutdown()


def check_reachable(address: str, timeout: float = ADDRESS_TIMEOUT_S) -> None:
    """A cluster address ("host:port", "ray://host:port") that accepts a connection within `timeout`;
    "auto" and "local" are Ray's own lookups, left to it."""
    if address in ("auto", "local"):
        return
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not host or not port.isdigit():
        raise InputError(f"--address: {address!r} is not host:port, ray://host:port, auto or local")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            pass
    except OSError as err:
        raise InputError(f"--address: nothing answers at {address} within {timeout:.0f} s ({err})") from None


@contextlib.contextmanager
def _local_auth_token(address: str | None) -> Iterator[None]:
    """A local instance authenticates with a token of its own (Ray would otherwise write one to
    ~/.ray), kept in a private temporary folder while the instance lives (its processes read it
    when they start). A cluster (`address`) or a user's own RAY_AUTH_* settings are left alone."""
    if address or any(key.startswith("RAY_AUTH") for key in os.environ):
        yield
        return
    with tempfile.TemporaryDirectory(prefix="omskills-ray-") as folder:
        token = Path(folder) / "token"
        token.write_text(secrets.token_hex(32))
        os.environ.update({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token)})
        try:
            yield
        finally:
            for key in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH"):
                os.environ.pop(key, None)


class StartLog:
    """A Ray actor: each task says here that it started; the driver takes what is new."""

    def __init__(self) -> None:
        self.starts: list[tuple[str, int, str]] = []

    def started(self, name: str, number: int, node_id: str) -> None:
        self.starts.append((name, number, node_id))

    def take(self) -> list[tuple[str, int, str]]:
        taken, self.starts = self.starts, []
        return taken


class _Fleet:
    """The driver side of one fleet run: submits, collects, retries, starts the SoC followers."""

    def __init__(self, ray, adaptations: Sequence[FleetAdaptation], board: Board) -> None:
        self.ray, self.board = ray, board
        self.nodes = {n["NodeID"]: n for n in ray.nodes() if n["Alive"]}
        self.largest = max(n["Resources"].get("memory", 0) for n in self.nodes.values())
        self.starts = ray.remote(num_cpus=0)(StartLog).remote()
        self.adaptations = adaptations
        self.results = {adaptation.name: FleetResult(adaptation=adaptation) for adaptation in adaptations}
        self.pending: dict = {}  # Ray object ref -> (adaptation, attempt number)

    def run(self) -> None:
        for adaptation in self.adaptations:
            if adaptation.seed_from is None:
                self.submit(adaptation, 1)
        try:
            while self.pending:
                ready, _ = self.ray.wait(list(self.pending), num_returns=1, timeout=1.0)
                for ref in ready:  # ends first: a task that starts as another ends is not counted twice
                    adaptation, number = self.pending.pop(ref)
                    self.finish(adaptation, self.collect(ref, number, adaptation))
                self.show_started()
        except KeyboardInterrupt:
            for ref in self.pending:
                self.ray.cancel(ref)  # the task ends its adaptation's process tree (run_adaptation)
            raise

    def submit(self, adaptation: FleetAdaptation, number: int, avoid: str | None = None) -> None:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        if adaptation.memory_gb * GB > self.largest:
            offers = f"the largest node offers {self.largest / GB:.1f} GB"
            row = AdaptationRow(
                name=adaptation.name,
                exit_code=-1,
                stage="none",
                failure=f"memory: needs {adaptation.memory_gb:.1f} GB ({adaptation.memory_from}); {offers}",
            )
            self.finish(adaptation, Attempt(number=number, node_id="", row=row))
            return
        others = [node for node in self.nodes if node != avoid]
        strategy = NodeAffinitySchedulingStrategy(others[0], soft=True) if avoid and others else "DEFAULT"
        task = self.ray.remote(adapt_attempt).options(
            num_cpus=1, memory=int(adaptation.memory_gb * GB), max_retries=0, scheduling_strategy=strategy
        )
        self.pending[task.remote(adaptation, number, self.starts)] = (adaptation, number)
        how = f" on another node than {avoid[:8]}" if avoid else ""
        asks = f"attempt {number} asks {adaptation.memory_gb:.1f} GB ({adaptation.memory_from}){how}"
        self.board.move(adaptation.name, "waiting", asks)

    def collect(self, ref, number: int, adaptation: FleetAdaptation) -> Attempt:
        try:
            return self.ray.get(ref)
        except self.ray.exceptions.RayError as err:  # the worker died (killed for memory, a node lost)
            row = AdaptationRow(name=adaptation.name, exit_code=-1, stage="none", failure=f"worker: {err}"[:300])
            return Attempt(number=number, node_id="", row=row)

    def show_started(self) -> None:
        for name, number, node_id in self.ray.get(self.starts.take.remote()):
            if len(self.results[name].attempts) >= number:  # that attempt has already ended
                continue
            self.board.move(name, "running", f"attempt {number} running on {self.address_of(node_id)} ({node_id[:8]})")

    def address_of(self, node_id: str) -> str:
        return self.nodes[node_id]["NodeManagerAddress"] if node_id in self.nodes else ""

    def finish(self, adaptation: FleetAdaptation, attempt: Attempt) -> None:
        attempt.node_ip = self.address_of(attempt.node_id)
        self.results[adaptation.name].attempts.append(attempt)
        where = f" on {attempt.node_ip} ({attempt.node_id[:8]})" if attempt.node_id else ""
        if attempt.row.passed:
            self.board.move(adaptation.name, "passed", f"passed{where} in {attempt.row.wall_s:.0f} s")
        elif attempt.number < ATTEMPTS and not (attempt.row.failure or "").startswith("memory:"):
            self.board.move(adaptation.name, "waiting", f"failed{where}: {attempt.row.failure}; trying again")
            self.submit(adaptation, attempt.number + 1, avoid=attempt.node_id or None)
            return
        else:
            tries = f"{attempt.number} attempt(s)"
            self.board.move(adaptation.name, "failed", f"failed{where} after {tries}: {attempt.row.failure}")
        for follower in (f for f in self.adaptations if f.seed_from == adaptation.run):
            # Asked for what the run it starts from measured, now that it has run.
            memory, why = memory_request(follower.record, adaptation.run, follower.scale, follower.memory_gb)
            self.submit(follower.model_copy(update={"memory_gb": memory, "memory_from": why}), 1)


def write_report(report: FleetReport, out: Path) -> tuple[Path, Path]:
    """fleet.json (every attempt) and fleet.md (the table) in `out`."""
    out.mkdir(parents=True, exist_ok=True)
    data, table = out / FLEET_JSON, out / FLEET_MD
    data.write_text(report.model_dump_json(indent=1))
    table.write_text(report.markdown(f"{len(report.results)} adaptations through `omskills fleet`"))
    return data, table
