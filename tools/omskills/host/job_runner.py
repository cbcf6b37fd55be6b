"""Run one started job in a process of its own: `python -m omskills.host.job_runner WORKSPACE JOB_ID`.

The server that started the job may be gone by the time it ends (see host.job_store): this
process finds the tool where the server did, runs it with the stored arguments, writes its
progress and its end to the job's file, and takes the workspace's turn for tools that write or
run a model. SIGTERM (a `cancel_job` from any server) sets the job's cancel flag: the engine stops
at its next progress point and the step it was in is recorded as cancelled.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

from omskills import progress
from omskills.errors import OmskillsError, one_line
from omskills.host.job_store import ExclusiveLock, JobStore, StoredJob

# Progress is written at most this often (a tool may report many times a second).
_WRITE_SECONDS = 0.5


class _Reporter:
    def __init__(self, store: JobStore, job_id: str) -> None:
        self.store, self.job_id = store, job_id
        self.last_write = 0.0
        self.pending: tuple[float | None, float | None, str] | None = None

    def __call__(self, done: float | None, total: float | None, message: str) -> None:
        self.pending = (done, total, message)
        if time.monotonic() - self.last_write >= _WRITE_SECONDS:
            self.flush()

    def flush(self) -> None:
        if self.pending is None:
            return
        done, total, message = self.pending
        self.pending = None
        self.last_write = time.monotonic()

        def change(job: StoredJob) -> None:
            job.progress = job.progress.model_copy(update={"done": done, "total": total, "message": message})
            job.reports += 1

        self.store.update(self.job_id, change)


def run(workspace: Path, job_id: str) -> int:
    from omskills.host.toolkit import argument_problems, discover_tools, to_jsonable

    cancel = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: cancel.set())
    signal.signal(signal.SIGINT, lambda *_: cancel.set())
    store = JobStore(workspace)

    def ready(stored: StoredJob) -> None:
        stored.ready = True

    job = store.update(job_id, ready)
    if job is None:
        print(f"job_runner: no job {job_id} in {store.folder}", file=sys.stderr)
        return 2
    if job.cancel_requested:  # asked before this process could catch the signal
        cancel.set()
    reporter = _Reporter(store, job_id)
    lock = ExclusiveLock(store.folder)

    def end(state: str, *, result: object = None, error: str | None = None) -> None:
        reporter.flush()

        def change(stored: StoredJob) -> None:
            stored.state, stored.result, stored.error, stored.ended_at = state, result, error, time.time()

        store.update(job_id, change)

    try:
        if job.exclusive and not lock.acquire(job_id, job.tool, cancel.is_set, lambda m: reporter(None, None, m)):
            end("cancelled", error=f"{job.tool} cancelled: cancelled while waiting for its turn")
            return 0
        reporter(None, None, "started")
        info = discover_tools(Path(job.skills_dir)).get(job.tool)
        arguments, problems = argument_problems(info.func, job.arguments)
        if problems:
            raise OmskillsError("\n".join(problems))
        with progress.reporting_to(reporter), progress.cancellable(cancel):
            progress.check_cancelled()
            outcome = info.func(**arguments)
        value = to_jsonable(outcome)
        end("succeeded", result=value if isinstance(value, dict) else {"value": value})
    except progress.Cancelled as err:
        end("cancelled", error=f"{job.tool} cancelled: {err}")
    except BaseException as err:  # noqa: BLE001 - whatever the tool does, the job ends with its reason
        end("failed", error=one_line(err))
    finally:
        lock.release()
    return 0


def main() -> None:
    if len(sys.argv) != 3:
        sys.exit("usage: python -m omskills.host.job_runner WORKSPACE JOB_ID")
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(run(Path(sys.argv[1]), sys.argv[2]))


if __name__ == "__main__":
    main()
