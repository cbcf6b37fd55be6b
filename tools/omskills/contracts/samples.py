"""Real input/output samples of a candidate call, stored as npz for the probes of stage 3.

Keys are the contract's tensor names prefixed "in:" / "out:", in flat order. numpy has no bfloat16
(and no other torch-only dtypes), so such tensors are stored as raw bits in an integer array of the
same width and the torch dtype is written to the "meta" entry: loading gives back the exact bits.
The file holds no pickled objects (np.load with allow_pickle=False reads it).
"""

from __future__ import annotations

import json
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from omskills.errors import InputError

if TYPE_CHECKING:
    import torch

# torch is imported where a tensor is made or read: a child process that only runs ONNX Runtime on
# a sample (probes, variant checks, emulation) reads it with numpy and starts seconds sooner.

INPUT_PREFIX = "in:"
OUTPUT_PREFIX = "out:"
META_KEY = "meta"


# torch dtypes numpy lacks -> the integer dtype of the same width their bits are stored as.
_BITS_AS = {
    "bfloat16": "int16",
    "float8_e4m3fn": "int8",
    "float8_e5m2": "int8",
    "uint16": "int16",
    "uint32": "int32",
    "uint64": "int64",
}


def _bits_as() -> dict[torch.dtype, torch.dtype]:
    import torch

    return {getattr(torch, name): getattr(torch, bits) for name, bits in _BITS_AS.items()}


@dataclass(frozen=True)
class Sample:
    inputs: dict[str, torch.Tensor]
    outputs: dict[str, torch.Tensor]
    candidate: str
    call_index: int


def _to_numpy(tensor: torch.Tensor) -> np.ndarray:
    tensor = tensor.detach().cpu().contiguous()
    bits_as = _bits_as()
    if tensor.dtype in bits_as:
        tensor = tensor.view(bits_as[tensor.dtype])
    return tensor.numpy()


def _from_numpy(array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    import torch

    tensor = torch.from_numpy(array.copy())
    return tensor.view(dtype) if tensor.dtype != dtype else tensor


def save_sample(
    path: Path,
    candidate: str,
    call_index: int,
    inputs: dict[str, torch.Tensor],
    outputs: dict[str, torch.Tensor],
) -> Path:
    """Write one call's tensors (already copied by the caller) to `path` (.npz), one array at a time:
    a sample of a large graph is gigabytes, and a second copy of all of it at once would be too."""
    dtypes = {
        prefix + name: str(tensor.dtype).removeprefix("torch.")
        for prefix, tensors in ((INPUT_PREFIX, inputs), (OUTPUT_PREFIX, outputs))
        for name, tensor in tensors.items()
    }
    meta = {"candidate": candidate, "call_index": call_index, "dtypes": dtypes}
    path.parent.mkdir(parents=True, exist_ok=True)
    # the layout np.savez writes (stored .npy entries), so np.load reads it
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as archive:
        for prefix, tensors in ((INPUT_PREFIX, inputs), (OUTPUT_PREFIX, outputs)):
            for name, tensor in tensors.items():
                _write_array(archive, prefix + name, _to_numpy(tensor))
        _write_array(archive, META_KEY, np.array(json.dumps(meta)))
    return path


def _write_array(archive: zipfile.ZipFile, key: str, array: np.ndarray) -> None:
    with archive.open(key + ".npy", "w", force_zip64=True) as entry:
        np.lib.format.write_array(entry, array, allow_pickle=False)


def load_sample(path: Path) -> Sample:
    """Read a sample written by `save_sample`, with the original torch dtypes and bits."""
    if not Path(path).is_file():
        raise InputError(f"sample file {path} does not exist")
    import torch

    with np.load(path, allow_pickle=False) as data:
        meta = json.loads(str(data[META_KEY]))
        inputs: dict[str, torch.Tensor] = {}
        outputs: dict[str, torch.Tensor] = {}
        for key, dtype in meta["dtypes"].items():
            tensor = _from_numpy(data[key], getattr(torch, dtype))
            if key.startswith(INPUT_PREFIX):
                inputs[key.removeprefix(INPUT_PREFIX)] = tensor
            else:
                outputs[key.removeprefix(OUTPUT_PREFIX)] = tensor
    return Sample(inputs=inputs, outputs=outputs, candidate=meta["candidate"], call_index=meta["call_index"])


def read_arrays(path: Path) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """A sample's inputs and outputs as numpy arrays (what ONNX Runtime is fed and compared with),
    read without torch where numpy has every dtype; a torch-only one (bfloat16) goes through
    `load_sample`, and numpy cannot hold it either."""
    if not Path(path).is_file():
        raise InputError(f"sample file {path} does not exist")
    with np.load(path, allow_pickle=False) as data:
        dtypes: dict[str, str] = json.loads(str(data[META_KEY]))["dtypes"]
        if any(dtype in _BITS_AS or not hasattr(np, dtype) for dtype in dtypes.values()):
            sample = load_sample(path)
            return {k: v.numpy() for k, v in sample.inputs.items()}, {k: v.numpy() for k, v in sample.outputs.items()}
        arrays: tuple[dict[str, np.ndarray], dict[str, np.ndarray]] = ({}, {})
        for key in dtypes:
            is_input = key.startswith(INPUT_PREFIX)
            name = key.removeprefix(INPUT_PREFIX if is_input else OUTPUT_PREFIX)
            arrays[0 if is_input else 1][name] = data[key]
        return arrays


def array_headers(path: Path) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """Every array's shape and dtype in a sample file, keys as stored ("in:x", "out:y"), read
    from the npz's array headers: no array is loaded."""
    headers = {}
    with zipfile.ZipFile(path) as archive:
        for member in archive.namelist():
            with archive.open(member) as handle:
                version = np.lib.format.read_magic(handle)
                read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
                shape, _, dtype = read(handle)
            headers[member.removesuffix(".npy")] = (tuple(shape), dtype)
    return headers


def input_shapes(path: Path) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """The shapes of a sample's inputs, from its array headers."""
    return tuple(
        sorted(
            (key.removeprefix(INPUT_PREFIX), shape)
            for key, (shape, _) in array_headers(path).items()
            if key.startswith(INPUT_PREFIX)
        )
    )


def one_per_shape(paths: list[Path]) -> list[Path]:
    """The first sample of each distinct set of input shapes: what a graph computes differently
    between calls of one shape is only the values, which one call already compares."""
    kept: dict[tuple, Path] = {}
    for path in paths:
        kept.setdefault(input_shapes(path), path)
    return list(kept.values())
