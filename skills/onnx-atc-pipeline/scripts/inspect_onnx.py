"""Tool: summarise an ONNX file (I/O and symbolic dims, opsets, IR version, operator
histogram, size, external data) without loading its weights."""

from __future__ import annotations

from omskills.convert.inspect import inspect_onnx as _inspect_onnx
from omskills.records.toolchain import OnnxSummary


def inspect_onnx(path: str) -> OnnxSummary:
    """Summarise the ONNX model at `path`: inputs/outputs with shapes (symbolic dims by name),
    opsets, IR version, operator histogram, node count, file size and external data files.
    Use it after export and after each optimisation to see what ATC will receive."""
    return _inspect_onnx(path)


if __name__ == "__main__":
    import sys

    from omskills.host.toolkit import run_cli

    sys.exit(run_cli(inspect_onnx))
