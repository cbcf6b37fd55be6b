"""The weights of modules a backend now serves, moved out of memory into a file mapping.

Once a candidate is spliced its PyTorch weights only serve fallbacks, yet they stay in memory
beside the session that holds the same weights again: for a full-scale video model the
spliced pass held both copies, gigabytes above the eager pass. Paged out, the tensors keep
their values and stay usable (a fallback reads them back from the page cache, page by page),
but the pages are the file's, not the process's, and no page is resident until something
reads it.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

import torch
from torch import nn


def page_out(modules: Iterable[nn.Module], folder: Path) -> int:
    """Every CPU parameter and persistent buffer of `modules` replaced by the same values read
    through a private mapping of a file written in `folder` (its name is unlinked at once: the
    mapping keeps the data until the tensors go). Returns the bytes paged out."""
    folder.mkdir(parents=True, exist_ok=True)
    moved = 0
    for index, module in enumerate(_distinct(modules)):
        state = {name: value.detach() for name, value in module.state_dict(keep_vars=True).items()
                 if isinstance(value, torch.Tensor) and value.device.type == "cpu" and value.layout == torch.strided}
        if not state:
            continue
        path = folder / f".paged-weights-{os.getpid()}-{index}.pt"
        try:
            torch.save(state, path)
            mapped = torch.load(path, mmap=True, weights_only=True)
        finally:
            path.unlink(missing_ok=True)
        module.load_state_dict(mapped, strict=False, assign=True)
        moved += sum(t.untyped_storage().nbytes() for t in _distinct_storages(state.values()))
    return moved


def _distinct(modules: Iterable[nn.Module]) -> list[nn.Module]:
    """`modules` without repeats and without any that sits inside another of them."""
    chosen = list({id(m): m for m in modules}.values())
    inside = {id(sub) for m in chosen for sub in m.modules() if sub is not m}
    return [m for m in chosen if id(m) not in inside]


def _distinct_storages(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    by_storage = {t.untyped_storage().data_ptr(): t for t in tensors}
    return list(by_storage.values())
