"""Exported graphs as one: each computed from the one before it, inside a single graph.

When every input of graph B is an output of graph A, handed on unchanged by the code between
their calls, one call of the composed graph does the work of both: one launch instead of two, and
B's inputs never leave the device. A chain A -> B -> C composes the same way. Every member's
outputs stay outputs (host code or other graphs may read them); each member after the first has
its names prefixed, so the members' names cannot collide.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from pathlib import Path

import onnx
import onnx.version_converter
from omskills.onnxfiles.onnx_io import save_onnx
from omskills.records.glue import composed_prefix
from onnx import compose


class ComposeError(ValueError):
    """The graphs cannot be composed (the message says why)."""


def compose_chain(
    models: Sequence[Path],
    names: Sequence[str],
    io_maps: Sequence[dict[str, str]],
    out: Path,
    internal: Collection[str] = (),
    free: Sequence[Collection[str]] = (),
    absolute: bool = False,
) -> list[str]:
    """Write to `out` one graph computing `models` in order, each member after the first fed by
    the member before it: `io_maps[k]` maps each input of member k+1 to the output of member k
    that feeds it (every input must be one, except those in `free[k]`: they become inputs of the
    composed graph, with the member's prefix). With `absolute`, the maps name outputs of any
    earlier member as the composed graph names them. Returns the composed graph's outputs: the
    first member's, then each later member's with `composed_prefix` of its name, except the
    members named in `internal` (a hop's glue: only the next member reads it)."""
    if len(models) < 2 or len(names) != len(models) or len(io_maps) != len(models) - 1:
        raise ComposeError(
            f"a chain needs two graphs or more, a name each and a map between each two: "
            f"{len(models)} graph(s), {len(names)} name(s), {len(io_maps)} map(s)"
        )
    merged = onnx.load(str(models[0]))
    before = ""
    unfed = list(free) + [()] * (len(io_maps) - len(free))
    for path, name, io_map, loose in zip(models[1:], names[1:], io_maps, unfed):
        member = onnx.load(str(path))
        prefix = composed_prefix(name)
        merged = _appended(merged, member, io_map, "" if absolute else before, prefix, path.name, set(loose))
        before = prefix
    hidden = tuple(composed_prefix(name) for name in internal)
    kept = [o for o in merged.graph.output if not o.name.startswith(hidden)] if hidden else None
    if kept is not None:
        del merged.graph.output[:]
        merged.graph.output.extend(kept)
    onnx.checker.check_model(merged, full_check=False)
    save_onnx(merged, out)
    return [o.name for o in merged.graph.output]


def _appended(
    merged: onnx.ModelProto,
    member: onnx.ModelProto,
    io_map: dict[str, str],
    before: str,
    prefix: str,
    label: str,
    loose: set[str],
) -> onnx.ModelProto:
    """`member` (names prefixed) added after `merged`, fed by the outputs of the member before it
    (whose names carry `before`); its inputs in `loose` become inputs of the composed graph."""
    produced = [o.name for o in merged.graph.output]
    inputs = {i.name for i in member.graph.input} - {t.name for t in member.graph.initializer} - loose
    if unfed := sorted(inputs - set(io_map)):
        raise ComposeError(f"{label}: input(s) {unfed} are not outputs of the graph before it")
    if unknown := sorted(before + o for o in set(io_map.values()) if before + o not in produced):
        raise ComposeError(f"{label}: the graph before it has no output(s) {unknown}")
    _same_opsets(merged, member)
    merged.ir_version = member.ir_version = max(merged.ir_version, member.ir_version)
    member = compose.add_prefix(member, prefix)
    outputs = produced + [o.name for o in member.graph.output]
    return compose.merge_models(
        merged,
        member,
        io_map=[(before + io_map[name], prefix + name) for name in sorted(inputs)],
        outputs=outputs,
        name=f"{merged.graph.name}+{member.graph.name}",
    )


def _same_opsets(a: onnx.ModelProto, b: onnx.ModelProto) -> None:
    """ONNX composes two graphs only where each operator domain has one version; a graph of a
    lower version is converted up when that is the default domain."""
    versions_a = {o.domain or "ai.onnx": o.version for o in a.opset_import}
    versions_b = {o.domain or "ai.onnx": o.version for o in b.opset_import}
    for domain in set(versions_a) & set(versions_b):
        va, vb = versions_a[domain], versions_b[domain]
        if va == vb:
            continue
        if domain != "ai.onnx":
            raise ComposeError(f"operator domain {domain!r}: version {va} in one graph, {vb} in the other")
        lower, version = (a, vb) if va < vb else (b, va)
        converted = onnx.version_converter.convert_version(lower, version)
        lower.CopyFrom(converted)
