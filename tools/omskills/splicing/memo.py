"""Graph calls answered from memory. A compiled graph is a function of its inputs alone, so a call
whose inputs repeat (a text encoder on the same prompt, once per video) need not run again.

Only graphs whose inputs derive from user inputs and the model's constants alone are remembered
(`why_not_memoisable`, the one rule): prompt tokens, a text tower's input made from them with the token
and positional embeddings, its attention mask (a buffer); never a value that session state or a random
op went into, nor one the study could not trace, as such calls are not expected to repeat. Only small
calls: the inputs are digested on every call, which must cost nothing beside the call, and a
remembered call's outputs stay in memory.
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
from omskills.records.contracts import ContractSpec, Provenance

# One remembered call: the digest of its inputs, and its outputs by name.
MemoEntry = tuple[bytes, dict[str, np.ndarray]]

MAX_INPUT_BYTES = 1 << 20
MAX_OUTPUT_BYTES = 16 << 20
ENTRIES = 8


# Roots a remembered graph's inputs may have: what the user gives and what the model holds.
CONSTANT_ROOTS = frozenset({"input", "parameter", "constant"})
# Why a value with another root would not repeat, by root.
_NOT_REPEATING = {
    "session": "comes from session state",
    "random": "derives from a random op",
    "unknown": "derives from a tensor the study could not trace",
}


def memoisable(contract: ContractSpec) -> bool:
    """Whether calls of this graph may be answered from memory (`why_not_memoisable` says why not)."""
    return why_not_memoisable(contract) is None


def why_not_memoisable(contract: ContractSpec) -> str | None:
    """Why calls of this graph are not answered from memory, in one line; None when they are: every
    input derives from user inputs and the model's parameters and buffers alone, and a call's inputs
    are small enough to digest."""
    if not contract.inputs:
        return "it takes no tensor input"
    for spec in contract.inputs:
        why = _why_not_constant(spec.provenance)
        if why is not None:
            return f"input {spec.name!r} {why}"
    size = sum(np.dtype(s.dtype).itemsize * math.prod(s.shape) for s in contract.inputs)
    if size > MAX_INPUT_BYTES:
        return f"its inputs are {size:,} bytes a call, more than the {MAX_INPUT_BYTES:,} digested per call"
    return None


def _why_not_constant(provenance: Provenance | None) -> str | None:
    """Why a value with this provenance may change between calls with the same user inputs."""
    if provenance is None:
        return "has no recorded provenance"
    roots = provenance.roots
    if roots is None:  # a record written before roots were traced: only a user input as given is known
        if provenance.kind == "input" and not provenance.derived:
            return None
        return "has no recorded roots (a study before omskills traced them); study again"
    outside = [kind for kind in roots if kind not in CONSTANT_ROOTS]
    if not outside:
        return None
    kind = next((k for k in _NOT_REPEATING if k in outside), outside[0])  # session state said first
    return f"{_NOT_REPEATING.get(kind, f'derives from {kind}')} ({roots[kind]})"


class OutputMemo:
    """The outputs of the last `ENTRIES` distinct calls, by a digest of their inputs."""

    def __init__(self) -> None:
        self._entries: OrderedDict[bytes, dict[str, np.ndarray]] = OrderedDict()
        self._preloaded: dict[bytes, dict[str, np.ndarray]] = {}
        self.hits = 0
        self.oversized = 0  # calls whose outputs were too big to keep

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
            self.oversized += 1
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
