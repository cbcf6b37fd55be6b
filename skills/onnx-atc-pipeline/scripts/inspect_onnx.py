"""Tool: summarise an ONNX file (I/O and symbolic dims, opsets, IR version, operator
histogram, size, external data) without loading its weights."""

from __future__ import annotations

from typing import Annotated

from omskills.host.toolkit import WorkspacePath, tool_hints
from omskills.records.toolchain import OnnxSummary
from pydantic import Field


@tool_hints(title="Inspect an ONNX file", read_only=True)
def inspect_onnx(path: Annotated[WorkspacePath, Field(description="The .onnx file to summarise.")]) -> OnnxSummary:
    """Summarise an ONNX model without loading its weights: inputs/outputs with shapes (symbolic
    dims by name), opsets, IR version, operator histogram, node count, file size and external data
    files.

    Use it after export and after each optimisation to see what ATC will receive."""
    from omskills.onnxfiles.inspect import inspect_onnx as _inspect_onnx

    return _inspect_onnx(path)


if __name__ == "__main__":
    import sys

    from omskills.host.toolkit import run_cli

    sys.exit(run_cli(inspect_onnx))
