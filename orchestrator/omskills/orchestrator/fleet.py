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
from omskills.profiling.memory_estimate import AdaptationMemory
from pydantic import BaseModel, Field

from .fleet_memory import GB, PEAK_FILE, MemoryRequest, driver_request, measured_request
from .run_rows import HEADERS, AdaptationRow, cells, row_of_run

RAY_MISSING = "omskills fleet needs Ray, an optional extra: pip install -e '.[fleet]'"
CLI = "import sys; from omskills.orchestrator.cli import main; sys.exit(main())"
ATTEMPTS = 2  # a failed task is tried once more (in each fleet run)
FLEET_FOLDER = "fleet"  # inside a run folder: each attempt's log and measured peak, numbered across reruns
ATTEMPT_LOG = "attempt-{number}.log"
FLEET_JSON, FLEET_MD = "fleet.json", "fleet.md"  # the report, beside the run folders
FLEET_OWN_NAMES = frozenset({FLEET_JSON, FLEET_MD})  # no record id (a run folder's name) may take them
# How long `--address` may stay silent before the fleet says nothing answers there (Ray retries forever).
ADDRESS_TIMEOUT_S = 10.0
# After an interrupt, how long the cancelled tasks get to end their adaptations' process trees.
CANCEL_WAIT_S = 30.0
# How often a task waiting on its adaptation runs Python: Ray's cancel is raised only then.
POLL_S = 0.5
TO_MEASURE = "to be measured from the driver's model before it is submitted"


class FleetAdaptation(BaseModel):
    name: str = Field(description="The run folder's name: the record's id, '-<soc>' when fanned out over SoCs.")
    record: Path = Field(description="The task record (absolute).")
    run: Path = Field(description="The run folder (absolute, where every worker reaches it).")
    scale: str | None = Field(None, description="--scale given to adapt.")
    soc: str | None = Field(None, description="--soc given to adapt.")
    seed_from: Path | None = Field(None, description="A run folder this one starts as a copy of (the first SoC's).")
    memory_gb: float | None = Field(description="The memory the task asks Ray for, GB (None: not yet known).")
    memory_from: str = Field(description="Where that figure comes from.")
    memory_estimate: AdaptationMemory | None = Field(
        None, description="The driver's model measured, when the figure comes from it."
    )

    def asking(self, request: MemoryRequest) -> FleetAdaptation:
        return self.model_copy(
            update={"memory_gb": request.gb, "memory_from": request.why, "memory_estimate": request.estimate}
        )


class Attempt(BaseModel):
    number: int = Field(description="Its number in the run folder, counted across fleet runs (names its log).")
    node_id: str = Field(description="The Ray node that ran it ('' when the task never started).")
    node_ip: str = Field("", description="The node's address, as Ray reports it.")
    started: float = Field(0.0, description="When it started on its node (seconds since the epoch).")
    ended: float = Field(0.0, description="When it ended (seconds since the epoch).")
    log: str = Field("", description="The attempt's console output, relative to the run folder.")
    row: AdaptationRow


class FleetResult(BaseModel):
    adaptation: FleetAdaptation
    attempts: list[Attempt] = Field(default_factory=list, description="This fleet run's attempts.")
    logs: list[str] = Field(
        default_factory=list,
        description="Every attempt's log in the run folder, earlier fleet runs' too, oldest first (relative to it).",
    )
    interrupted: str | None = Field(None, description="Why it did not finish: the fleet was interrupted, and when.")

    @property
    def passed(self) -> bool:
        return not self.interrupted and bool(self.attempts) and self.attempts[-1].row.passed


class FleetReport(BaseModel):
    address: str = Field(description="The Ray cluster ('local': an instance started for this run).")
    nodes: int
    started: str
    wall_s: float
    interrupted: bool = Field(False, description="The fleet was interrupted (SIGINT): what had not finished says so.")
    results: list[FleetResult]

    def markdown(self, title: str) -> str:
        head = ["run", *HEADERS[:-1], "attempts (node)", HEADERS[-1]]
        lines = [f"### {title}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for result in self.results:
            row = result.attempts[-1].row if result.attempts else None
            shown = cells(row) if row else ["not run"] + ["-"] * (len(HEADERS) - 1)
            if result.interrupted:
                shown[-1] = result.interrupted
            tried = ", ".join(f"{a.number} ({a.node_ip or '-'} {a.node_id[:8]})" for a in result.attempts) or "-"
            lines.append("| " + " | ".join([result.adaptation.name, *shown[:-1], tried, shown[-1]]) + " |")
        passed = sum(r.passed for r in self.results)
        stopped = sum(bool(r.interrupted) for r in self.results)
        cut = f" Interrupted: {stopped} did not finish." if self.interrupted else ""
        lines += ["", f"{passed} of {len(self.results)} pass; wall {self.wall_s:.0f} s on {self.nodes} node(s).{cut}"]
        return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- adaptations


def plan_adaptations(
    records: Sequence[Path],
    out: Path,
    scale: str | None,
    socs: Sequence[str],
    unmeasured_gb: float | None = None,
) -> list[FleetAdaptation]:
    """One adaptation per record, or per record and SoC; run folders `out/<id>[-<soc>]`. The memory
    each asks for comes from its run folder's measurements or `unmeasured_gb`; else it is left to
    the driver (`fleet_memory.driver_request`), asked when the task is submitted."""
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
            planned = FleetAdaptation(
                name=name,
                record=record,
                run=run,
                scale=scale,
                soc=soc,
                seed_from=leader,
                memory_gb=None,
                memory_from=TO_MEASURE,
            )
            request = measured_request(leader or run, unmeasured_gb)
            adaptations.append(planned.asking(request) if request else planned)
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


def attempt_logs(run: Path) -> list[str]:
    """The attempt logs in a run folder, oldest first, relative to it."""
    logs = (run / FLEET_FOLDER).glob(ATTEMPT_LOG.format(number="*"))
    return [log.relative_to(run).as_posix() for log in sorted(logs, key=_attempt_number)]


def next_attempt_number(run: Path) -> int:
    """One more than the last attempt in the run folder: a rerun's attempts never take an earlier one's log."""
    files = (run / FLEET_FOLDER).glob("*-*.*")  # attempt-<n>.log, peak-<n>.json
    return max((_attempt_number(f) for f in files), default=0) + 1


def _attempt_number(path: Path) -> int:
    number = path.stem.rpartition("-")[2]
    return int(number) if number.isdigit() else 0


# --------------------------------------------------------------------------- one attempt (on a worker)


def adapt_attempt(adaptation: FleetAdaptation, number: int, starts) -> Attempt:
    """The Ray task: tells the `StartLog` actor it started on this node, then runs the adaptation."""
    import ray

    node_id = ray.get_runtime_context().get_node_id()
    # Not waited for: a task blocked in ray.get gives its CPU back and Ray starts another beside it.
    starts.started.remote(adaptation.name, number, node_id, time.time())
    return run_adaptation(adaptation, number, node_id)


def run_adaptation(adaptation: FleetAdaptation, number: int, node_id: str = "local") -> Attempt:
    """`omskills adapt` on the adaptation's record in its run folder, the process tree's memory sampled.
    Its console output goes to `<run>/fleet/attempt-<number>.log`, its peak to `peak-<number>.json`."""
    if adaptation.seed_from is not None and not (adaptation.run / "task.yaml").exists():
        # The first SoC's attempts are its own: their logs and peaks stay in its folder.
        own = shutil.ignore_patterns(FLEET_FOLDER)
        shutil.copytree(adaptation.seed_from, adaptation.run, symlinks=True, dirs_exist_ok=True, ignore=own)
    folder = adaptation.run / FLEET_FOLDER
    folder.mkdir(parents=True, exist_ok=True)
    log = folder / ATTEMPT_LOG.format(number=number)
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
            code = _wait(proc)
        except BaseException:  # the task was cancelled (Ray raises KeyboardInterrupt in it)
            from omskills.host.parent_watch import end_descendants

            end_descendants()  # this worker's only children: the adaptation's process tree
            raise
        finally:
            sampler.stop()
    wall = time.perf_counter() - started
    peak = {"peak_tree_gb": sampler.peak_gb, "exit_code": code}
    (folder / PEAK_FILE.format(number=number)).write_text(json.dumps(peak))
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


def _wait(proc: subprocess.Popen) -> int:
    """The process's exit code, waited for in short turns: Ray raises a cancel in the task only
    when it runs Python, never inside one long wait."""
    while True:
        try:
            return proc.wait(timeout=POLL_S)
        except subprocess.TimeoutExpired:
            continue


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

State = Literal["waiting", "running", "passed", "failed", "interrupted"]


class Board:
    """The live count, and one line per change of a task's state."""

    def __init__(self, adaptations: Sequence[FleetAdaptation], echo: Callable[[str], None]) -> None:
        self.states: dict[str, State] = {adaptation.name: "waiting" for adaptation in adaptations}
        self.echo = echo

    def move(self, name: str, state: State, what: str) -> None:
        self.states[name] = state
        counts = {s: list(self.states.values()).count(s) for s in ("running", "passed", "failed", "waiting")}
        counts["interrupted"] = list(self.states.values()).count("interrupted")
        count = ", ".join(f"{n} {s}" for s, n in counts.items() if n or s != "interrupted")
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
    """Every adaptation as a Ray task; a failed one tried once more on another node. Blocks until all
    end. An interrupt (SIGINT) cancels the tasks still running, which end their adaptations, and the
    report says what finished and marks the rest interrupted."""
    require_ray()
    started, clock = dt.datetime.now().isoformat(timespec="seconds"), time.perf_counter()
    # "local": a new instance, never one some other `ray start` left on this machine.
    options = {"address": address} if address else {"address": "local", "num_cpus": local_cpus}
    if address:
        check_reachable(address)
    with _local_auth_token(address):
        import ray  # after the token settings: Ray reads them on import

        ray.init(logging_level="ERROR", log_to_driver=False, include_dashboard=False, **options)
        try:
            fleet = _Fleet(ray, adaptations, Board(adaptations, echo))
            interrupted = fleet.run()
            results = [fleet.results[adaptation.name] for adaptation in adaptations]
            for result in results:
                result.logs = attempt_logs(result.adaptation.run)
            return FleetReport(
                address=address or "local",
                nodes=len(fleet.nodes),
                started=started,
                wall_s=round(time.perf_counter() - clock, 1),
                interrupted=interrupted,
                results=results,
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
        self.starts: list[tuple[str, int, str, float]] = []

    def started(self, name: str, number: int, node_id: str, when: float) -> None:
        self.starts.append((name, number, node_id, when))

    def take(self) -> list[tuple[str, int, str, float]]:
        taken, self.starts = self.starts, []
        return taken


class _Fleet:
    """The driver side of one fleet run: sizes and submits, collects, retries, starts the SoC
    followers; on an interrupt, cancels what runs and marks what did not finish."""

    def __init__(self, ray, adaptations: Sequence[FleetAdaptation], board: Board) -> None:
        self.ray, self.board = ray, board
        self.nodes = {n["NodeID"]: n for n in ray.nodes() if n["Alive"]}
        self.largest = max(n["Resources"].get("memory", 0) for n in self.nodes.values())
        self.starts = ray.remote(num_cpus=0)(StartLog).remote()
        self.adaptations = adaptations
        self.results = {adaptation.name: FleetResult(adaptation=adaptation) for adaptation in adaptations}
        self.pending: dict = {}  # Ray object ref -> (adaptation, attempt number)
        self.started: dict[tuple[str, int], tuple[str, float]] = {}  # (name, number) -> (node id, when)
        # Submitted one per turn of the loop: sizing one may build its model (seconds), and the
        # tasks already running are collected in between.
        self.queue = [adaptation for adaptation in adaptations if adaptation.seed_from is None]

    def run(self) -> bool:
        """Until every task ended; True when interrupted (SIGINT) first."""
        try:
            while self.queue or self.pending:
                if self.queue:
                    self.submit(self.queue.pop(0))
                if not self.pending:
                    continue
                ready, _ = self.ray.wait(list(self.pending), num_returns=1, timeout=0 if self.queue else 1.0)
                for ref in ready:  # ends first: a task that starts as another ends is not counted twice
                    adaptation, number = self.pending.pop(ref)
                    self.finish(adaptation, self.collect(ref, number, adaptation))
                self.show_started()
        except KeyboardInterrupt:
            self.interrupt()
            return True
        return False

    def submit(self, adaptation: FleetAdaptation, avoid: str | None = None) -> None:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        adaptation = self.sized(adaptation)
        number = self.next_number(adaptation)
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

    def sized(self, adaptation: FleetAdaptation) -> FleetAdaptation:
        """The adaptation with the memory it asks for: its driver asked when nothing measured says it."""
        if adaptation.memory_gb is None:
            self.board.move(adaptation.name, "waiting", "measuring its model, for the memory to ask for")
            adaptation = adaptation.asking(driver_request(adaptation.record, adaptation.scale))
        self.results[adaptation.name].adaptation = adaptation  # fleet.json says what was asked
        return adaptation

    def next_number(self, adaptation: FleetAdaptation) -> int:
        """Counted across fleet runs, so a rerun keeps every earlier attempt's log."""
        here = [a.number for a in self.results[adaptation.name].attempts]
        return max([next_attempt_number(adaptation.run) - 1, *here]) + 1

    def collect(self, ref, number: int, adaptation: FleetAdaptation) -> Attempt:
        try:
            return self.ray.get(ref)
        except self.ray.exceptions.RayError as err:  # the worker died (killed for memory, a node lost)
            row = AdaptationRow(name=adaptation.name, exit_code=-1, stage="none", failure=f"worker: {err}"[:300])
            return Attempt(number=number, node_id="", row=row)

    def show_started(self) -> None:
        for name, number, node_id, when in self.ray.get(self.starts.take.remote()):
            self.started[(name, number)] = (node_id, when)
            if any(a.number == number for a in self.results[name].attempts):  # that attempt has already ended
                continue
            self.board.move(name, "running", f"attempt {number} running on {self.address_of(node_id)} ({node_id[:8]})")

    def address_of(self, node_id: str) -> str:
        return self.nodes[node_id]["NodeManagerAddress"] if node_id in self.nodes else ""

    def finish(self, adaptation: FleetAdaptation, attempt: Attempt) -> None:
        attempt.node_ip = self.address_of(attempt.node_id)
        tries = self.results[adaptation.name].attempts
        tries.append(attempt)
        where = f" on {attempt.node_ip} ({attempt.node_id[:8]})" if attempt.node_id else ""
        if attempt.row.passed:
            self.board.move(adaptation.name, "passed", f"passed{where} in {attempt.row.wall_s:.0f} s")
        elif len(tries) < ATTEMPTS and not (attempt.row.failure or "").startswith("memory:"):
            self.board.move(adaptation.name, "waiting", f"failed{where}: {attempt.row.failure}; trying again")
            self.submit(adaptation, avoid=attempt.node_id or None)
            return
        else:
            self.board.move(
                adaptation.name, "failed", f"failed{where} after {len(tries)} attempt(s): {attempt.row.failure}"
            )
        for follower in (f for f in self.adaptations if f.seed_from == adaptation.run):
            # Asks for what the run it starts from measured, now that it has run.
            measured = measured_request(adaptation.run)
            self.queue.append(follower.asking(measured) if measured else follower)

    # -- an interrupt (SIGINT)

    def interrupt(self) -> None:
        """Cancels the tasks still running (each ends its adaptation's process tree) and waits for
        them a while; each running attempt is reported with what its run folder reached, and every
        adaptation that did not finish is marked interrupted."""
        when = dt.datetime.now().isoformat(timespec="seconds")
        self.board.echo(f"[fleet] interrupted: cancelling {len(self.pending)} task(s)")
        for ref in self.pending:
            self.ray.cancel(ref)  # the task ends its adaptation's process tree (run_adaptation)
        if self.pending:
            self.ray.wait(list(self.pending), num_returns=len(self.pending), timeout=CANCEL_WAIT_S)
        self.show_started()
        for adaptation, number in self.pending.values():
            if (adaptation.name, number) in self.started:
                self.results[adaptation.name].attempts.append(self.cut_short(adaptation, number, when))
        for name, result in self.results.items():
            if self.board.states[name] not in ("passed", "failed"):
                result.interrupted = f"interrupted (SIGINT at {when}) {self.where(result)}"
                self.board.move(name, "interrupted", result.interrupted)

    def cut_short(self, adaptation: FleetAdaptation, number: int, when: str) -> Attempt:
        """A running attempt the interrupt ended: its node, its log and what its run folder reached."""
        node_id, began = self.started[(adaptation.name, number)]
        log = adaptation.run / FLEET_FOLDER / ATTEMPT_LOG.format(number=number)
        output = log.read_text(errors="replace") if log.is_file() else ""
        row = row_of_run(adaptation.name, adaptation.run, -2, output, time.time() - began, None)
        row.failure = f"interrupted: the fleet was stopped (SIGINT at {when}) during this attempt"
        return Attempt(
            number=number,
            node_id=node_id,
            node_ip=self.address_of(node_id),
            started=began,
            ended=time.time(),
            log=log.relative_to(adaptation.run).as_posix(),
            row=row,
        )

    def where(self, result: FleetResult) -> str:
        if not result.attempts or not result.attempts[-1].node_id:
            return "before it started"
        return f"in attempt {result.attempts[-1].number}, after step '{result.attempts[-1].row.stage}'"


def write_report(report: FleetReport, out: Path) -> tuple[Path, Path]:
    """fleet.json (every attempt) and fleet.md (the table) in `out`."""
    out.mkdir(parents=True, exist_ok=True)
    data, table = out / FLEET_JSON, out / FLEET_MD
    data.write_text(report.model_dump_json(indent=1))
    table.write_text(report.markdown(f"{len(report.results)} adaptations through `omskills fleet`"))
    return data, table
