"""Digests of how host code computed a tensor from graph outputs (a recipe), one definition for both
sides: the capture that saw the glue between two graphs (`boundary.glue`) and the deployment that
answers a widened graph's later call only when the host computed its inputs the same way
(`splicing.unfetched`).

A graph output's digest names the graph and the output; an operation's digest names the operation,
which of its results it is, and the digests of what it took: other recipes, the values of tensors no
graph made, and Python arguments by their repr. Equal digests, equal computations.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

import torch

PLAIN_ARGUMENTS = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)


def output_digest(graph: str, output: str) -> str:
    return _short(f"out:{graph}/{output}")


def op_digest(name: str, position: int, arguments: str) -> str:
    """An operation `name`'s result number `position`, given its arguments' canonical text."""
    return _short(f"{name}#{position}({arguments})")


def value_digest(tensor: torch.Tensor) -> str:
    """A tensor no graph made, by its dtype, shape and values."""
    with torch._C.DisableTorchFunctionSubclass():
        data = tensor.detach().cpu().contiguous()
        raw = data.view(torch.uint8).numpy().tobytes() if data.numel() else b""
    return "value:" + hashlib.sha1(f"{data.dtype}{tuple(data.shape)}".encode() + raw).hexdigest()[:16]


def python_argument(value: Any) -> str:
    """A Python argument's canonical text; an object of another kind by its type (never equal to a value)."""
    if isinstance(value, PLAIN_ARGUMENTS) or value is Ellipsis:
        return repr(value)
    if isinstance(value, slice):
        return f"slice({python_argument(value.start)},{python_argument(value.stop)},{python_argument(value.step)})"
    return f"<{type(value).__qualname__}>"


def canonical(value: Any, leaf: Callable[[Any], str | None]) -> str:
    """The canonical text of an operation's arguments; `leaf` gives the digest of what stands for a
    tensor (a tensor, or a recording's reference to one), None for anything else."""
    found = leaf(value)
    if found is not None:
        return found
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(canonical(v, leaf) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}={canonical(v, leaf)}" for k, v in sorted(value.items())) + "}"
    return python_argument(value)


def _short(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()[:16]
