"""A hop's glue as a graph of its own: the captured operations replayed in a module and exported.

The module takes the producer's outputs the glue reads (by their names) and gives every input of the
consumer (by its name): those the glue computes, those the producer hands on unchanged, and those
that are the same constant in every call. Composed between the two graphs (`convert.compose`), it
makes the producer, the glue and the consumer one graph. The export is checked against what the
host computed in the captured call before anything is composed from it.
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import torch
from omskills.boundary.glue import Const, Program, Ref
from omskills.contracts.provenance import _shallow_tensors
from omskills.onnxfiles.onnx_io import save_onnx
from torch import nn

GLUE_OPSET = 18  # the highest ATC accepts (convert.export)
GLUE_INPUT = "from_"  # the prefix of the glue graph's inputs that are the producer's outputs


class GlueGraphError(ValueError):
    """The glue could not be made a graph (the message says why)."""


class GlueReplay(nn.Module):
    """Replays a captured glue program. Inputs: the producer outputs it reads (`roots`, in order),
    then the slots that are not constants; the constant slots are held as buffers."""

    def __init__(self, program: Program, roots: list[int], fed: list[int], outputs: list[str]) -> None:
        super().__init__()
        self.program, self.roots, self.fed, self.output_names = program, roots, fed, outputs
        for index, sample in enumerate(program.slot_samples):
            if index not in fed:
                self.register_buffer(f"slot_{index}", sample.clone(), persistent=False)

    def forward(self, *given: torch.Tensor) -> tuple[torch.Tensor, ...]:
        roots, fed = given[: len(self.roots)], given[len(self.roots) :]
        slots = {index: tensor for index, tensor in zip(self.fed, fed)}
        slots |= {i: getattr(self, f"slot_{i}") for i in range(len(self.program.slots)) if i not in slots}
        env: dict[int, torch.Tensor] = dict(zip(self.roots, roots))
        consts: dict[int, torch.Tensor] = {}
        named: dict[str, torch.Tensor] = {}
        for index, slot in enumerate(self.program.slots):
            kind, key = slot.key
            {"node": env, "const": consts, "input": named}[kind][key] = slots[index]  # type: ignore[index]
        for op in self.program.ops:
            args, kwargs = _bound(op.args, env, consts)
            out = op.func(*args, **kwargs)
            results = _shallow_tensors(out)
            if len(results) < len(op.results):  # an in-place write: the written tensor is a result too
                results += _shallow_tensors(kwargs.get("out") if kwargs.get("out") is not None else args[:1])
            for node, tensor in zip(op.results, results):
                env[node] = tensor
        made = self.program.outputs
        return tuple(env[made[n]] if isinstance(made[n], int) else named[made[n]] for n in self.output_names)


def _bound(value: Any, env: dict[int, torch.Tensor], consts: dict[int, torch.Tensor]) -> Any:
    if isinstance(value, Ref):
        return env[value.node]
    if isinstance(value, Const):
        return consts[value.value]
    if isinstance(value, (list, tuple)):
        items = [_bound(v, env, consts) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    if isinstance(value, dict):
        return {k: _bound(v, env, consts) for k, v in value.items()}
    return value


def export_glue(program: Program, constant: list[bool], outputs: list[str], out: Path) -> list[str]:
    """Write the glue of `program` to `out`. Its inputs: the producer's outputs it reads (named
    GLUE_INPUT + their names), then each slot not `constant` (named `slot_<k>`, k its index); its outputs: `outputs`
    (the consumer's inputs, in its order). Returns the input names. Raises GlueGraphError if it
    cannot be exported, or does not give what the host computed in the captured call."""
    roots = sorted(program.roots, key=lambda node: program.roots[node])
    fed = [index for index, is_constant in enumerate(constant) if not is_constant]
    # Its own input names (the composition maps them): a consumer input may share a producer output's name.
    names = [GLUE_INPUT + program.roots[node] for node in roots] + [f"slot_{index}" for index in fed]
    if missing := [program.roots[n] for n in roots if program.roots[n] not in program.root_samples]:
        raise GlueGraphError(f"no copy of {program.producer}'s {missing} was kept from the captured call")
    samples = tuple(program.root_samples[program.roots[n]] for n in roots) + tuple(program.slot_samples[i] for i in fed)
    module = GlueReplay(program, roots, fed, outputs).eval()
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        with torch.no_grad(), contextlib.redirect_stdout(io.StringIO()):
            exported = torch.onnx.export(
                module, samples, dynamo=True, opset_version=GLUE_OPSET, input_names=names, output_names=outputs
            )
        model = exported.model_proto
    except Exception as err:  # noqa: BLE001 - any exporter failure means: the glue stays in Python
        raise GlueGraphError(f"export failed: {str(err).splitlines()[0][:300]}") from err
    save_onnx(model, out)
    _check(out, names, samples, outputs, program)
    return names


def _check(
    path: Path, names: list[str], samples: tuple[torch.Tensor, ...], outputs: list[str], program: Program
) -> None:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    got = session.run(outputs, {n: s.detach().cpu().numpy() for n, s in zip(names, samples)})
    for name, value in zip(outputs, got):
        expected = program.input_samples[name].detach().cpu().numpy()
        if value.shape != expected.shape or value.dtype != expected.dtype:
            raise GlueGraphError(
                f"{name}: the graph gives {value.dtype}{list(value.shape)}, the host made "
                f"{expected.dtype}{list(expected.shape)}"
            )
        if not np.allclose(value, expected, rtol=1e-4, atol=1e-5, equal_nan=True):
            worst = float(np.max(np.abs(value.astype(np.float64) - expected.astype(np.float64))))
            raise GlueGraphError(f"{name}: the graph differs from what the host computed (max abs {worst:.3g})")
    onnx.checker.check_model(str(path))


def _constant_name(name: str) -> str:
    return "constant_" + "".join(c if c.isalnum() else "_" for c in name)
