"""The weights of modules a backend now serves, moved out of memory into a file mapping.

Once a candidate is spliced its PyTorch weights only serve fallbacks, yet they stay in memory
beside the session that holds the same weights again: for a full-scale video model the
spliced pass held both copies, gigabytes above the eager pass. Paged out, the tensors keep
their values and stay usable (a fallback reads them back from the page cache, page by page),
but the pages are the file's, not the process's, and no page is resident until something
reads it.

Storages are written byte for byte and every tensor is rebuilt as the same view of its
storage's mapped bytes, so tensors that shared memory still share it: tied weights, slices of
one buffer, and views of one buffer as another dtype (a complex rotary table and its real
view), which `torch.save` refuses.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

import torch
from torch import nn

# Each storage starts on this boundary in the file, so a view of any dtype is aligned.
_ALIGN = 64


def page_out(modules: Iterable[nn.Module], folder: Path) -> int:
    """Every CPU parameter and buffer of `modules` replaced by the same values read through a
    private mapping of a file written in `folder` (its name is unlinked at once: the mapping keeps
    the data until the tensors go). A parameter tied in several places stays one parameter.
    Returns the bytes paged out."""
    folder.mkdir(parents=True, exist_ok=True)
    moved = 0
    for index, module in enumerate(_distinct(modules)):
        slots = [
            (owner, table, name, value)
            for owner in module.modules()
            for table in (owner._parameters, owner._buffers)
            for name, value in table.items()
            if _pageable(value)
        ]
        if not slots:
            continue
        originals = {id(value): value.detach() for _, _, _, value in slots}
        mapped, nbytes = _mapped_copies(originals, folder / f".paged-weights-{os.getpid()}-{index}.bin")
        replaced: dict[int, torch.Tensor] = {}
        for _, table, name, value in slots:
            if id(value) not in replaced:
                data = mapped[id(value)]
                replaced[id(value)] = (
                    nn.Parameter(data, value.requires_grad) if isinstance(value, nn.Parameter) else data
                )
            table[name] = replaced[id(value)]
        moved += nbytes
    return moved


def _pageable(value: object) -> bool:
    return (
        isinstance(value, torch.Tensor)
        and value.device.type == "cpu"
        and value.layout == torch.strided
        and value.untyped_storage().nbytes() > 0
    )


def _mapped_copies(state: dict[int, torch.Tensor], path: Path) -> tuple[dict[int, torch.Tensor], int]:
    """`state`'s storages written to `path` and mapped back privately; each tensor the same view
    of its storage's mapped bytes. Returns the tensors and the bytes of their distinct storages."""
    offsets: dict[int, int] = {}  # a storage's data pointer -> where its bytes start in the file
    end = 0
    try:
        with path.open("wb") as handle:
            for tensor in state.values():
                storage = tensor.untyped_storage()
                if storage.data_ptr() in offsets:
                    continue
                offsets[storage.data_ptr()] = end
                handle.seek(end)
                handle.write(memoryview(torch.tensor([], dtype=torch.uint8).set_(storage).numpy()))
                end = -(-(end + storage.nbytes()) // _ALIGN) * _ALIGN
            handle.truncate(end)
        file_bytes = torch.from_file(str(path), shared=False, size=end, dtype=torch.uint8)
    finally:
        path.unlink(missing_ok=True)
    mapped = {}
    for name, tensor in state.items():
        start = offsets[tensor.untyped_storage().data_ptr()]
        typed = file_bytes[start:].view(tensor.dtype)  # start and the file's end are both aligned
        mapped[name] = typed.as_strided(
            tensor.size(), tensor.stride(), typed.storage_offset() + tensor.storage_offset()
        )
    nbytes = sum(t.untyped_storage().nbytes() for t in _distinct_storages(state.values()))
    return mapped, nbytes


def _distinct(modules: Iterable[nn.Module]) -> list[nn.Module]:
    """`modules` without repeats and without any that sits inside another of them."""
    chosen = list({id(m): m for m in modules}.values())
    inside = {id(sub) for m in chosen for sub in m.modules() if sub is not m}
    return [m for m in chosen if id(m) not in inside]


def _distinct_storages(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    by_storage = {t.untyped_storage().data_ptr(): t for t in tensors}
    return list(by_storage.values())
