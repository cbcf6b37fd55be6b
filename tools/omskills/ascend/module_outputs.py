"""The PyTorch module's submodule outputs, read as `Observed` node outputs of its exported graph.

Which ONNX nodes a submodule became is read from the exporter's own naming: the torch.export
based exporter writes each node's module scopes into `pkg.torch.onnx.name_scopes`; the
TorchScript one names nodes `/scope/scope/Op`. A submodule's output is the tensor its nodes make
and a node outside it reads (or the graph returns); its region is all its nodes, entered by the
tensors they read and do not make, which are the submodule's own tensor inputs in order of use.
A submodule called more than once keeps its last call and no region (its nodes mix the calls).
Shapes are checked where the tensors meet: a tensor whose shape does not match is left out.
"""

from __future__ import annotations

import ast
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from omskills.ascend.emulation import PreparedGraph
from omskills.ascend.observed import Observed, entering_tensors
from torch import nn

SCOPES_KEY = "pkg.torch.onnx.name_scopes"


def node_scopes(prepared: PreparedGraph, known: set[str]) -> dict[str, list[str]]:
    """ONNX node name -> the module paths (outermost first) it was exported from, among `known`."""
    result = {}
    for node in prepared.graph.node:
        meta = {p.key: p.value for p in node.metadata_props}
        if SCOPES_KEY in meta:
            try:
                scopes = [s for s in ast.literal_eval(meta[SCOPES_KEY])[1:-1] if isinstance(s, str)]
            except (ValueError, SyntaxError):
                scopes = []
        else:
            scopes = _torchscript_scopes(node.name)
        result[node.name] = [s for s in scopes if s in known]
    return result


def _torchscript_scopes(name: str) -> list[str]:
    """`/encoder/layer.0/attn/MatMul` -> encoder, encoder.layer.0, encoder.layer.0.attn; a level
    that repeats its parent's last name (`/block/block.0/...`) continues it instead."""
    paths, current = [], ""
    for level in name.split("/")[1:-1]:
        last = current.rsplit(".", 1)[-1] if current else ""
        if current and level.startswith(last + "."):
            current = current[: len(current) - len(last)] + level
        else:
            current = f"{current}.{level}" if current else level
        paths.append(current)
    return paths


@dataclass
class _Region:
    nodes: list[str] = field(default_factory=list)
    output: tuple[str, int] | None = None  # (node, output index) of the tensor leaving it
    entering: list[str] = field(default_factory=list)  # float tensors it reads and does not make


def _regions(prepared: PreparedGraph, scopes: dict[str, list[str]]) -> dict[str, _Region]:
    """Module path -> its region, for modules with a tensor leaving them; nested modules that end
    on the same tensor (a block and its last layer) are kept once, the innermost (smallest)."""
    regions: dict[str, _Region] = {}
    for node in prepared.graph.node:
        for path in scopes.get(node.name, []):
            regions.setdefault(path, _Region()).nodes.append(node.name)
    weights = {t.name for t in prepared.graph.initializer}
    graph_outputs = {o.name for o in prepared.graph.output}
    readers: dict[str, set[str]] = {}
    for node in prepared.graph.node:
        for i in node.input:
            readers.setdefault(i, set()).add(node.name)
    innermost: dict[tuple[str, int], str] = {}
    for path, region in regions.items():
        inside = [prepared.node_named[n] for n in region.nodes]
        produced = {o: (n.name, k) for n in inside for k, o in enumerate(n.output) if o}
        leaving = [
            o
            for o in produced
            if o in prepared.float_tensors and (o in graph_outputs or readers.get(o, set()) - set(region.nodes))
        ]
        if not leaving:
            continue
        region.output = produced[leaving[-1]]
        region.entering = [t for t in entering_tensors(inside, weights) if t in prepared.float_tensors]
        known = innermost.get(region.output)
        if known is None or len(region.nodes) < len(regions[known].nodes):
            innermost[region.output] = path
    return {path: regions[path] for path in innermost.values()}


def module_observations(
    root: nn.Module, inputs: Sequence[torch.Tensor], prepared: PreparedGraph, budget_bytes: int
) -> tuple[list[Observed], list[str]]:
    """Run `root` (the module exactly as exported: the contract wrapper) on `inputs` with a hook
    on every submodule that has nodes in the graph; returns what they made, and notes."""
    modules = dict(root.named_modules())
    regions = _regions(prepared, node_scopes(prepared, set(modules)))
    captured: dict[str, tuple[np.ndarray, list[np.ndarray]]] = {}
    calls: dict[str, int] = {}
    over_budget: set[str] = set()
    notes: list[str] = []
    kept = [0]

    def hook(path: str):
        def capture(_module, args, kwargs, output):
            calls[path] = calls.get(path, 0) + 1
            out = _first_float(output)
            if out is None:
                return
            tensors = [t for t in [*args, *kwargs.values()] if _is_float(t)]
            size = 4 * (out.numel() + sum(t.numel() for t in tensors))  # kept as fp32
            previous = captured.pop(path, None)
            if previous is not None:
                kept[0] -= previous[0].nbytes + sum(t.nbytes for t in previous[1])
            if kept[0] + size > budget_bytes:
                over_budget.add(path)
                return
            over_budget.discard(path)
            captured[path] = (_numpy(out), [_numpy(t) for t in tensors])
            kept[0] += size

        return capture

    handles = [modules[p].register_forward_hook(hook(p), with_kwargs=True) for p in regions]
    try:
        with torch.no_grad():
            root(*inputs)
    finally:
        for handle in handles:
            handle.remove()
    if over_budget:
        notes.append(
            f"{len(over_budget)} module output(s) past the {budget_bytes / 2**30:.1f} GiB budget not compared, "
            f"e.g. {sorted(over_budget)[0]}"
        )
    observed = []
    for path, (output, taken) in captured.items():
        region = regions[path]
        node, index = region.output
        once = calls.get(path) == 1
        given = dict(zip(region.entering, taken)) if once and len(taken) == len(region.entering) else {}
        observed.append(
            Observed(
                node=node,
                index=index,
                source=f"module {path}",
                load=_constant(output),
                nbytes=output.nbytes,
                region=region.nodes if once else [],
                region_inputs={t: _constant(v) for t, v in given.items()},
            )
        )
    return observed, notes


def _is_float(value) -> bool:
    return isinstance(value, torch.Tensor) and value.is_floating_point()


def _first_float(output) -> torch.Tensor | None:
    if _is_float(output):
        return output
    if isinstance(output, (tuple, list)) and output and _is_float(output[0]):
        return output[0]
    return None


def _numpy(tensor: torch.Tensor) -> np.ndarray:
    return tensor.detach().to("cpu", torch.float32).numpy().copy()


def _constant(value: np.ndarray):
    return lambda: value
