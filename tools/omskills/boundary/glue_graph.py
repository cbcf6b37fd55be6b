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

import numpy as np
import onnx
import onnxruntime as ort
import torch
from omskills.boundary.glue import Const, Program, Ref
from omskills.contracts.provenance import _shallow_tensors
from omskills.onnxfiles.onnx_io import save_onnx
from torch import nn

GLUE_OPSET = 18  # the highest ATC accepts (convert.export)


class GlueGraphError(ValueError):
    """The glue could not be made a graph (the message says why)."""


class GlueReplay(nn.Module):
    """Replays a captured glue program: inputs, the producer outputs it reads in `roots` order."""

    def __init__(self, program: Program, roots: list[int], outputs: list[str]) -> None:
        super().__init__()
        self.program = program
        self.roots = roots
        self.output_names = outputs
        for index, value in program.values.items():
            self.register_buffer(f"value_{index}", value.clone(), persistent=False)
        for name, made in program.outputs.items():
            if isinstance(made, torch.Tensor):
                self.register_buffer(_constant_name(name), made.clone(), persistent=False)

    def forward(self, *roots: torch.Tensor) -> tuple[torch.Tensor, ...]:
        env: dict[int, torch.Tensor] = dict(zip(self.roots, roots))
        for op in self.program.ops:
            args, kwargs = self._bound(op.args, env)
            out = op.func(*args, **kwargs)
            results = _shallow_tensors(out)
            if len(results) < len(op.results):  # an in-place write: the written tensor is a result too
                results += _shallow_tensors(kwargs.get("out") if kwargs.get("out") is not None else args[:1])
            for node, tensor in zip(op.results, results):
                env[node] = tensor
        made = []
        for name in self.output_names:
            source = self.program.outputs[name]
            tensor = getattr(self, _constant_name(name)) if isinstance(source, torch.Tensor) else env[source]
            made.append(tensor)
        return tuple(made)

    def _bound(self, value, env):  # type: ignore[no-untyped-def]
        if isinstance(value, Ref):
            return env[value.node]
        if isinstance(value, Const):
            return getattr(self, f"value_{value.value}")
        if isinstance(value, (list, tuple)):
            items = [self._bound(v, env) for v in value]
            return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
        if isinstance(value, dict):
            return {k: self._bound(v, env) for k, v in value.items()}
        return value


def export_glue(program: Program, producer: str, outputs: list[str], out: Path) -> list[str]:
    """Write the glue of `program` to `out`: inputs named as the producer's outputs it reads,
    outputs named `outputs` (the consumer's inputs, in its order). Returns the input names.
    Raises GlueGraphError if it cannot be exported or does not give what the host computed."""
    roots = sorted(program.roots, key=lambda node: program.roots[node].output)
    names = [program.roots[node].output for node in roots]
    keys = [f"{producer}/{name}" for name in names]
    if missing := [k for k in keys if k not in program.root_samples]:
        raise GlueGraphError(f"no copy of {missing} was kept from the captured call")
    samples = tuple(program.root_samples[k] for k in keys)
    module = GlueReplay(program, roots, outputs).eval()
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        with torch.no_grad(), contextlib.redirect_stdout(io.StringIO()):
            exported = torch.onnx.export(
                module,
                samples,
                dynamo=True,
                opset_version=GLUE_OPSET,
                input_names=names,
                output_names=outputs,
                optimize=True,
                verbose=False,
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
