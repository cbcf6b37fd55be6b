"""Known ATC precision pitfalls (`data/precision_pitfalls.yaml`, each entry cited) checked
against a graph: which nodes each one concerns, under which modes, and the workaround.

Three kinds of match: the op types are present (`ops`); a constant beyond fp16's range feeds a
node (`constants`, small tensors only: large weights are not read); emulation saw nodes of the
op types overflow (`overflow`, needs the candidate's precision report). A hit is a warning,
not a proof: the lowering pitfalls are invisible to emulation and show only on the NPU.
"""

from __future__ import annotations

from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Literal

import numpy as np
import onnx
import yaml
from omskills.ascend.precision_modes import FP16_MAX
from omskills.onnxfiles.inspect import walk_nodes
from omskills.records.base import Record
from omskills.records.precision import PrecisionReport
from omskills.records.toolchain import PitfallHit
from onnx import numpy_helper

PITFALLS_FILE = "precision_pitfalls.yaml"
SMALL_TENSOR_BYTES = 1 << 20  # constants up to this size are read for their range
MAX_NODES_LISTED = 50


class PrecisionPitfall(Record):
    id: str
    op_types: list[str]
    match: Literal["ops", "constants", "overflow"]
    modes: list[str]
    cann: str
    symptom: str
    workaround: str
    keep: bool  # keeping the matched nodes (--keep_dtype) is the workaround proposed here
    source: str
    source_says: str


@lru_cache(maxsize=1)
def load_pitfalls() -> tuple[PrecisionPitfall, ...]:
    text = resources.files("omskills.ascend").joinpath("data", PITFALLS_FILE).read_text(encoding="utf-8")
    return tuple(PrecisionPitfall.model_validate(entry) for entry in yaml.safe_load(text))


def check_pitfalls(model_path: str | Path, precision: PrecisionReport | None = None) -> list[PitfallHit]:
    model = onnx.load(str(model_path), load_external_data=False)
    nodes = [node for node, _ in walk_nodes(model.graph)]
    hits = []
    for pitfall in load_pitfalls():
        matched = _matched_nodes(pitfall, model, nodes, precision)
        if matched:
            hits.append(
                PitfallHit(
                    id=pitfall.id,
                    count=len(matched),
                    nodes=matched[:MAX_NODES_LISTED],
                    modes=pitfall.modes,
                    symptom=pitfall.symptom,
                    workaround=pitfall.workaround,
                    keep_nodes=matched if pitfall.keep else [],
                    source=pitfall.source,
                    note=None
                    if pitfall.match != "ops"
                    else "emulation cannot show this: it is ATC's lowering; check on the NPU",
                )
            )
    return hits


def _matched_nodes(
    pitfall: PrecisionPitfall, model: onnx.ModelProto, nodes: list[onnx.NodeProto], precision: PrecisionReport | None
) -> list[str]:
    if pitfall.match == "ops":
        return [n.name for n in nodes if n.op_type in pitfall.op_types]
    if pitfall.match == "constants":
        return _consumers_of_large_constants(model, nodes)
    if precision is None:
        return []
    findings = [m.result.first for m in precision.modes if m.mode in pitfall.modes and m.result.first is not None]
    overflowed = {f.node for f in findings if f.worst.overflow and f.op_type in pitfall.op_types}
    return [n.name for n in nodes if n.name in overflowed]


def _consumers_of_large_constants(model: onnx.ModelProto, nodes: list[onnx.NodeProto]) -> list[str]:
    large = {t.name for t in model.graph.initializer if _beyond_fp16(t)}
    large |= {
        o
        for n in nodes
        if n.op_type == "Constant"
        for a in n.attribute
        if a.name == "value" and _beyond_fp16(a.t)
        for o in n.output
    }
    return [n.name for n in nodes if any(i in large for i in n.input)]


def _beyond_fp16(tensor: onnx.TensorProto) -> bool:
    if tensor.data_type != onnx.TensorProto.FLOAT or tensor.data_location == onnx.TensorProto.EXTERNAL:
        return False
    if int(np.prod(tensor.dims, dtype=np.int64)) * 4 > SMALL_TENSOR_BYTES:
        return False
    values = numpy_helper.to_array(tensor)
    finite = values[np.isfinite(values)]
    return bool(finite.size and np.abs(finite).max() > FP16_MAX)
