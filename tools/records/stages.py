"""Bookkeeping shared by every stage: status, input fingerprint, artefacts, errors."""

from __future__ import annotations

from typing import Literal

from omskills.records.base import Record
from pydantic import Field

StageStatus = Literal["pending", "running", "done", "failed", "not_run"]


class Artifact(Record):
    path: str
    sha256: str | None = None
    bytes: int | None = None


class StageResult(Record):
    status: StageStatus = "pending"
    # Hash of everything the step read; a rerun skips the step when it is unchanged.
    inputs_hash: str | None = None
    started: str | None = None
    finished: str | None = None
    seconds: float | None = None
    artifacts: list[Artifact] = Field(default_factory=list)
    logs: list[str] = Field(default_factory=list)
    error: str | None = None
    note: str | None = None


class Decision(Record):
    """Why something was decided: a short record with the evidence (who: tool or agent)."""

    at: str
    by: str
    what: str
    why: str
