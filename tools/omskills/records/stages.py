"""Bookkeeping shared by every stage: status, input fingerprint, artefacts, errors."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from omskills.files import file_state, quick_digest, sha256_cached
from omskills.records.base import Record
from omskills.records.details import DETAIL
from omskills.records.names import RunPath
from omskills.run_folder import RunFolder
from pydantic import Field

StageStatus = Literal["pending", "running", "done", "failed", "not_run"]


class Artifact(Record):
    """A file a step wrote, as it wrote it: a rerun checks it before reusing the step's result."""

    path: RunPath  # relative to the run folder (the record's folder)
    sha256: str | None = None
    bytes: int | None = None
    # With the size, the fast check that the file is untouched; the sha256 decides when either moved
    # (a copied run folder has new mtimes). None in records written before artefacts were checked.
    mtime_ns: int | None = None
    # Size and the first and last MiB, hashed (`files.quick_digest`): checked even when size and
    # mtime agree, which a tool that restores timestamps keeps. None in older records.
    quick: str | None = None

    @classmethod
    def of(cls, path: Path, root: Path) -> Artifact:
        """The file at `path` (inside the run folder `root`) as it is now."""
        size, mtime = file_state(path)
        return cls(
            path=RunFolder(root).stored(path),
            sha256=sha256_cached(path),
            bytes=size,
            mtime_ns=mtime,
            quick=quick_digest(path),
        )

    def problem(self, root: Path) -> str | None:
        """Why the file is not the one the step wrote (None: it is, or nothing was recorded to tell)."""
        path = root / self.path
        if not path.is_file():
            return f"{self.path} is missing"
        if self.mtime_ns is None or self.sha256 is None:  # written before files were checked: present is all we know
            return None
        size, mtime = file_state(path)
        if (size, mtime) == (self.bytes, self.mtime_ns):
            if self.quick is not None and quick_digest(path) != self.quick:
                return f"{self.path} changed on disk (same size and time, other bytes)"
            return None
        if size != self.bytes:
            return f"{self.path} changed on disk ({self.bytes} bytes recorded, {size} now)"
        if sha256_cached(path) != self.sha256:
            return f"{self.path} changed on disk (sha256 differs from the record)"
        return None


class StageResult(Record):
    status: StageStatus = "pending"
    # Hash of everything the step read; a rerun skips the step when it is unchanged.
    inputs_hash: str | None = None
    started: str | None = None
    seconds: float | None = None
    artifacts: Annotated[list[Artifact], DETAIL] = Field(default_factory=list)
    logs: list[RunPath] = Field(default_factory=list)
    error: str | None = None
    note: str | None = None
    # The process running the step (while it is `running`): a reader tells a step whose process is
    # gone, killed or out of disk before it could record the end, from one still at work
    # (`records.step_owner`). With the pid, that process's start time (seconds since the epoch: a
    # later process given the same pid is not taken for it) and the host it runs on (a process on
    # another host is not judged). None in records written before they were kept.
    pid: int | None = None
    pid_started: float | None = None
    host: str | None = None


class Decision(Record):
    """Why something was decided: a short record with the evidence (who: tool or agent)."""

    at: str
    by: str
    what: str
    why: str
