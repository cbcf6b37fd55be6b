"""Entry inventory of a model source (stage 1): what a user calls and what must be ported.

Produced by a static scan (`omskills.source.inventory.scan_source`) and completed by what the
device-portability layer saw at run time (`Inventory.merge_runtime_findings`). Every item
carries `file:line` evidence, files relative to the source root (the folder that holds the
model's Python package, e.g. `pkg/model/predictor.py`).
"""

from __future__ import annotations

from typing import Annotated, Literal

from omskills.records.base import Record
from omskills.records.details import DETAIL
from pydantic import Field

ControlPlaneCategory = Literal["tokenizer", "session_store", "frame_cache", "object_ids", "prompt_management"]


class PortabilityFinding(Record):
    """A place an accelerator port must touch: found by the static scan, seen at run time, or both.

    `kind` vocabulary (shared with the runtime layer in omskills.source.portability): cuda_call
    (`.cuda()`), device_cuda (`device="cuda"`, `torch.device("cuda")`, `.to("cuda")`),
    pin_memory, triton, flash_attention, autocast (CUDA autocast), cuda_query
    (`torch.cuda.*()` device queries and runtime calls), bf16_cast, pkg_resources.
    """

    file: str
    line: int
    kind: str
    detail: str
    seen_at_runtime: bool = False
    action: str | None = None  # what the portability layer did there at run time
    in_static_scan: bool = False  # found by the ast scan (False: only seen at run time)
    end_line: int | None = None  # last line of the statement, for matching runtime line numbers

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}"

    def covers(self, file: str, line: int) -> bool:
        """Whether a runtime site (file, line) falls on this finding's statement."""
        if not _same_file(self.file, file):
            return False
        return self.line <= line <= (self.end_line or self.line)


def _same_file(static_file: str, runtime_file: str) -> bool:
    # The runtime layer may report absolute paths; the scan reports paths relative to the root.
    return runtime_file == static_file or runtime_file.endswith("/" + static_file)


class BuilderFunction(Record):
    name: str
    signature: str  # e.g. "(checkpoint_path=None, load_from_HF=True, device='cuda')"
    parameters: list[str]
    file: str
    line: int


class RequestRoute(Record):
    """One request type a predictor's dispatcher handles, and the method it calls."""

    request_type: str
    dispatcher: str  # handle_request | handle_stream_request
    method: str | None  # e.g. "start_session"; None when the branch calls no method of the predictor
    file: str
    line: int


class PredictorClass(Record):
    name: str
    bases: list[str]
    file: str
    line: int
    dispatchers: list[str]  # which of handle_request / handle_stream_request it defines
    routes: list[RequestRoute] = Field(default_factory=list)
    # Dispatchers that hand the request to super() (the routes then come from the base class).
    delegates_to_base: list[str] = Field(default_factory=list)

    @property
    def request_types(self) -> list[str]:
        return [r.request_type for r in self.routes]


class ControlPlaneSite(Record):
    """Python-side machinery that stays outside any compiled artefact."""

    category: ControlPlaneCategory
    name: str  # class, function, attribute or state key
    kind: Literal["class", "function", "attribute", "state_key", "call"]
    file: str
    line: int  # first occurrence in this file
    occurrences: int = 1  # how often the name appears in this file
    detail: str = ""


class Inventory(Record):
    family: str
    source: str  # as configured in the task record ("package" or a path)
    source_root: str  # folder that holds the package (absolute)
    package: str
    builder: str
    builder_file: str
    # The files the scan started from: the builder's, then those defining the driver's entry classes
    # and classes seen at run time; files_scanned counts their import closure inside the package.
    scanned_from: list[str] = Field(default_factory=list)
    entry_methods: list[str] = Field(default_factory=list)  # the driver's, looked for
    entry_classes: list[str] = Field(default_factory=list)  # the driver's: the only class names reported
    files_scanned: int
    builders: Annotated[list[BuilderFunction], DETAIL]
    predictors: Annotated[list[PredictorClass], DETAIL]
    control_plane: Annotated[list[ControlPlaneSite], DETAIL]
    portability: Annotated[list[PortabilityFinding], DETAIL]
    unparsed_files: Annotated[list[str], DETAIL] = Field(
        default_factory=list
    )  # files ast could not parse (not scanned)

    def predictor(self, name: str) -> PredictorClass | None:
        return next((p for p in self.predictors if p.name == name), None)

    def control(self, category: ControlPlaneCategory) -> list[ControlPlaneSite]:
        return [c for c in self.control_plane if c.category == category]

    def merge_runtime_findings(self, findings: list[PortabilityFinding]) -> Inventory:
        """Mark static sites the portability layer touched; add runtime-only sites.

        A runtime site matches a static one in the same file when its line falls on the
        static statement; among several, the same kind on the same line wins. Returns self.
        """
        merged = list(self.portability)
        for seen in findings:
            match = _best_match(merged, seen)
            if match is None:
                merged.append(seen.model_copy(update={"seen_at_runtime": True, "in_static_scan": False}))
                continue
            index = merged.index(match)
            merged[index] = match.model_copy(update={"seen_at_runtime": True, "action": seen.action or seen.detail})
        self.portability = merged
        return self


def _best_match(static: list[PortabilityFinding], seen: PortabilityFinding) -> PortabilityFinding | None:
    covering = [f for f in static if f.in_static_scan and f.covers(seen.file, seen.line)]
    if not covering:
        return None

    def rank(f: PortabilityFinding) -> tuple[bool, bool]:
        return (f.kind == seen.kind, f.line == seen.line)

    return max(covering, key=rank)
