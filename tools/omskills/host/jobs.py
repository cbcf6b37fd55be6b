"""Tool calls as jobs: each runs in a worker thread of its own, can be cancelled, and can be polled.

The MCP server runs every tool call as a `Job`: a direct `tools/call` waits for its job and
forwards its progress; `start_job` returns the job's id at once and the client polls
`job_status` (for clients that cut a request off after a minute or less). The engine inside
the job sees a progress reporter and a cancel flag through `omskills.progress`; cancelling
sets the flag, and the engine raises `progress.Cancelled` at its next progress point, so a
step in progress is recorded as failed (never done) and a rerun redoes it.

Tools that write or run a model ("exclusive" jobs; the server decides which) run one at a
time, first come first served: the engine has process-wide state that two of them would share
(the model cache, a patched torch.nn.Module while a model is built on the meta device) and two
calls may write the same artefacts (a retried export while the first is still stopping). An
exclusive job started while another runs waits, and says for whom it waits; a cancel ends a
waiting job at once. Other jobs (quick read-only tools) run alongside anything.

This module knows nothing of MCP: the server maps its snapshots onto the protocol.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from omskills import progress
from omskills.errors import InputError, OmskillsError, one_line
from omskills.host.job_store import TOKEN_ENV, ExclusiveLock, JobState, JobStore, StoredJob, is_runner, runner_argv
from omskills.records.base import Record
from pydantic import Field

log = logging.getLogger("omskills.host.jobs")

JobOrigin = Literal["start_job", "call"]
# Finished jobs kept for job_status/list_jobs; the oldest go first.
_KEPT_FINISHED = 100
# How often a job waiting for its turn looks at its cancel flag.
_TURN_POLL_SECONDS = 0.1


class JobProgress(Record):
    """The last progress the tool reported."""

    done: float | None = Field(None, description="Units done in the current phase (None before the first report).")
    total: float | None = Field(None, description="Units in the current phase, when known.")
    message: str = Field(
        description="What the tool is doing now, e.g. 'export: image_encoder' or 'study run: 3 steps'."
    )


class JobStatus(Record):
    """A job as a client sees it: state, progress, and its result once it ended."""

    job_id: str = Field(description="The id to pass to job_status and cancel_job.")
    tool: str = Field(description="The tool the job runs.")
    origin: JobOrigin = Field(description="'start_job' for a started job, 'call' for a direct tools/call in progress.")
    task: str | None = Field(None, description="The task record the job works on (workspace-relative), if any.")
    state: JobState = Field(description="running, succeeded, failed or cancelled.")
    cancel_requested: bool = Field(
        False, description="A cancel was asked for; the job stops at its next progress point."
    )
    progress: JobProgress = Field(description="The last progress the tool reported.")
    elapsed_seconds: float = Field(description="Seconds since the job started (until it ended, once it has).")
    result: dict[str, Any] | None = Field(
        None,
        description="On success: the tool's structured result, as a direct call returns it "
        '(a result that is not an object comes as {"value": ...}).',
    )
    error: str | None = Field(None, description="On failure: the tool's one-line error; on cancel: why it stopped.")


class JobList(Record):
    """Every running job and the most recent finished ones, newest first."""

    jobs: list[JobStatus] = Field(description="The jobs, newest first.")


class Turns:
    """Exclusive jobs take turns, in the order they were started (a FIFO queue of jobs); with a
    `lock`, the one whose turn it is also takes the workspace's turn among processes (the runners
    of started jobs)."""

    def __init__(self, lock: ExclusiveLock | None = None) -> None:
        self._changed = threading.Condition()
        self._queue: deque[Job] = deque()
        self._lock = lock
        self._lock_holder: Job | None = None

    def join(self, job: Job) -> None:
        with self._changed:
            self._queue.append(job)

    def wait_for_turn(self, job: Job) -> bool:
        """Block until `job` is first in line (whether it had to wait); `progress.Cancelled` (and out of
        line) if cancelled meanwhile."""
        shown: Job | None = None
        with self._changed:
            while self._queue[0] is not job:
                if job.cancel_flag.is_set():
                    self._leave_locked(job)
                    raise progress.Cancelled("cancelled while waiting for its turn")
                holder = self._queue[0]
                if holder is not shown:
                    shown = holder
                    job.record_progress(None, None, f"waiting for {holder.tool} (job {holder.id}) to finish")
                self._changed.wait(_TURN_POLL_SECONDS)
        if self._lock is not None:
            if not self._lock.acquire(
                job.id, job.tool, job.cancel_flag.is_set, lambda message: job.record_progress(None, None, message)
            ):
                self.leave(job)
                raise progress.Cancelled("cancelled while waiting for its turn")
            self._lock_holder = job
        return shown is not None

    def leave(self, job: Job) -> None:
        with self._changed:
            if self._lock is not None and self._lock_holder is job:
                self._lock.release()
                self._lock_holder = None
            self._leave_locked(job)

    def _leave_locked(self, job: Job) -> None:
        if job in self._queue:
            self._queue.remove(job)
            self._changed.notify_all()


@dataclass(eq=False)  # a job is itself: compared by identity (the turn queue looks jobs up)
class Job:
    """One tool call running in its own thread."""

    id: str
    tool: str
    origin: JobOrigin
    task: Path | None
    task_label: str | None
    func: Callable[..., Any]
    arguments: dict[str, Any]
    started: float = field(default_factory=time.monotonic)
    ended: float | None = None
    state: JobState = "running"
    result: Any = None
    error: str | None = None
    # The error is one the user acts on (a bad argument, record field or input a driver's check
    # refused: OmskillsError, OSError), the kind a direct call of the tool's CLI exits 2 for.
    users_error: bool = False
    progress: JobProgress = field(default_factory=lambda: JobProgress(message="started"))
    # Bumped on every progress report, so followers can tell a new report from a heartbeat.
    reports: int = 0
    cancel_flag: threading.Event = field(default_factory=threading.Event)
    finished: threading.Event = field(default_factory=threading.Event)
    # Set for an exclusive job: it runs only when its turn comes.
    turns: Turns | None = None
    # Turns a result into JSON for job_status (the server passes the toolkit's to_jsonable).
    to_json: Callable[[Any], Any] = lambda value: value

    def run(self) -> None:
        """The thread body: the tool with this job's reporter and cancel flag in its context."""
        # Only the one-line error is kept: a finished job holding its exception would keep the
        # traceback's frames (and the models in them) alive for as long as the job is listed.
        try:
            if self.turns is not None and self.turns.wait_for_turn(self):
                self.record_progress(None, None, "started")
            with progress.reporting_to(self.record_progress), progress.cancellable(self.cancel_flag):
                progress.check_cancelled()
                outcome = self.func(**self.arguments)
            self._end("succeeded", result=outcome)
        except progress.Cancelled as err:
            self._end("cancelled", error=f"{self.tool} cancelled: {err}")
        except (Exception, SystemExit) as err:  # the server keeps serving whatever a tool does
            self.users_error = isinstance(err, (OmskillsError, OSError))
            if not isinstance(err, OmskillsError):
                log.error("tool %s raised %s", self.tool, type(err).__name__, exc_info=err)
            self._end("failed", error=one_line(err))
        except BaseException as err:  # KeyboardInterrupt in a worker: end the job, let the thread end
            self._end("cancelled", error=f"{self.tool} interrupted: {type(err).__name__}")
        finally:
            if self.turns is not None:
                self.turns.leave(self)

    def record_progress(self, done: float | None, total: float | None, message: str) -> None:
        self.progress = JobProgress(done=done, total=total, message=message)
        self.reports += 1

    def _end(self, state: JobState, *, result: Any = None, error: str | None = None) -> None:
        self.ended = time.monotonic()
        self.result, self.error = result, error
        self.state = state
        self.finished.set()

    def cancel(self) -> None:
        self.cancel_flag.set()

    @property
    def elapsed(self) -> float:
        return (self.ended or time.monotonic()) - self.started

    def status(self, *, with_result: bool = True) -> JobStatus:
        return JobStatus(
            job_id=self.id,
            tool=self.tool,
            origin=self.origin,
            task=self.task_label,
            state=self.state,
            cancel_requested=self.cancel_flag.is_set(),
            progress=self.progress,
            elapsed_seconds=round(self.elapsed, 1),
            result=self._result_json() if with_result and self.state == "succeeded" else None,
            error=self.error,
        )

    def _result_json(self) -> dict[str, Any]:
        value = self.to_json(self.result)
        return value if isinstance(value, dict) else {"value": value}


class _Finished:
    """`Job.finished`'s interface over a stored job's state."""

    def __init__(self, job: DetachedJob) -> None:
        self._job = job

    def is_set(self) -> bool:
        return self._job.refresh().finished


class DetachedJob:
    """A started job as a server sees it: its runner is a process of its own, its state a file in
    the workspace (host.job_store), so any server on the workspace follows it."""

    origin: JobOrigin = "start_job"

    def __init__(self, store: JobStore, stored: StoredJob) -> None:
        self.store, self._stored = store, stored
        self.id, self.tool = stored.job_id, stored.tool
        self.finished = _Finished(self)
        self._read_at = -1.0  # the first look checks the runner is alive

    def refresh(self) -> StoredJob:
        """The job's file, read again (at most every poll period); a runner that died without
        writing its end is recorded failed, and the step it left running is marked so."""
        if self._stored.finished or time.monotonic() - self._read_at < _TURN_POLL_SECONDS / 2:
            return self._stored
        self._read_at = time.monotonic()
        self._stored = self.store.read(self.id) or self._stored
        if (
            not self._stored.finished
            and self._stored.pid is not None
            and not is_runner(self._stored, self.store.workspace)
        ):
            self._stored = self.store.update(self.id, _runner_died) or self._stored
            _reap_steps(self._stored)
        return self._stored

    @property
    def state(self) -> JobState:
        return self.refresh().state

    @property
    def progress(self) -> JobProgress:
        stored = self.refresh().progress
        return JobProgress(done=stored.done, total=stored.total, message=stored.message)

    @property
    def reports(self) -> int:
        return self.refresh().reports

    @property
    def elapsed(self) -> float:
        return self.refresh().elapsed

    @property
    def started(self) -> float:  # for ordering beside in-process jobs (monotonic there, wall here)
        return time.monotonic() - self.elapsed

    def cancel(self) -> None:
        def ask(job: StoredJob) -> None:
            job.cancel_requested = True

        stored = self.store.update(self.id, ask)
        # Before it is ready the runner reads the request from its file when it starts.
        if (
            stored is not None
            and stored.ready
            and not stored.finished
            and stored.pid is not None
            and is_runner(stored, self.store.workspace)
        ):
            with contextlib.suppress(ProcessLookupError):
                os.kill(stored.pid, signal.SIGTERM)

    def status(self, *, with_result: bool = True) -> JobStatus:
        stored = self.refresh()
        return JobStatus(
            job_id=self.id,
            tool=self.tool,
            origin="start_job",
            task=stored.task_label,
            state=stored.state,
            cancel_requested=stored.cancel_requested,
            progress=self.progress,
            elapsed_seconds=round(stored.elapsed, 1),
            result=stored.result if with_result and stored.state == "succeeded" else None,
            error=stored.error,
        )


def _runner_died(job: StoredJob) -> None:
    if not job.finished:
        job.state, job.ended_at = "failed", time.time()
        job.error = (
            f"the job's process (pid {job.pid}) ended without a result (killed?); a rerun of {job.tool} redoes it"
        )


def _reap_steps(job: StoredJob) -> None:
    """The steps a dead runner left `running` in its task record saved as interrupted (the record's
    loader tells them by their process, `records.step_owner`)."""
    if job.task is None or not Path(job.task).is_file():
        return
    from omskills.records.task import settle_on_disk

    with contextlib.suppress(OmskillsError, OSError):
        settle_on_disk(Path(job.task))


def _jsonable_arguments(arguments: dict[str, Any]) -> dict[str, Any]:
    """The validated arguments as the job's file stores them (paths as text); the runner validates them again."""
    return json.loads(json.dumps(arguments, default=str))


# Starts the runner and exits at once: the runner's parent is then init, not the server, so a
# client that ends the server's whole process tree (the SDK's stdio client does) leaves it running.
_DETACH = (
    "import subprocess, sys; "
    "log = open(sys.argv[1], 'ab'); "
    "runner = subprocess.Popen(sys.argv[2:], stdin=subprocess.DEVNULL, stdout=log, stderr=log, "
    "start_new_session=True); "
    "print(runner.pid)"
)


def spawn_runner(store: JobStore, job_id: str, token: str) -> int:
    """Start the job's runner detached from this process (its own session, and not this process's
    child: the server's exit or a client's Ctrl-C does not reach it); its output goes to the job's log.
    `token` goes into its environment: what identifies it as the job's runner (`is_runner`)."""
    started = subprocess.run(
        [
            sys.executable,
            "-c",
            _DETACH,
            str(store.log_path(job_id)),
            sys.executable,
            *runner_argv(store.workspace, job_id),
        ],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        cwd=store.workspace,
        env={**os.environ, TOKEN_ENV: token},
        timeout=60,
    )
    if started.returncode != 0 or not started.stdout.strip().isdigit():
        raise OmskillsError(
            f"job {job_id}: its process did not start ({one_line(started.stderr or started.stdout, 300)})"
        )
    return int(started.stdout.strip())


class JobRegistry:
    """The server's jobs: started, looked up, listed; one started job per task record at a time,
    one exclusive job at a time (`Turns`)."""

    def __init__(self, store: JobStore | None = None) -> None:
        self._jobs: dict[str, Job] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._turns = Turns(ExclusiveLock(store.folder) if store is not None else None)
        self.store = store

    def start_detached(
        self,
        tool: str,
        arguments: dict[str, Any],
        *,
        skills_dir: Path,
        task: Path | None = None,
        task_label: str | None = None,
        exclusive: bool = True,
    ) -> DetachedJob:
        """Start a tool in a runner process of its own, its state in the workspace's job store."""
        if self.store is None:
            raise OmskillsError("this server keeps no job store: start_job needs a workspace")
        if task is not None:
            stored_holder = self.store.holder_of(str(task))
            holder = DetachedJob(self.store, stored_holder) if stored_holder is not None else self._holder_of(task)
            if holder is not None:
                raise InputError(
                    f"argument 'task': the task record {task_label or task} is held by job {holder.id} "
                    f"({holder.tool}, running for {holder.elapsed:.0f} s): "
                    "follow it with job_status or stop it with cancel_job"
                )
        stored = StoredJob(
            job_id=self.store.new_id(),
            tool=tool,
            arguments=_jsonable_arguments(arguments),
            skills_dir=str(skills_dir),
            task=str(task) if task is not None else None,
            task_label=task_label,
            exclusive=exclusive,
        )
        stored.runner_token = secrets.token_hex(16)
        self.store.write(stored)
        self.store.forget_old()
        pid = spawn_runner(self.store, stored.job_id, stored.runner_token)
        self.store.update(stored.job_id, lambda job: setattr(job, "pid", pid))
        return DetachedJob(self.store, self.store.read(stored.job_id) or stored)

    def start(
        self,
        tool: str,
        func: Callable[..., Any],
        arguments: dict[str, Any],
        *,
        origin: JobOrigin,
        task: Path | None = None,
        task_label: str | None = None,
        exclusive: bool = True,
        to_json: Callable[[Any], Any] | None = None,
    ) -> Job:
        """Start `func(**arguments)` in a thread; an `exclusive` job waits for its turn among the exclusive ones."""
        with self._lock:
            if origin == "start_job" and task is not None:
                holder = self._holder_of(task)
                if holder is not None:
                    raise InputError(
                        f"argument 'task': the task record {task_label or task} is held by job {holder.id} "
                        f"({holder.tool}, running for {holder.elapsed:.0f} s): follow it with job_status or "
                        f"stop it with cancel_job"
                    )
            job = Job(
                id=f"job-{next(self._ids)}",
                tool=tool,
                origin=origin,
                task=task,
                task_label=task_label,
                func=func,
                arguments=arguments,
                to_json=to_json or (lambda value: value),
                turns=self._turns if exclusive else None,
            )
            if exclusive:
                # Joined here, under the registry lock: the order of the queue is the order of start.
                self._turns.join(job)
            self._jobs[job.id] = job
            self._forget_old()
        # A daemon thread: a server told to exit (parent gone, stdin closed) must not wait for it.
        threading.Thread(target=job.run, name=f"omskills {job.id} {tool}", daemon=True).start()
        return job

    def _holder_of(self, task: Path) -> Job | None:
        return next(
            (j for j in self._jobs.values() if j.origin == "start_job" and j.task == task and not j.finished.is_set()),
            None,
        )

    def _forget_old(self) -> None:
        finished = [j for j in self._jobs.values() if j.finished.is_set()]
        for job in finished[: max(0, len(finished) - _KEPT_FINISHED)]:
            del self._jobs[job.id]

    def get(self, job_id: str) -> Job | DetachedJob:
        with self._lock:
            job = self._jobs.get(job_id)
        if job is not None:
            return job
        stored = self.store.read(job_id) if self.store is not None and JobStore.is_id(job_id) else None
        if stored is None:
            known = (
                ", ".join([*self._jobs, *(j.job_id for j in self.store.all()[:10])] if self.store else self._jobs)
                or "none"
            )
            raise InputError(f"argument 'job_id': no job {job_id!r} (known: {known})")
        return DetachedJob(self.store, stored)

    def all(self) -> list[Job | DetachedJob]:
        """The direct calls in progress and recently ended, and every stored job, newest first."""
        with self._lock:
            here: list[Job | DetachedJob] = list(self._jobs.values())
        stored = [DetachedJob(self.store, j) for j in self.store.all()] if self.store is not None else []
        return sorted(here + stored, key=lambda j: j.started, reverse=True)

    def running(self) -> list[Job]:
        """This server's own jobs still running (the direct calls): started jobs outlive the server."""
        with self._lock:
            return [j for j in self._jobs.values() if not j.finished.is_set()]

    def cancel_all(self) -> None:
        for job in self.running():
            job.cancel()

    def wait_all(self, seconds: float) -> bool:
        """Wait until every job ended or `seconds` passed; whether all ended."""
        deadline = time.monotonic() + seconds
        for job in self.running():
            if not job.finished.wait(max(0.0, deadline - time.monotonic())):
                return False
        return True
