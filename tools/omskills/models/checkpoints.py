"""Checkpoints: a state dict's keys read cheaply, a state dict loaded, every problem one line.

torch.load on a file that is not a checkpoint raises UnpicklingError, RuntimeError, EOFError or
others with multi-line texts, and `load_state_dict(strict=True)` lists every key in one
exception (tens of KB at full scale); here each becomes one InputError naming
`intake.model.checkpoint`, with the key mismatch counted and a few names shown.
"""

from __future__ import annotations

import contextlib
import warnings
import zipfile
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

from omskills.errors import InputError, one_line

CHECKPOINT_FIELD = "intake.model.checkpoint"
# Keys a checkpoint file may hold its state dict under ({"model": {...}}, Lightning's "state_dict").
STATE_WRAPPERS: tuple[str, ...] = ("state_dict", "model")
NAMES_SHOWN = 3


def _first_sentence(err: BaseException) -> str:
    """The message's first sentence, without the type name (the caller names the type)."""
    return one_line(str(err) or type(err).__name__, 200).split(". ")[0]


def read_state_dict(path: Path, device: str = "cpu", wrappers: tuple[str, ...] = STATE_WRAPPERS) -> dict[str, Any]:
    """The state dict in `path`. A zip-format checkpoint (torch.save's default) is memory-mapped,
    so reading only its keys costs no more than its index."""
    import torch

    if not path.is_file():
        raise InputError(f"{CHECKPOINT_FIELD}: checkpoint file not found: {path}")
    try:
        with warnings.catch_warnings():  # a file that is no checkpoint warns before it fails: the error says it
            warnings.simplefilter("ignore")
            state = torch.load(path, map_location=device, weights_only=True, mmap=zipfile.is_zipfile(path))
    except Exception as err:  # noqa: BLE001 - torch.load raises many types for a file that is no checkpoint
        raise InputError(
            f"{CHECKPOINT_FIELD}: {path} is not a loadable state dict ({type(err).__name__}: {_first_sentence(err)})"
        ) from None
    if isinstance(state, dict):
        wrapped = next((state[k] for k in wrappers if isinstance(state.get(k), dict)), None)
        state = wrapped if wrapped is not None else state
    if not isinstance(state, dict) or not all(isinstance(k, str) for k in state):
        raise InputError(
            f"{CHECKPOINT_FIELD}: {path} holds a {type(state).__name__}, not a state dict of named tensors"
        )
    return state


def key_mismatch(expected: Collection[str], found: Collection[str]) -> str | None:
    """The difference of two key sets in one line (counts and the first few names), None if equal."""
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    if not missing and not unexpected:
        return None
    parts = []
    if missing:
        parts.append(f"{len(missing)} missing key(s) (e.g. {', '.join(missing[:NAMES_SHOWN])})")
    if unexpected:
        parts.append(f"{len(unexpected)} unexpected key(s) (e.g. {', '.join(unexpected[:NAMES_SHOWN])})")
    return ", ".join(parts)


def load_state_dict(
    root: Any, checkpoint: Path, device: str, strict: bool = True, wrappers: tuple[str, ...] = STATE_WRAPPERS
) -> None:
    """A checkpoint's state dict into `root`, with one-line errors naming the field and the path."""
    state = read_state_dict(Path(checkpoint), device, wrappers)
    mismatch = key_mismatch(root.state_dict().keys(), state.keys())
    if mismatch and strict:
        raise InputError(f"{CHECKPOINT_FIELD}: {checkpoint} does not fit the model: {mismatch}")
    try:
        root.load_state_dict(state, strict=strict)
    except RuntimeError as err:  # shapes that differ: torch lists them all, one per line
        problems = [line.strip() for line in str(err).splitlines()[1:] if line.strip()]
        shown = problems[0][:200] if problems else one_line(err, 200)
        raise InputError(
            f"{CHECKPOINT_FIELD}: {checkpoint} does not fit the model: {len(problems) or 1} problem(s), first: {shown}"
        ) from None


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Inside, each parameter a module registers moves at once to the meta device: the model's
    structure and state-dict keys without memory for its weights (one parameter at a time exists
    for real). Other tensors stay real, so building code that reads values (`linspace(...).item()`)
    still runs, which a `torch.device("meta")` context would break."""
    import torch

    register = torch.nn.Module.register_parameter

    def register_on_meta(module: torch.nn.Module, name: str, param: torch.nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    with mock.patch.object(torch.nn.Module, "register_parameter", register_on_meta):
        yield
