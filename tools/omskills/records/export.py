"""Records of exporting a candidate to ONNX (stage 3) and of splicing the compiled candidate
back into the live model (stage 4)."""

from __future__ import annotations

from typing import Annotated, Literal

from omskills.records.base import Record
from omskills.records.details import DETAIL
from omskills.records.names import RunPath
from pydantic import Field

ExporterName = Literal["dynamo", "legacy"]


class ExportResult(Record):
    """One ONNX export of a candidate through its contract wrapper."""

    path: RunPath  # the .onnx file
    exporter: ExporterName  # which exporter really ran
    # How the dynamo exporter captured the graph: "torch_export" (torch.onnx's own capture:
    # torch.export non-strict, then strict), or "compile_path" when that stopped on a
    # data-dependent guard and the model's own torch.compile branch was traced instead
    # (torch.compiler.is_dynamo_compiling() reporting True); None for the legacy exporter.
    capture: Literal["torch_export", "compile_path"] | None = None
    capture_reason: str | None = None  # why the compile path was needed (the guard that stopped)
    # aten ops translated by omskills.convert.translations instead of torchlib (dynamo exporter)
    custom_translations: list[str] = Field(default_factory=list)
    opset: int  # default-domain opset of the saved model
    # The exporter's own opset when it was above the requested one and onnx.version_converter
    # brought it down; None when no conversion ran.
    converted_from_opset: int | None = None
    seconds: float  # exporter run plus conversion and save
    bytes: int  # the .onnx file plus its external data file
    sha256: str  # of the .onnx file followed by its external data file (when there is one)
    external_data: bool  # weights in "<name>.onnx.data" next to the .onnx (models over 2 GB)
    log_path: RunPath  # everything the exporter printed or warned
    input_names: Annotated[list[str], DETAIL]  # graph inputs in order (an exporter may drop unused contract inputs)
    output_names: Annotated[list[str], DETAIL]
    fact_source: Annotated[str, DETAIL]  # where the opset limit we target comes from


# "backend": the call was within the contract but the backend raised (its one line is the reason).
FallbackKind = Literal["structure", "constant", "dtype", "shape", "autograd", "method", "backend"]


class FallbackEvent(Record):
    """A call a spliced module could not send to its backend, so PyTorch ran it instead."""

    candidate: str
    call: int  # 1-based index among the spliced module's calls
    kind: FallbackKind
    reason: str  # names the input, dim or constant that is outside the contract


class SpliceStats(Record):
    """What one spliced candidate did during a run."""

    candidate: str
    module_path: str
    backend_kind: str
    backend_device: str
    calls: int
    backend_calls: int
    fallbacks: int
    memo_hits: int = 0  # calls answered from memory: the same inputs as an earlier call (splicing.memo)
    merged_hits: int = 0  # calls answered inside another graph's call by their merged graph (splicing.splice)
    # Outputs the study saw no host code read, left on the device, that were read after all: each
    # copied back then (splicing.unfetched), the study's view of the host's reads being wrong.
    held_outputs_read: int = 0
    fallback_kinds: dict[FallbackKind, int] = Field(default_factory=dict)  # kind -> count
    fallback_reasons: list[str] = Field(default_factory=list)  # distinct reasons, first seen first
    total_backend_seconds: float = 0.0  # feeds conversion + backend run + output rebuild
    mean_backend_seconds: float | None = None  # None when the backend never ran
