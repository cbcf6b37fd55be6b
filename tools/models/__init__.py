"""Model-family drivers. A new model is a task record plus a small driver registered here."""

from __future__ import annotations

from omskills.models.api import FrameResult, LoadedModel, MainPathResult, ModelDriver, ProvenanceSource, SeedCandidate


def get_driver(family: str) -> ModelDriver:
    if family == "sam3":
        from omskills.models.sam3 import Sam3Driver

        return Sam3Driver()
    if family == "sam3.1":
        from omskills.models.sam31 import Sam31Driver  # type: ignore[import-not-found]

        return Sam31Driver()
    from omskills.errors import TaskRecordError

    raise TaskRecordError(f"intake.model.family: no driver for {family!r}")


__all__ = ["get_driver", "LoadedModel", "MainPathResult", "ModelDriver", "FrameResult", "SeedCandidate", "ProvenanceSource"]
