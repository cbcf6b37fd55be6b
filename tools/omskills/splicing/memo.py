"""Graph calls answered from memory. A compiled graph is a function of its inputs alone, so a call
whose inputs repeat (a text encoder on the same prompt, once per video) need not run again.

Only graphs fed from user inputs alone are remembered (every contract input's provenance is
"input": prompt tokens, not activations), and only small calls: the inputs are digested on every
call, which must cost nothing beside the call, and a remembered call's outputs stay in memory.
Outputs computed ahead (`omskills bundle --precompute`) are saved with `save_entries` and given
back to a deployed model's memory with `OutputMemo.preload`, where no later call evicts them.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path

import numpy as np
from omskills.records.contracts import ContractSpec

# One remembered call: the digest of its inputs, and its outputs by name.
MemoEntry = tuple[bytes, dict[str, np.ndarray]]

MAX_INPUT_BYTES = 1 << 20
MAX_OUTPUT_BYTES = 16 << 20
ENTRIES = 8


def memoisable(contract: ContractSpec) -> bool:
    """Whether calls of this graph may be answered from memory: fed from user inputs alone, small."""
    inputs = contract.inputs
    if not inputs or any(s.provenance is None or s.provenance.kind != "input" for s in inputs):
        return False
    return sum(np.dtype(s.dtype).itemsize * math.prod(s.shape) for s in inputs) <= MAX_INPUT_BYTES


class OutputMemo:
    """The outputs of the last `ENTRIES` distinct calls, by a digest of their inputs."""

    def __init__(self) -> None:
        self._entries: OrderedDict[bytes, dict[str, np.ndarray]] = OrderedDict()
        self._preloaded: dict[bytes, dict[str, np.ndarray]] = {}
        self.hits = 0

    @staticmethod
    def key(feeds: Mapping[str, np.ndarray]) -> bytes | None:
        """The inputs' digest (names, dtypes, shapes and bytes); None when they are too big to digest."""
        if sum(a.nbytes for a in feeds.values()) > MAX_INPUT_BYTES:
            return None
        digest = hashlib.blake2b(digest_size=20)
        for name in sorted(feeds):
            array = np.ascontiguousarray(feeds[name])
            digest.update(f"{name}|{array.dtype.str}|{array.shape}|".encode())
            digest.update(array.tobytes())
        return digest.digest()

    def get(self, key: bytes) -> dict[str, np.ndarray] | None:
        """A copy of the remembered outputs (the caller may write into what it gets), or None."""
        outputs = self._preloaded.get(key)
        if outputs is None:
            outputs = self._entries.get(key)
            if outputs is None:
                return None
            self._entries.move_to_end(key)
        self.hits += 1
        return {name: array.copy() for name, array in outputs.items()}

    def put(self, key: bytes, outputs: Mapping[str, np.ndarray]) -> None:
        if sum(np.asarray(a).nbytes for a in outputs.values()) > MAX_OUTPUT_BYTES:
            return
        self._entries[key] = {name: np.array(array, copy=True) for name, array in outputs.items()}
        while len(self._entries) > ENTRIES:
            self._entries.popitem(last=False)

    def entries(self) -> list[MemoEntry]:
        """What the memory holds now (outputs computed ahead included)."""
        return [*self._preloaded.items(), *self._entries.items()]

    def preload(self, entries: list[MemoEntry]) -> None:
        """Outputs computed ahead: kept for the model's life, whatever else is remembered."""
        self._preloaded.update(entries)


def save_entries(path: Path, entries: list[MemoEntry]) -> Path:
    """`entries` in one .npz: the arrays, and an index of which input digest and output each is."""
    path.parent.mkdir(parents=True, exist_ok=True)
    arrays, index = {}, []
    for key, outputs in entries:
        for name, array in outputs.items():
            index.append([key.hex(), name])
            arrays[f"a{len(arrays)}"] = array
    np.savez(path, index=np.array(json.dumps(index)), **arrays)
    return path


def load_entries(path: Path) -> list[MemoEntry]:
    with np.load(path, allow_pickle=False) as data:
        entries: dict[bytes, dict[str, np.ndarray]] = {}
        for k, (key, name) in enumerate(json.loads(str(data["index"]))):
            entries.setdefault(bytes.fromhex(key), {})[name] = data[f"a{k}"]
    return list(entries.items())
