"""Tensors an OM dumped on an Ascend NPU, read as `Observed` node outputs of its ONNX graph.

Layout read (msit / ais_bench, converted to .npy: `msit benchmark ... --dump 1 --dump-npy 1`, or
CANN's `msaccucmp.py convert`), searched anywhere under the folder given:

    {op_type}.{op_name}.{task_id}.{stream_id}.{timestamp}.{input|output}.{index}.npy

Also read, for a dump of the ONNX model made by msit compare (`dump_data/onnx`):

    {op_name}.{output_index}.{timestamp}.npy

In file names every character of an op name outside `A-Za-z0-9_-` stands as `_`; ONNX node
names are matched the same way. ATC keeps ONNX node names for the ops it does not fuse; a fused
op is matched through the OM's graph JSON (`atc --mode=1 --om=model.om --json=model.json`),
whose `_datadump_original_op_names` lists the ONNX nodes it replaced and whose output
descriptions' `_datadump_origin_name` / `_datadump_origin_output_index` name the ONNX output
each of its outputs stands for. Ops ATC adds (Data, NetOutput, TransData, Cast, ...) are skipped.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from omskills.ascend.emulation import PreparedGraph
from omskills.ascend.observed import Observed
from omskills.errors import InputError

NPU_FILE = re.compile(
    r"^(?P<op_type>[^.]+)\.(?P<op_name>[^.]+)\.(?P<task>\d+)\.(?P<stream>\d+)\.(?P<ts>\d+)"
    r"\.(?P<kind>input|output)\.(?P<index>\d+)\.npy$"
)
ONNX_FILE = re.compile(r"^(?P<op_name>[^.]+)\.(?P<index>\d+)\.(?P<ts>\d+)\.npy$")
RAW_NPU_FILE = re.compile(r"^[^.]+\.[^.]+\.\d+\.\d+\.\d+$")
ATC_PLUMBING = {"Data", "NetOutput", "TransData", "TransDataRNN", "Cast", "AtomicAddrClean", "MemSet", "Const"}


def file_name_of(op_name: str) -> str:
    """An op name as dump files spell it."""
    return re.sub(r"[^A-Za-z0-9_-]", "_", op_name)


@dataclass
class _DumpFile:
    path: Path
    op_type: str | None
    op_name: str
    kind: str  # input | output
    index: int
    timestamp: int


@dataclass
class _Origin:
    """What one dumped op stands for in the ONNX graph."""

    node: str
    outputs: dict[int, tuple[str, int]] = field(default_factory=dict)  # dumped output -> (ONNX node, its output)
    fused: bool = False


@dataclass
class NpuDump:
    observed: list[Observed]
    skipped: int  # files of ops ATC added
    repeats: int  # files of later runs of an op already read (the earliest run is compared)
    notes: list[str]


def read_dump(folder: Path, prepared: PreparedGraph, om_json: Path | None = None) -> NpuDump:
    if not folder.is_dir():
        raise InputError(f"dump_dir: {folder} is not a folder")
    files = _dump_files(folder)
    if not files:
        raw = sum(1 for p in folder.rglob("*") if p.is_file() and RAW_NPU_FILE.match(p.name))
        hint = (
            (
                f"it holds {raw} raw dump file(s): convert them to .npy with "
                "`msit benchmark ... --dump 1 --dump-npy 1` "
                f"or CANN's `msaccucmp.py convert -d <dump> -out <folder>`"
            )
            if raw
            else "it holds no dump file"
        )
        raise InputError(f"dump_dir: no .npy dump under {folder}; {hint}")
    origins = _origins(prepared, om_json)
    earliest: dict[tuple[str, str, int], _DumpFile] = {}
    repeats = skipped = 0
    for f in sorted(files, key=lambda f: f.timestamp):
        if f.op_type in ATC_PLUMBING:
            skipped += 1
            continue
        key = (f.op_name, f.kind, f.index)
        if key in earliest:
            repeats += 1
            continue
        earliest[key] = f
    observed: list[Observed] = []
    notes: list[str] = []
    unknown = 0
    for (op_name, kind, index), f in earliest.items():
        if kind != "output":
            continue
        origin = origins.get(file_name_of(op_name))  # msit's ONNX dumps keep some characters GE's replace
        unknown += origin is None
        node, out_index = origin.outputs.get(index, (origin.node, index)) if origin else (op_name, index)
        inputs = {} if origin is None or origin.fused else _inputs_of(prepared, origin.node, op_name, earliest)
        observed.append(
            Observed(
                node=node,
                index=out_index,
                source=str(f.path.relative_to(folder)),
                load=_loader(f.path),
                nbytes=_nbytes(f.path),
                region_inputs=inputs,
            )
        )
    if unknown and om_json is None:
        notes.append(
            f"{unknown} dumped op(s) match no ONNX node by name; fused ones are mapped by om_json "
            "(`atc --mode=1 --om=<model>.om --json=<model>.json`)"
        )
    return NpuDump(observed=observed, skipped=skipped, repeats=repeats, notes=notes)


def _dump_files(folder: Path) -> list[_DumpFile]:
    result = []
    for path in folder.rglob("*.npy"):
        if m := NPU_FILE.match(path.name):
            result.append(_DumpFile(path, m["op_type"], m["op_name"], m["kind"], int(m["index"]), int(m["ts"])))
        elif m := ONNX_FILE.match(path.name):
            result.append(_DumpFile(path, None, m["op_name"], "output", int(m["index"]), int(m["ts"])))
    return result


def _origins(prepared: PreparedGraph, om_json: Path | None) -> dict[str, _Origin]:
    """Dump-file op name -> the ONNX node it stands for: by name, and through the OM's graph JSON."""
    origins: dict[str, _Origin] = {}
    spelled: dict[str, list[str]] = {}
    for node in prepared.graph.node:
        spelled.setdefault(file_name_of(node.name), []).append(node.name)
    for name, nodes in spelled.items():
        if len(nodes) == 1:  # two ONNX names spelled alike in a file name cannot be told apart
            origins[name] = _Origin(node=nodes[0])
    if om_json is not None:
        known = {n.name for n in prepared.graph.node}
        for op in _om_ops(om_json):
            origin = _om_origin(op, known)
            if origin is not None:
                origins[file_name_of(str(op.get("name", "")))] = origin
    return origins


def _om_ops(om_json: Path) -> list[dict]:
    if not om_json.is_file():
        raise InputError(
            f"om_json: {om_json} does not exist (make it with `atc --mode=1 --om=<model>.om --json={om_json.name}`)"
        )
    try:
        graph = json.loads(om_json.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise InputError(f"om_json: {om_json} is not a JSON file: {exc}") from exc
    return [op for g in graph.get("graph", []) for op in g.get("op", [])]


def _attr(attrs: list[dict], key: str) -> dict | None:
    return next((a.get("value", {}) for a in attrs or [] if a.get("key") == key), None)


def _om_origin(op: dict, known: set[str]) -> _Origin | None:
    originals = [
        n
        for n in ((_attr(op.get("attr", []), "_datadump_original_op_names") or {}).get("list", {}).get("s") or [])
        if n in known
    ]
    outputs = {}
    for k, desc in enumerate(op.get("output_desc", []) or []):
        name = (_attr(desc.get("attr", []), "_datadump_origin_name") or {}).get("s")
        index = (_attr(desc.get("attr", []), "_datadump_origin_output_index") or {}).get("i", 0)
        if name in known:
            outputs[k] = (name, int(index))
    if not originals and not outputs:
        return None
    node = originals[-1] if originals else next(iter(outputs.values()))[0]
    return _Origin(node=node, outputs=outputs, fused=len(originals) > 1)


def _inputs_of(
    prepared: PreparedGraph, node_name: str, op_name: str, files: dict[tuple[str, str, int], _DumpFile]
) -> dict:
    node = prepared.node_named.get(node_name)
    if node is None:
        return {}
    return {
        tensor: _loader(files[(op_name, "input", k)].path)
        for k, tensor in enumerate(node.input)
        if tensor and (op_name, "input", k) in files
    }


def _loader(path: Path):
    return lambda: np.load(path)


def _nbytes(path: Path) -> int:
    array = np.load(path, mmap_mode="r")
    return int(array.size) * 4  # compared as fp32
