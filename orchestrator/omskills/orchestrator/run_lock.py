"""One owner per run folder: `omskills adapt` holds a lock file there for as long as it runs.

The lock is an exclusive `flock` on `<run>/.omskills-adapt.lock`, which also holds the owner's pid,
host, start time and command line (JSON). The kernel drops a flock when its process dies, however
it dies, so a lock is never left held by a dead process; a file still naming a pid that no longer
runs (a crash, `kill -9`) is taken over with a line saying so. A second `adapt` on a held folder is
refused with the owner's pid and start time.

It also tells the processes the run starts (the MCP server) which folders outside the run the
record may name files in: the folder of the task record the user gave, and a `--source` checkout.
"""

from __future__ import annotations

import atexit
import datetime as _dt
import fcntl
import json
import os
import socket
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from omskills.errors import InputError
from omskills.files import open_lock_file, process_alive
from omskills.records.intake import INPUT_ROOTS_ENV

LOCK_NAME = ".omskills-adapt.lock"


@dataclass
class RunLock:
    """The held lock: the open file (its flock lives as long as it stays open) and the run folder."""

    folder: Path
    handle: IO[str]

    def release(self) -> None:
        if not self.handle.closed:
            self.handle.truncate(0)  # a clean exit leaves no owner behind
            self.handle.close()


_held: list[RunLock] = []  # kept for the life of the process: closing the file would drop the flock


def _owner(text: str) -> dict:
    try:
        owner = json.loads(text)
    except json.JSONDecodeError:
        return {}
    return owner if isinstance(owner, dict) else {}


def claim_run_folder(folder: Path, inputs_from: tuple[str | Path | None, ...] = ()) -> RunLock:
    """Create the run folder if needed and own it for the life of this process; refuse when another
    process owns it. `inputs_from`: folders (or files, whose folder counts) outside the run the
    record may name inputs in, passed to the processes this one starts through $OMSKILLS_INPUT_ROOTS."""
    if folder.exists() and not folder.is_dir():
        raise InputError(f"--out: {folder} is a file, not a run folder")
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / LOCK_NAME
    handle = open_lock_file(path)  # stays open: the flock lives with the file
    try:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        owner = _owner(handle.read())
        handle.close()
        raise InputError(
            f"run folder {folder} is in use by omskills adapt (pid {owner.get('pid', '?')} on "
            f"{owner.get('host', '?')}, since {owner.get('since', '?')}); wait for it or stop it"
        ) from None
    handle.seek(0)
    previous = _owner(handle.read())
    if previous.get("pid") is not None:
        state = (
            "still running, without the lock"
            if process_alive(previous["pid"]) and previous.get("host") == socket.gethostname()
            else "no longer running"
        )
        print(
            f"omskills: taking over run folder {folder} from pid {previous['pid']} ({state}; since "
            f"{previous.get('since', '?')})",
            file=sys.stderr,
        )
    handle.seek(0)
    handle.truncate(0)
    handle.write(
        json.dumps(
            {
                "pid": os.getpid(),
                "host": socket.gethostname(),
                "since": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
                "command": " ".join(sys.argv),
            }
        )
    )
    handle.flush()
    lock = RunLock(folder=folder, handle=handle)
    _held.append(lock)
    atexit.register(lock.release)  # a clean exit leaves no owner; a killed one leaves its pid to take over from
    _allow_inputs(inputs_from)
    return lock


def _allow_inputs(inputs_from: tuple[str | Path | None, ...]) -> None:
    roots = [r for r in os.environ.get(INPUT_ROOTS_ENV, "").split(os.pathsep) if r]
    for given in inputs_from:
        if not given or str(given) == "package":
            continue
        path = Path(given).expanduser().resolve()
        root = str(path if path.is_dir() else path.parent)
        if root not in roots:
            roots.append(root)
    if roots:
        os.environ[INPUT_ROOTS_ENV] = os.pathsep.join(roots)
