"""Export a candidate module to ONNX through a wrapper built from its captured contract.

The wrapper takes the contract's tensor inputs as flat positional arguments, rebuilds the
original (args, kwargs) with the non-tensor constants bound, calls the candidate, and returns
its tensor outputs as a flat tuple — so the ONNX graph's inputs and outputs are exactly the
contract's, under the contract's names.

Two exporters: the torch.export-based one (`dynamo=True`, needed by modern models: the TorchScript one
fails on complex RoPE, `_addmm_activation` and antialiased resize) and the legacy TorchScript
one. The saved model targets an opset ATC accepts (ATC_MAX_OPSET); a higher opset from the
exporter is converted down with onnx.version_converter and recorded.
"""

from __future__ import annotations

import contextlib
import functools
import glob
import hashlib
import logging
import os
import re
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO
from unittest import mock

import onnx
import onnx.version_converter
import torch
from omskills.contracts.layout import TreeLayout, dtype_name
from omskills.contracts.pytree import flatten, spec_from_str, unflatten_call
from omskills.convert.translations import translated_ops, translation_table
from omskills.errors import InputError, OmskillsError
from omskills.files import process_alive
from omskills.onnxfiles.onnx_io import data_path, save_onnx_streamed
from omskills.records.contracts import ContractSpec, NonTensorArg, ShapeStrategy
from omskills.records.export import ExporterName, ExportResult
from torch import nn

ATC_MIN_OPSET = 9
ATC_MAX_OPSET = 18
ATC_OPSET_FACT_SOURCE = (
    "Huawei CANN 7.0 ATC instructions (ONNX model conversion): ONNX 1.12, opset v9-v18; "
    "CANN 8.x operator specifications document opsets per operator, none above 18"
)

# Loggers whose records belong in the export log while an export runs.
_EXPORTER_LOGGERS = ("torch", "onnxscript", "onnx_ir")


class ExportError(OmskillsError):
    """An exporter failed; the message names the candidate, the cause and the log."""


def constant_values(contract: ContractSpec, overrides: Mapping[str, Any] | None = None) -> list[Any]:
    """The value of every non-tensor argument, to bind into the exported graph.

    `overrides` (tree_path -> value, e.g. taken from a sample call) wins over the recorded
    `value`; an argument that varies across calls cannot be bound and is refused.
    """
    overrides = overrides or {}
    unknown = sorted(set(overrides) - {arg.tree_path for arg in contract.non_tensor_args})
    if unknown:
        raise InputError(f"constants: {unknown} are not non-tensor arguments of contract {contract.candidate!r}")
    return [_constant_value(contract.candidate, arg, overrides) for arg in contract.non_tensor_args]


def _constant_value(candidate: str, arg: NonTensorArg, overrides: Mapping[str, Any]) -> Any:
    if arg.derived is not None:
        return None  # computed from the input shapes on each call (ContractSpec.call_values)
    if not arg.constant:
        raise InputError(
            f"contract {candidate!r}: non-tensor argument {arg.tree_path} varies across calls "
            f"(first seen {arg.value_repr}); it cannot be bound into an exported graph"
        )
    if arg.tree_path in overrides:
        return overrides[arg.tree_path]
    if arg.value is None and arg.value_repr != "None":  # a genuine None leaf is a known value
        raise InputError(
            f"contract {candidate!r}: non-tensor argument {arg.tree_path} ({arg.value_repr}) has no recorded "
            "value; pass constants={path: value} taken from a sample call"
        )
    return arg.value


# --------------------------------------------------------------------------- wrapper


class ContractWrapper(nn.Module):
    """The candidate seen through its contract: flat tensors in, flat tuple of tensors out."""

    def __init__(self, module: nn.Module, contract: ContractSpec, constants: Mapping[str, Any] | None = None):
        super().__init__()
        self.module = module
        self.contract = contract
        self.candidate = contract.candidate
        self.method = contract.method
        self.input_count = len(contract.inputs)
        self.call_layout = TreeLayout.of_call(contract)
        # Non-tensor outputs cannot leave an ONNX graph; the wrapper returns the tensors only.
        self.output_layout = TreeLayout.of_output(contract)
        self.in_spec = spec_from_str(contract.in_spec)
        self.out_spec = spec_from_str(contract.out_spec)
        self.constants = constant_values(contract, constants)

    def forward(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if len(inputs) != self.input_count:
            raise InputError(f"{self.candidate}: wrapper takes {self.input_count} tensors, got {len(inputs)}")
        values = self.contract.call_values(self.constants, inputs)
        args, kwargs = unflatten_call(self.call_layout.merge(inputs, values), self.in_spec)
        # forward through __call__ so the candidate's hooks run as they do on the main path.
        call = self.module if self.method == "forward" else getattr(self.module, self.method)
        out = flatten(call(*args, **kwargs))
        if out.spec != self.out_spec:
            raise InputError(f"{self.candidate}: output structure differs from the contract's out_spec")
        return tuple(self.output_layout.tensors_of(out.leaves))


# --------------------------------------------------------------------------- export


def dynamic_dims_from_strategy(contract: ContractSpec, strategy: ShapeStrategy) -> dict[str, dict[int, str]]:
    """Symbolic dims for the exporter from a shape strategy's -1 dims.

    dynamic_batch_size: every -1 dim is the one batch ("batch"); otherwise each -1 dim is its own
    symbol "<input>_d<dim>" (ATC fixes them per gear or range; ONNX only needs them symbolic).
    """
    names = {spec.name for spec in contract.inputs}
    dims: dict[str, dict[int, str]] = {}
    for name, shape in strategy.input_shapes.items():
        if name not in names:
            raise InputError(f"shape strategy: input_shapes names {name!r}, not an input of {contract.candidate!r}")
        for index, size in enumerate(shape):
            if size == -1:
                symbol = "batch" if strategy.kind == "dynamic_batch_size" else f"{name}_d{index}"
                dims.setdefault(name, {})[index] = symbol
    return dims


def export_onnx(
    module: nn.Module,
    contract: ContractSpec,
    sample_inputs: Sequence[torch.Tensor],
    out_path: str | Path,
    *,
    dynamic_dims: Mapping[str, Mapping[int, str]] | None = None,
    exporter: ExporterName = "dynamo",
    opset: int = ATC_MAX_OPSET,
    exporter_opset: int | None = None,
    constants: Mapping[str, Any] | None = None,
    log_path: str | Path | None = None,
) -> ExportResult:
    """Export `module` through its contract wrapper to `out_path` (.onnx), fp32, under no_grad.

    sample_inputs: the contract's tensor inputs in contract order (one real call).
    dynamic_dims: tensor name -> {dim index: symbol}; equal symbols are one dimension.
      Inputs drive both exporters; output entries are used by the legacy one.
    exporter: "dynamo" (torch.export based) or "legacy" (TorchScript).
    opset: the default-domain opset of the saved model (ATC accepts 9..18).
    exporter_opset: the opset to ask the exporter for (default `opset`); when higher, the
      model is converted down to `opset` with onnx.version_converter.
    constants: tree_path -> value for non-tensor arguments without a recorded value.
    log_path: where exporter output goes (default "<out_path>.export.log"); kept on failure.
    """
    out_path = Path(out_path)
    log_path = Path(log_path) if log_path else out_path.with_name(out_path.name + ".export.log")
    samples = _checked_samples(contract, sample_inputs)
    axes = _checked_dynamic_dims(contract, dynamic_dims or {})
    _check_opsets(opset, exporter_opset)
    if exporter not in ("dynamo", "legacy"):
        raise InputError(f"exporter: expected 'dynamo' or 'legacy', got {exporter!r}")
    if out_path.suffix != ".onnx":
        raise InputError(f"out_path: expected a .onnx file, got {out_path}")
    wrapper = ContractWrapper(module, contract, constants)
    _check_fp32(contract.candidate, module)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    log_path.parent.mkdir(parents=True, exist_ok=True)

    started = time.perf_counter()
    _remove_dead_scratch(out_path)
    with tempfile.TemporaryDirectory(prefix=f".{out_path.stem}-export-{os.getpid()}-", dir=out_path.parent) as tmp:
        raw_path = Path(tmp) / "model.onnx"
        with log_path.open("w", encoding="utf-8") as log, _exporter_output_to(log):
            log.write(f"# export of {contract.candidate} ({contract.module_path}) with the {exporter} exporter\n")
            try:
                run = functools.partial(
                    _run_exporter, wrapper, samples, raw_path, contract, axes, exporter, exporter_opset or opset
                )
                capture, capture_reason = _capture(run, exporter, log)
                model, produced_opset = _load_exported(raw_path)
                if produced_opset > opset:
                    log.write(f"# converting opset {produced_opset} -> {opset} (onnx.version_converter)\n")
                    model = onnx.version_converter.convert_version(model, opset)
                _check_graph_names(contract, model)
                external = save_onnx_streamed(model, out_path, Path(tmp), _folder_bytes(Path(tmp)))
            except Exception as exc:  # every exporter failure becomes one ExportError with the log
                traceback.print_exception(exc, file=log)
                # No model from an earlier export may stand at out_path as if this one had made it.
                out_path.unlink(missing_ok=True)
                data_path(out_path).unlink(missing_ok=True)
                cause = _cause_line(exc)
                raise ExportError(
                    f"export of {contract.candidate} with the {exporter} exporter failed: "
                    f"{export_limit(cause)}: {cause} (log: {log_path})"
                ) from exc
            log.write(f"# saved {out_path} (external data: {external})\n")
    seconds = time.perf_counter() - started

    weights = data_path(out_path)
    files = [out_path] + ([weights] if external else [])
    return ExportResult(
        path=str(out_path),
        exporter=exporter,
        capture=capture,
        capture_reason=capture_reason,
        custom_translations=translated_ops() if exporter == "dynamo" else [],
        opset=_default_opset(model),
        converted_from_opset=produced_opset if produced_opset > opset else None,
        seconds=round(seconds, 3),
        bytes=sum(f.stat().st_size for f in files),
        sha256=_sha256(files),
        external_data=external,
        log_path=str(log_path),
        input_names=[i.name for i in model.graph.input],
        output_names=[o.name for o in model.graph.output],
        fact_source=ATC_OPSET_FACT_SOURCE,
    )


def _checked_samples(contract: ContractSpec, samples: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    where = f"sample_inputs for {contract.candidate!r}"
    if len(samples) != len(contract.inputs):
        raise InputError(f"{where}: expected {len(contract.inputs)} tensors in contract order, got {len(samples)}")
    for spec, tensor in zip(contract.inputs, samples):
        if not isinstance(tensor, torch.Tensor):
            raise InputError(f"{where}: {spec.name} is {type(tensor).__name__}, not a tensor")
        if dtype_name(tensor.dtype) != spec.dtype:
            raise InputError(f"{where}: {spec.name} is {dtype_name(tensor.dtype)}, the contract says {spec.dtype}")
    return tuple(samples)


def _checked_dynamic_dims(contract: ContractSpec, dims: Mapping[str, Mapping[int, str]]) -> dict[str, dict[int, str]]:
    ranks = {spec.name: len(spec.shape) for spec in contract.inputs + contract.outputs}
    checked: dict[str, dict[int, str]] = {}
    for name, axes in dims.items():
        if name not in ranks:
            raise InputError(f"dynamic_dims: {name!r} is not an input or output of {contract.candidate!r}")
        for dim in axes:
            if not 0 <= int(dim) < ranks[name]:
                raise InputError(f"dynamic_dims: {name!r} has rank {ranks[name]}, no dim {dim}")
        checked[name] = {int(dim): str(symbol) for dim, symbol in axes.items()}
    return checked


def _check_opsets(opset: int, exporter_opset: int | None) -> None:
    if not ATC_MIN_OPSET <= opset <= ATC_MAX_OPSET:
        raise InputError(
            f"opset: {opset} is outside what ATC accepts ({ATC_MIN_OPSET}..{ATC_MAX_OPSET}; {ATC_OPSET_FACT_SOURCE})"
        )
    if exporter_opset is not None and exporter_opset < opset:
        raise InputError(f"exporter_opset: {exporter_opset} is below the target opset {opset}")


def _check_fp32(candidate: str, module: nn.Module) -> None:
    # The graph is exported in fp32; a half-precision weight would put casts in it.
    for name, tensor in list(module.named_parameters()) + list(module.named_buffers()):
        if tensor.is_floating_point() and tensor.dtype != torch.float32:
            raise InputError(
                f"{candidate}: {name} is {dtype_name(tensor.dtype)}; export runs in fp32 (convert with .float())"
            )


@contextlib.contextmanager
def _eval_mode(module: nn.Module) -> Iterator[None]:
    """Eval mode for the export, then every submodule's own training flag back."""
    flags = {m: m.training for m in module.modules()}
    module.eval()
    try:
        yield
    finally:
        for m, training in flags.items():
            m.training = training


@contextlib.contextmanager
def _exporter_output_to(log: TextIO) -> Iterator[None]:
    """Python-level prints, warnings and exporter log records go to `log`, never to stdout."""
    handler = logging.StreamHandler(log)
    handler.setLevel(logging.INFO)
    loggers = [logging.getLogger(name) for name in _EXPORTER_LOGGERS]
    for logger in loggers:
        logger.addHandler(handler)
    try:
        with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log), _warnings_to(log):
            yield
    finally:
        for logger in loggers:
            logger.removeHandler(handler)


@contextlib.contextmanager
def _warnings_to(log: TextIO) -> Iterator[None]:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("default")

        def show(message, category, filename, lineno, file=None, line=None):  # noqa: ANN001
            log.write(warnings.formatwarning(message, category, filename, lineno, line))

        warnings.showwarning = show
        yield


def _remove_dead_scratch(out_path: Path) -> None:
    """The scratch folders of exports whose process is gone (killed mid-export: its own cleanup
    never ran), beside `out_path`; a live process's are left alone."""
    prefix = f".{out_path.stem}-export-"
    for folder in out_path.parent.glob(f"{glob.escape(prefix)}*"):
        pid = folder.name[len(prefix) :].split("-")[0]
        if folder.is_dir() and not folder.is_symlink() and pid.isdigit() and not process_alive(int(pid)):
            shutil.rmtree(folder, ignore_errors=True)


def _capture(run_exporter: Callable[[], None], exporter: ExporterName, log: TextIO) -> tuple[str | None, str | None]:
    """Run the exporter; a dynamo capture that stops on a data-dependent guard is retried on the
    model's compile path. Returns (capture, reason) for the record."""
    if exporter == "legacy":
        run_exporter()
        return None, None
    try:
        run_exporter()
        return "torch_export", None
    except Exception as exc:
        if not _is_data_dependent_guard(exc):
            raise
        reason = _cause_line(exc)
        traceback.print_exception(exc, file=log)
        log.write(
            f"# non-strict capture stopped on a data-dependent guard ({reason}); "
            "retrying with torch.compiler.is_dynamo_compiling() reporting True (the model's compile path)\n"
        )
    with model_compile_path():
        run_exporter()
    return "compile_path", reason


def _is_data_dependent_guard(exc: BaseException) -> bool:
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, GuardOnDataDependentSymNode):
            return True
        seen = seen.__cause__ or seen.__context__
    return "GuardOnDataDependentSymNode" in str(exc)


@contextlib.contextmanager
def model_compile_path() -> Iterator[None]:
    """Model code that asks torch.compiler.is_dynamo_compiling() takes its torch.compile branch.

    Models written for torch.compile keep data-dependent Python behind that check (a DETR-style
    decoder compares a tensor-valued feature size with a cached one, then asserts shapes);
    torch.export's non-strict capture does not set the flag, so those lines stop it on a
    data-dependent guard. With the flag on, the traced graph is the one torch.compile would
    run, which the probe then checks against the eager outputs.
    """
    original = torch.compiler.is_dynamo_compiling
    torch.compiler.is_dynamo_compiling = lambda: True
    try:
        yield
    finally:
        torch.compiler.is_dynamo_compiling = original


# The registry of torchlib translations built once per opset (see _torchlib_registry_reused).
_TORCHLIB_REGISTRIES: dict[int, Any] = {}


@contextlib.contextmanager
def _torchlib_registry_reused() -> Iterator[None]:
    """torch builds its table of torchlib translations anew for every export (about 2 s of reading
    onnxscript's function signatures); the table depends only on the opset, so each export gets a
    copy of one built once, into which torch then registers the custom translations."""
    from torch.onnx._internal.exporter import _registration

    build = _registration.ONNXRegistry.from_torchlib

    def from_torchlib(cls: type, opset_version: int = _registration._constants.TORCHLIB_OPSET) -> Any:
        if opset_version not in _TORCHLIB_REGISTRIES:
            _TORCHLIB_REGISTRIES[opset_version] = build(opset_version=opset_version)
        built = _TORCHLIB_REGISTRIES[opset_version]
        registry = cls()
        registry._opset_version = built._opset_version
        registry.functions = {target: list(metas) for target, metas in built.functions.items()}
        return registry

    with mock.patch.object(_registration.ONNXRegistry, "from_torchlib", classmethod(from_torchlib)):
        yield


@contextlib.contextmanager
def _linear_rewrite_rules() -> Iterator[None]:
    """The exporter's graph optimiser without the rewrite rules whose pattern ends in several
    nodes. onnxscript matches such a pattern by trying, for each node, every combination of graph
    nodes of the other ends' types (quadratic in the graph's size): its rule pairing two Slices of
    one tensor into a Split took 65 s of a 137 s export on a 2,200-node transformer backbone with
    a rotary embedding in every layer, and rewrote nothing (torch writes Slices with a steps
    input, which the pattern does not take). Where it would apply, the pair stays two Slices,
    which ONNX Runtime and ATC run as they are."""
    from onnxscript import rewriter

    rules = getattr(rewriter, "_DEFAULT_REWRITE_RULES", None)
    if rules is None:
        yield
        return
    rewriter._DEFAULT_REWRITE_RULES = tuple(rule for rule in rules if not _has_several_ends(rule))
    try:
        yield
    finally:
        rewriter._DEFAULT_REWRITE_RULES = rules


def _has_several_ends(rule: Any) -> bool:
    pattern = getattr(rule, "_target_pattern", None)
    return pattern is not None and not getattr(pattern, "has_single_output_node", True)


def _release_rewriter_matches() -> None:
    """Drop what onnxscript's default rewrite rules remember of their last match.

    Each rule's matcher keeps the graph it last matched in, and an exported graph's weights are
    the module's own parameters (wrapped, not copied): so after an export the rules kept some of
    the model's weights alive, however long after the model itself was released."""
    from onnxscript import rewriter
    from onnxscript.rewriter import _basics

    for rule in getattr(rewriter, "_DEFAULT_REWRITE_RULES", ()):
        matcher = getattr(rule, "_matcher", None)
        if matcher is None:
            continue
        for attribute in ("_graph", "_current_node"):
            if hasattr(matcher, attribute):
                setattr(matcher, attribute, None)
        if hasattr(matcher, "_match"):
            matcher._match = _basics.MatchResult()


def _run_exporter(
    wrapper: ContractWrapper,
    samples: tuple[torch.Tensor, ...],
    path: Path,
    contract: ContractSpec,
    axes: dict[str, dict[int, str]],
    exporter: ExporterName,
    opset: int,
) -> None:
    input_names = [spec.name for spec in contract.inputs]
    output_names = [spec.name for spec in contract.outputs]
    device_type = samples[0].device.type if samples else "cpu"
    with torch.no_grad(), torch.autocast(device_type, enabled=False), _eval_mode(wrapper):
        if exporter == "dynamo":
            # The wrapper's forward takes *inputs: one dynamic-shape entry per tensor, in one tuple.
            shapes = tuple(axes.get(name) for name in input_names)
            try:
                with _torchlib_registry_reused(), _linear_rewrite_rules():
                    torch.onnx.export(
                        wrapper,
                        samples,
                        str(path),
                        dynamo=True,
                        opset_version=opset,
                        input_names=input_names,
                        output_names=output_names,
                        dynamic_shapes=(shapes,) if axes else None,
                        custom_translation_table=translation_table(),
                        external_data=True,
                        verbose=False,
                    )
            finally:
                _release_rewriter_matches()
        else:
            # torch enables the TorchScript exporter's C++ log on every export (it tests the function
            # object, not its result) and that log writes to C++ stdout: send it to stderr for good.
            torch._C._jit_set_onnx_log_output_stream("stderr")
            torch.onnx.export(
                wrapper,
                samples,
                str(path),
                dynamo=False,
                opset_version=opset,
                input_names=input_names,
                output_names=output_names,
                dynamic_axes=axes or None,
                verbose=False,
            )
    if not path.is_file():
        raise ExportError(f"the {exporter} exporter wrote no file at {path}")


def _default_opset(model: onnx.ModelProto) -> int:
    for entry in model.opset_import:
        if entry.domain in ("", "ai.onnx"):
            return entry.version
    raise ExportError("the exported model imports no default-domain opset")


def _load_exported(path: Path) -> tuple[onnx.ModelProto, int]:
    # Weights stay on disk until the model is saved: conversion only rewrites the graph.
    model = onnx.load(str(path), load_external_data=False)
    return model, _default_opset(model)


def _check_graph_names(contract: ContractSpec, model: onnx.ModelProto) -> None:
    """Outputs must be the contract's, in order; inputs a subset (unused ones may be dropped)."""
    outputs = [o.name for o in model.graph.output]
    expected_outputs = [spec.name for spec in contract.outputs]
    if outputs != expected_outputs:
        raise ExportError(f"graph outputs {outputs} differ from the contract's {expected_outputs}")
    unknown = [i.name for i in model.graph.input if i.name not in {spec.name for spec in contract.inputs}]
    if unknown:
        raise ExportError(f"graph inputs {unknown} are not inputs of the contract")


def _folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def _sha256(files: list[Path]) -> str:
    digest = hashlib.sha256()
    for path in files:
        with path.open("rb") as handle:
            for chunk in iter(lambda: handle.read(1 << 20), b""):
                digest.update(chunk)
    return digest.hexdigest()


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_BOILERPLATE = (
    "(refer to the full stack trace",
    "for more information",
    "the above exception",
    "traceback (most recent call last)",
    "⬆",
    "- ",
)


# What an exporter's error says, in a few words a user acts on (first match wins).
EXPORT_LIMITS: tuple[tuple[re.Pattern[str], str], ...] = tuple(
    (re.compile(pattern, re.I), limit)
    for pattern, limit in (
        (r"data.dependent|GuardOnDataDependent|unbacked", "data-dependent shape or control flow: kept in Python"),
        (
            r"UnsupportedOperator|no (onnx )?(function|decomposition|translation|symbolic)|not supported|unsupported",
            "an operator with no ONNX translation",
        ),
        (
            r"Constraints violated|specializ|Dim\.|dynamic_shapes",
            "a dim the strategy makes dynamic is fixed by the model's code",
        ),
        (r"complex", "complex tensors, which ONNX has not"),
        (r"out of memory|Cannot allocate|MemoryError", "out of memory"),
    )
)


def export_limit(cause: str) -> str:
    """The kind of exporter limit `cause` (an error's one line) shows, or "export error"."""
    return next((limit for pattern, limit in EXPORT_LIMITS if pattern.search(cause)), "export error")


def _cause_line(exc: BaseException) -> str:
    """The line of an exporter error that says what went wrong.

    torch's dynamo exporter wraps the cause in a page of advice; its "## Exception summary"
    lists the causes as "<class 'x.Y'>: message", root cause first.
    """
    lines = [_ANSI.sub("", line).strip() for line in str(exc).splitlines()]
    lines = [line for line in lines if line and not line.lower().startswith(_BOILERPLATE)]
    summary = [line for line in lines if line.startswith("<class '")]
    if summary:
        cls, _, message = summary[0].partition("'>: ")
        return f"{cls.rsplit('.', 1)[-1]}: {message}"
    if lines:
        return f"{type(exc).__name__}: {lines[-1]}" if len(lines) == 1 else lines[-1]
    return type(exc).__name__
