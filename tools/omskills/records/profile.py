"""Main-path profile: the nn.Module call tree with call counts and wall time (stage 1)."""

from __future__ import annotations

from typing import Annotated

from omskills.records.base import Record
from omskills.records.details import DETAIL
from pydantic import Field


class ModuleProfile(Record):
    """One module path, aggregated over every call on the main path.

    `parent` is the module whose forward was running when this one was called most often
    (the dynamic caller), None when it was called from plain Python (the control plane).
    Inclusive time counts only outermost calls of a path, so a module that calls itself is
    not counted twice; exclusive time is inclusive minus the inclusive time of the hooked
    modules it called directly.
    """

    path: str  # dotted path from the profiled root, "" for the root itself
    parent: str | None
    module_class: str
    depth: int  # number of dotted components, 0 for the root
    params_own: int
    params_total: int
    calls: int
    calls_per_frame: float | None = None
    calls_per_prompt: float | None = None
    frames_called: int = 0  # steps (between mark_frame calls) in which it ran at least once
    inclusive_s: float
    exclusive_s: float
    share: float  # inclusive_s / total_seconds
    exclusive_share: float  # exclusive_s / total_seconds


class ProfileReport(Record):
    total_seconds: float  # wall time around the whole run (modules + Python control plane)
    module_seconds: float  # inclusive time of top-level module calls (those not inside another hooked module)
    frames: int
    prompts: int
    modules_total: int  # modules under the root
    modules_called: int
    nodes: Annotated[list[ModuleProfile], DETAIL]
    # Nodes left out to keep the report bounded (small share beyond `kept_depth`), and their time,
    # so that sum(exclusive_s of nodes) + dropped_exclusive_s == module_seconds.
    dropped_nodes: int = 0
    dropped_exclusive_s: float = 0.0
    min_share: float = 0.001
    kept_depth: int = 3
    notes: list[str] = Field(default_factory=list)

    @property
    def control_plane_seconds(self) -> float:
        """Wall time outside any hooked module: Python control plane, I/O, pre/post-processing."""
        return max(0.0, self.total_seconds - self.module_seconds)

    def node(self, path: str) -> ModuleProfile | None:
        return next((n for n in self.nodes if n.path == path), None)

    def subtree_share(self, path: str) -> float:
        """Inclusive share of a path (0 when it was not called or was dropped)."""
        node = self.node(path)
        return node.share if node else 0.0
