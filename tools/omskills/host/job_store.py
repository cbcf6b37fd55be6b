"""Started jobs kept in the workspace, so that they outlive the server that started them.

A client such as the MCP Inspector's CLI, or Claude Desktop after a restart, starts a new server
for every connection: a job held in one server's memory would be gone by the next poll. A job
started with `start_job` therefore runs in a process of its own (`host.job_runner`), detached
from the server, and its state lives in `<workspace>/.omskills/jobs/<job id>.json`: the tool and
its arguments, the runner's pid, the last progress, and the result or the one-line error. Any
server on the same workspace answers `job_status`, `cancel_job` and `list_jobs` from these files.

Ids are time-ordered and unique across servers (`job-20261203-190512-3f9a1c`). Writers are the
runner (progress, the end) and a server (the start, a cancel request, a dead runner's failure);
each write replaces the file atomically, and the last state a runner wrote wins.

Tools that write or run a model take turns across processes through one lock file
(`ExclusiveLock`), whose holder is written beside it so a waiting job can say for whom it waits.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import fcntl
import json
import os
import re
import secrets
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal

from omskills.errors import InputError
from omskills.files import atomic_write_text, open_lock_file
from omskills.records.base import Record
from pydantic import Field, ValidationError

JobState = Literal["running", "succeeded", "failed", "cancelled"]
JOBS_FOLDER = Path(".omskills") / "jobs"
_ID = re.compile(r"^job-\d{8}-\d{6}-[0-9a-f]{6}$")
# Jobs kept in the folder; the oldest finished ones go first.
KEPT_JOBS = 100


class StoredProgress(Record):
    done: float | None = None
    total: float | None = None
    message: str = "started"


class StoredJob(Record):
    """One started job as its file holds it."""

    job_id: str
    tool: str
    arguments: dict[str, Any] = Field(description="The tool's arguments, validated and confined by the server.")
    skills_dir: str = Field(description="Where the server found the tool.")
    task: str | None = None  # the task record's absolute path, if the tool takes one
    task_label: str | None = None  # the same, workspace-relative
    exclusive: bool = True
    pid: int | None = None  # the runner's
    # In the runner's environment (TOKEN_ENV), put there by the server that started it: a process
    # is this job's runner only if it carries it (`is_runner`), whatever its pid.
    runner_token: str | None = None
    ready: bool = False  # the runner catches SIGTERM (before, a signal would kill it without a word)
    state: JobState = "running"
    progress: StoredProgress = Field(default_factory=StoredProgress)
    reports: int = 0
    started_at: float = Field(default_factory=time.time)
    ended_at: float | None = None
    cancel_requested: bool = False
    result: dict[str, Any] | None = None
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.state != "running"

    @property
    def elapsed(self) -> float:
        return (self.ended_at or time.time()) - self.started_at


RUNNER_MODULE = "omskills.host.job_runner"
TOKEN_ENV = "OMSKILLS_JOB_TOKEN"


def runner_argv(workspace: Path, job_id: str) -> list[str]:
    """How a job's runner is started (after the interpreter): what `is_runner` expects to find."""
    return ["-m", RUNNER_MODULE, str(workspace), job_id]


def is_runner(job: StoredJob, workspace: Path) -> bool:
    """Whether `job.pid` is this job's live runner: not a zombie, started by `runner_argv` for this
    workspace and job, and carrying the job's token in its environment. A reused pid, or a job file
    naming an unrelated process (whatever its command line says), is not: it is never signalled."""
    if job.pid is None or job.pid <= 0 or not job.runner_token:
        return False
    proc = Path(f"/proc/{job.pid}")
    try:
        state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
        argv = (proc / "cmdline").read_bytes().split(b"\0")
        environ = (proc / "environ").read_bytes().split(b"\0")
    except (OSError, IndexError):
        return False
    token = f"{TOKEN_ENV}={job.runner_token}".encode()
    if state in ("Z", "X") or token not in environ or len(argv) < 5:
        return False
    module, folder, job_id = (a.decode(errors="replace") for a in (argv[2], argv[3], argv[4]))
    return argv[1] == b"-m" and module == RUNNER_MODULE and job_id == job.job_id and _same(folder, workspace)


def _same(folder: str, workspace: Path) -> bool:
    try:
        return Path(folder).resolve() == workspace.resolve()
    except (OSError, RuntimeError, ValueError):
        return False


class JobStore:
    """The job files of one workspace."""

    def __init__(self, workspace: Path) -> None:
        self.workspace = workspace
        self.folder = workspace / JOBS_FOLDER

    @staticmethod
    def new_id() -> str:
        return f"job-{_dt.datetime.now().strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}"

    @staticmethod
    def is_id(text: str) -> bool:
        return bool(_ID.match(text))

    def path(self, job_id: str) -> Path:
        if not self.is_id(job_id):  # the id names a file: nothing else may
            raise InputError(f"argument 'job_id': {job_id!r} is not a job id (job-YYYYMMDD-HHMMSS-xxxxxx)")
        return self.folder / f"{job_id}.json"

    def log_path(self, job_id: str) -> Path:
        return self.path(job_id).with_suffix(".log")

    def read(self, job_id: str) -> StoredJob | None:
        path = self.path(job_id)
        try:
            job = StoredJob.model_validate_json(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return None
        except (OSError, ValidationError, ValueError) as err:
            raise InputError(f"job {job_id}: its file {path} cannot be read ({str(err).splitlines()[0]})") from None
        if job.job_id != job_id:
            raise InputError(f"job {job_id}: its file {path} holds job {job.job_id[:40]!r}: refused")
        if job.task is not None and not self._inside(job.task):
            # Read back, it would be updated (a dead runner's steps marked failed) and locked.
            raise InputError(f"job {job_id}: its file names a task record outside the workspace ({job.task[:80]})")
        return job

    def _inside(self, path: str) -> bool:
        try:
            return Path(path).resolve().is_relative_to(self.workspace.resolve())
        except (OSError, RuntimeError, ValueError):
            return False

    def write(self, job: StoredJob) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        atomic_write_text(self.path(job.job_id), job.model_dump_json())

    def update(self, job_id: str, change: Callable[[StoredJob], None]) -> StoredJob | None:
        """Read, change and write a job's file under the store's lock (a runner and a server may both write)."""
        with self._locked():
            job = self.read(job_id)
            if job is not None:
                change(job)
                self.write(job)
            return job

    def all(self) -> list[StoredJob]:
        """Every stored job, newest first."""
        if not self.folder.is_dir():
            return []
        jobs = []
        for path in sorted(self.folder.glob("job-*.json"), reverse=True):
            with contextlib.suppress(InputError):
                if (job := self.read(path.stem)) is not None:
                    jobs.append(job)
        return jobs

    def holder_of(self, task: str) -> StoredJob | None:
        """The running job (its runner alive) working on the task record `task`, if any."""
        return next(
            (j for j in self.all() if j.task == task and not j.finished and is_runner(j, self.workspace)),
            None,
        )

    def forget_old(self) -> None:
        finished = [j for j in self.all() if j.finished]
        for job in finished[KEPT_JOBS:]:
            self.path(job.job_id).unlink(missing_ok=True)
            self.log_path(job.job_id).unlink(missing_ok=True)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        self.folder.mkdir(parents=True, exist_ok=True)
        with open_lock_file(self.folder / ".store.lock") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)


class ExclusiveLock:
    """The turn of tools that write or run a model, across every process on a workspace."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._handle: Any = None

    def acquire(
        self,
        job_id: str,
        tool: str,
        cancelled: Callable[[], bool],
        on_wait: Callable[[str], None],
        poll_seconds: float = 0.1,
    ) -> bool:
        """Block until this process holds the turn (whether it had to wait); False if `cancelled()`
        became true first. `on_wait(message)` is told for whom it waits, each time that changes."""
        self.folder.mkdir(parents=True, exist_ok=True)
        handle = open_lock_file(self.folder / "exclusive.lock")  # held until release()
        shown = None
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if cancelled():
                    handle.close()
                    return False
                holder = self._holder()
                if holder != shown:
                    shown = holder
                    on_wait(
                        f"waiting for {holder['tool']} (job {holder['job_id']}) to finish"
                        if holder
                        else "waiting for another job that writes or runs a model to finish"
                    )
                time.sleep(poll_seconds)
        self._handle = handle
        atomic_write_text(
            self.folder / "exclusive.holder", json.dumps({"job_id": job_id, "tool": tool, "pid": os.getpid()})
        )
        return True

    def release(self) -> None:
        if self._handle is None:
            return
        with contextlib.suppress(OSError):
            (self.folder / "exclusive.holder").unlink()
        fcntl.flock(self._handle, fcntl.LOCK_UN)
        self._handle.close()
        self._handle = None

    def _holder(self) -> dict[str, Any] | None:
        try:
            holder = json.loads((self.folder / "exclusive.holder").read_text())
        except (OSError, ValueError):
            return None
        return holder if isinstance(holder, dict) and {"job_id", "tool"} <= set(holder) else None
