"""Check a model's operators against the ONNX operators ATC accepts, before anyone reaches an NPU.

The table is `ascend/data/atc_onnx_ops.csv`, typed from CANN 8.0.0's "支持ONNX算子清单" (see
`data/atc_onnx_ops.README.md` for pages and which opset ranges were read or assumed). ATC's
ONNX parser looks operators up as `ai.onnx::<model opset>::<op type>`, so the model's
default-domain opset is what is compared with each operator's accepted opsets.
"""

from __future__ import annotations

import csv
from collections import defaultdict
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from pathlib import Path

import onnx
from omskills.ascend.atc import KNOWN_SOCS
from omskills.errors import InputError
from omskills.onnxfiles.inspect import DEFAULT_DOMAIN, default_opset, load_model_proto, walk_nodes
from omskills.records.toolchain import OpCheckRow, OpPrecheck, OpStatus
from onnx import NodeProto

TABLE_FILE = "atc_onnx_ops.csv"
TABLE_DOCUMENT = (
    "CANN 8.0.0 支持ONNX算子清单 (operatorlist_00176), see tools/omskills/ascend/data/atc_onnx_ops.README.md"
)
MAX_NODE_NAMES = 50


@dataclass(frozen=True)
class AtcOp:
    op_type: str
    doc_name: str
    opsets: frozenset[int]
    opsets_text: str
    range_from: str
    constraints: str
    allowed_attr: str | None  # attribute name the table restricts
    allowed_values: frozenset[str]
    source: str


def parse_opsets(text: str) -> frozenset[int]:
    """'10-12,14-18' -> {10, 11, 12, 14, ..., 18}."""
    values: set[int] = set()
    for part in text.split(","):
        low, _, high = part.strip().partition("-")
        values.update(range(int(low), int(high or low) + 1))
    return frozenset(values)


@lru_cache(maxsize=1)
def load_table() -> dict[str, AtcOp]:
    """op_type -> row of the shipped table."""
    text = resources.files("omskills.ascend").joinpath("data", TABLE_FILE).read_text(encoding="utf-8")
    table: dict[str, AtcOp] = {}
    for row in csv.DictReader(text.splitlines()):
        attr, _, values = row["allowed_attrs"].partition("=")
        table[row["op_type"]] = AtcOp(
            op_type=row["op_type"],
            doc_name=row["doc_name"],
            opsets=parse_opsets(row["opsets"]),
            opsets_text=row["opsets"],
            range_from=row["range_from"],
            constraints=row["constraints"],
            allowed_attr=attr or None,
            allowed_values=frozenset(values.split("|")) if values else frozenset(),
            source=row["source"],
        )
    return table


def precheck_ops(model_path: str | Path, soc: str) -> OpPrecheck:
    """Every op type of the model (subgraphs and local functions included) against the table:
    supported, constrained (documented constraints apply, an attribute value outside what is
    documented, or the model's opset outside the op's range), or unsupported (not in the list,
    or not in the default ONNX domain)."""
    if soc not in KNOWN_SOCS:
        raise InputError(f"soc: unknown SoC {soc!r}; expected one of {list(KNOWN_SOCS)}")
    model = load_model_proto(model_path)
    opset = default_opset(model)
    if opset is None:
        raise InputError(f"{model_path}: the model imports no default ONNX opset")
    if model.functions:
        # ATC sees the function bodies' ops once the functions are inlined; check those.
        model = onnx.inliner.inline_local_functions(model)
    groups: dict[tuple[str, str], list[NodeProto]] = defaultdict(list)
    for node, _ in walk_nodes(model.graph):
        groups[(node.domain if node.domain != DEFAULT_DOMAIN else "", node.op_type)].append(node)
    table = load_table()
    rows = [_check_group(domain, op_type, nodes, opset, table) for (domain, op_type), nodes in groups.items()]
    order = {"unsupported": 0, "constrained": 1, "supported": 2}
    rows.sort(key=lambda r: (order[r.status], r.op_type))
    counts = {
        status: sum(1 for r in rows if r.status == status) for status in ("supported", "constrained", "unsupported")
    }
    verdict = "fail" if counts["unsupported"] else "review" if counts["constrained"] else "pass"
    return OpPrecheck(
        model=str(model_path), soc=soc, opset=opset, table=TABLE_DOCUMENT, verdict=verdict, counts=counts, rows=rows
    )


def _check_group(domain: str, op_type: str, nodes: list[NodeProto], opset: int, table: dict[str, AtcOp]) -> OpCheckRow:
    names = [n.name or f"<unnamed {op_type}>" for n in nodes[:MAX_NODE_NAMES]]
    base = dict(op_type=op_type, domain=domain, count=len(nodes), nodes=names)
    if domain:
        return OpCheckRow(
            **base,
            status="unsupported",
            reason=f"custom domain {domain!r}: ATC's ONNX list covers the default domain only",
        )
    entry = table.get(op_type)
    if entry is None:
        return OpCheckRow(**base, status="unsupported", reason="not in CANN's supported ONNX operator list")
    status, reasons = _constraints(entry, nodes, opset)
    return OpCheckRow(
        **base,
        status=status,
        reason="; ".join(reasons) or None,
        constraints=entry.constraints or None,
        opsets=entry.opsets_text,
        range_from=entry.range_from,
        source=entry.source,
    )


def _constraints(entry: AtcOp, nodes: list[NodeProto], opset: int) -> tuple[OpStatus, list[str]]:
    reasons: list[str] = []
    if opset not in entry.opsets:
        where = "documented" if entry.range_from == "op page" else "assumed"
        reasons.append(f"model opset {opset} is outside the {where} range {entry.opsets_text}")
    if entry.allowed_attr:
        off = [
            n.name or "<unnamed>"
            for n in nodes
            if _attr_value(n, entry.allowed_attr) not in (None, *entry.allowed_values)
        ]
        if off:
            reasons.append(f"{entry.allowed_attr} outside the documented values in node(s) {off[:10]}")
    if entry.constraints:
        reasons.append("documented constraints apply (see constraints)")
    return ("constrained" if reasons else "supported"), reasons


def _attr_value(node: NodeProto, name: str) -> str | None:
    for attribute in node.attribute:
        if attribute.name == name:
            value = onnx.helper.get_attribute_value(attribute)
            text = value.decode() if isinstance(value, bytes) else str(value)
            return text.replace(" ", "")
    return None
