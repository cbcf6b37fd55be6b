"""Digests of how host code computed a tensor from graph outputs (a recipe), one definition for both
sides: the capture that saw the glue between two graphs (`boundary.glue`) and the deployment that
answers a widened graph's later call only when the host computed its inputs the same way
(`splicing.unfetched`).

A graph output's digest names the graph and the output; an operation's digest names the operation,
which of its results it is, and the digests of what it took: other recipes, the values of tensors no
graph made or made before (slots, by dtype and shape: their values are checked apart), and Python
arguments by their repr. Equal digests and equal constant slots, equal computations.
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

RECIPE_RECURSION = 60_000
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
        # Flat first: a 0-d tensor (a step's scalar) cannot be viewed as bytes of another size.
        raw = data.reshape(-1).view(torch.uint8).numpy().tobytes() if data.numel() else b""
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
    # Lists, not generators: a recipe of thousands of operations recurses that deep, in Python frames only.
    if isinstance(value, (list, tuple)):
        return "[" + ",".join([canonical(v, leaf) for v in value]) + "]"
    if isinstance(value, dict):
        return "{" + ",".join([f"{k}={canonical(v, leaf)}" for k, v in sorted(value.items())]) + "}"
    return python_argument(value)


@contextmanager
def deep_recipes() -> Iterator[None]:
    """Room for a recipe's digest to recurse through every operation it took (a detector's NMS loop
    makes recipes of over a thousand operations, a few Python frames each)."""
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, RECIPE_RECURSION))
    try:
        yield
    finally:
        sys.setrecursionlimit(limit)


def _short(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()[:16]


def slot_digest(dtype: torch.dtype, shape: tuple[int, ...]) -> str:
    """Something a recipe rests on that the producer did not make (a constant, an input, an earlier
    value), by its dtype and shape: whether its values match is checked apart."""
    return f"slot:{dtype}{list(shape)}"
