"""One interface for every runtime that can execute a compiled candidate.

Shaped like NVIDIA Polygraphy's runners: `Runner` is what serving hands out, a loaded model that
maps named numpy feeds to named numpy outputs, whether a backend runs each call itself
(`RuntimeBackend`) or a wrapper runs it on another runner (`batch_split.SplitBatchBackend`).
`RuntimeBackend` owns the life cycle (activate -> run -> close), checks each feed against the
model's input metadata before the backend sees it, and times the inference; a backend only
implements the three `_impl` hooks. A spliced module therefore behaves the same whichever backend
runs underneath.

The class also holds its serving policy, which load_adapted, verify and bundles go through
(`runtime.serving`): whether this machine can run it, whether it can open a deployed graph's
artifact, how it opens one (device, mode, batch) and where "auto" ranks it.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
from omskills.errors import OmskillsError
from omskills.records.base import Record
from omskills.records.deploy import DeployedGraph
from pydantic import field_validator

# The name a backend is registered under in omskills.runtime.BACKENDS ("onnxruntime", "om", or a third party's).
BackendKind = str

# Shown for a dimension whose size is only known at run time and has no name.
ANONYMOUS_DIM = "?"


class BackendError(OmskillsError):
    """A backend cannot be opened or cannot run (missing runtime, bad option, load failure)."""


class BackendInputError(BackendError):
    """A feed does not match the model's inputs (name, rank, dtype or a static dimension)."""


class IOSpec(Record):
    """One input or output of a loaded model, as the runtime reports it."""

    name: str
    # Static sizes are ints; symbolic sizes keep their name ("batch"), unnamed ones are "?".
    shape: list[int | str]
    dtype: str  # numpy spelling: "float32", "int64", "bool", ...

    @field_validator("shape", mode="before")
    @classmethod
    def _symbolic_dims_as_text(cls, dims: object) -> object:
        # Runtimes spell "unknown" as None (ONNX Runtime) or a negative size (ACL's -1).
        if not isinstance(dims, (list, tuple)):
            return dims
        return [ANONYMOUS_DIM if d is None or (isinstance(d, int) and d < 0) else d for d in dims]

    @property
    def is_static(self) -> bool:
        return all(isinstance(d, int) for d in self.shape)


@dataclass(frozen=True)
class HeldOutput:
    """A graph output the runtime kept where it computed it, not copied back: its shape, and how to
    copy it back when the host reads it after all. A runner returns one for each output it was not
    asked to fetch, when it can leave outputs on its device (see `Runner.run`)."""

    shape: tuple[int, ...]
    copy_back: Callable[[], np.ndarray]


@dataclass(frozen=True)
class Placement:
    """What a deployment asks of the backend that opens a graph; the backend picks its device from it."""

    device_id: int = 0  # the NPU
    providers: tuple[str, ...] | None = None  # ONNX Runtime's providers in order (None: the preferred ones present)
    model: Path | None = None  # opened instead of the graph's ONNX file (an emulated rewrite of it, say)


class Runner(ABC):
    """A loaded model that maps named numpy feeds to named numpy outputs.

    Use as a context manager, or call `close()`.
    """

    kind: BackendKind  # the backend that runs the calls
    device: str  # where the model really runs ("" until it is loaded)
    # Set by `batch_split.served_in_gears` on a graph with batch gears it does not split: why a
    # batch that is no gear cannot run as gear-sized calls (the splice tells it with the fallback).
    unsplit: str | None = None

    @property
    @abstractmethod
    def inputs(self) -> list[IOSpec]: ...

    @property
    @abstractmethod
    def outputs(self) -> list[IOSpec]: ...

    @abstractmethod
    def describe(self) -> str:
        """Short label for reports: which runtime and device really ran."""

    @abstractmethod
    def activate(self) -> Runner:
        """Load the model (once); return the runner."""

    @abstractmethod
    def close(self) -> None:
        """Free the loaded model."""

    @abstractmethod
    def run(self, feeds: Mapping[str, np.ndarray], fetch: Collection[str] | None = None) -> dict[str, Any]:
        """Outputs by name (model order) for `feeds`. `fetch`: the outputs the host reads (None:
        all); the others may come back as `HeldOutput`s, left on the device, where the runner can
        leave them (else as arrays, copied back like the rest)."""

    def __enter__(self) -> Runner:
        return self.activate()

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class RuntimeBackend(Runner):
    """A runner that runs each call itself, on one runtime.

    The model is loaded on first use (`activate()`, `run()`, `inputs`, `outputs` or entering the
    `with` block).
    """

    kind: ClassVar[BackendKind]
    # Where "auto" tries this backend (lowest first); None: used only when asked for by name.
    auto_rank: ClassVar[int | None] = None

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise BackendError(f"model file not found: {self.path}")
        # Filled by the backend on activation: where the model really runs.
        self.device: str = ""
        # Wall time of the last `run` call's inference, in seconds (feed checks excluded).
        self.last_seconds: float | None = None
        self._inputs: list[IOSpec] = []
        self._outputs: list[IOSpec] = []
        self._active = False

    # -- serving policy -----------------------------------------------------------------------

    @classmethod
    def unavailable(cls) -> str | None:
        """Why this machine cannot run this backend, or None."""
        return None

    @classmethod
    def runs_here(cls) -> list[str]:
        """What this backend runs on this machine, one label per way it runs (a provider, say):
        none when it cannot run here. The machine probe and `available_backends` list these."""
        return [cls.kind] if cls.unavailable() is None else []

    @classmethod
    def cannot_serve(cls, graph: DeployedGraph) -> str | None:
        """Why this backend cannot open `graph`'s artifact, or None (by default it opens the ONNX file)."""
        return None

    @classmethod
    def serve(cls, graph: DeployedGraph, root: Path, placement: Placement) -> Runner:
        """`graph` opened as a deployment runs it (artifact paths are relative to `root`). By default:
        its ONNX file, or `placement.model`, with the backend's default options."""
        return cls(placement.model or root / graph.onnx.path).activate()

    # -- life cycle -------------------------------------------------------------------------

    def activate(self) -> RuntimeBackend:
        if not self._active:
            self._inputs, self._outputs = self._activate_impl()
            self._active = True
        return self

    def close(self) -> None:
        if self._active:
            self._active = False
            self._deactivate_impl()

    # -- metadata ---------------------------------------------------------------------------

    @property
    def inputs(self) -> list[IOSpec]:
        self.activate()
        return list(self._inputs)

    @property
    def outputs(self) -> list[IOSpec]:
        self.activate()
        return list(self._outputs)

    def describe(self) -> str:
        """Short label for reports: which runtime and device really ran."""
        return f"{self.kind}:{self.device}" if self.device else self.kind

    # -- inference --------------------------------------------------------------------------

    def run(self, feeds: Mapping[str, np.ndarray], fetch: Collection[str] | None = None) -> dict[str, Any]:
        """Check `feeds` against the inputs, run the model, return outputs by name (model order);
        with `fetch`, outputs outside it as the backend's `_fetch_impl` leaves them."""
        self.activate()
        arrays = check_feeds(self._inputs, feeds, model=self.path.name)
        names = [spec.name for spec in self._outputs if fetch is None or spec.name in fetch]
        started = time.perf_counter()
        produced = self._fetch_impl(arrays, names) if len(names) < len(self._outputs) else self._infer_impl(arrays)
        self.last_seconds = time.perf_counter() - started
        return self._ordered_outputs(produced)

    def _ordered_outputs(self, produced: Mapping[str, Any]) -> dict[str, Any]:
        missing = [spec.name for spec in self._outputs if spec.name not in produced]
        if missing:
            raise BackendError(f"{self.kind} backend on {self.path.name} returned no value for output(s) {missing}")
        return {spec.name: _array_or_held(produced[spec.name]) for spec in self._outputs}

    # -- hooks for backends -----------------------------------------------------------------

    @abstractmethod
    def _activate_impl(self) -> tuple[list[IOSpec], list[IOSpec]]:
        """Load the model; set `self.device`; return (inputs, outputs) in the model's order."""

    @abstractmethod
    def _infer_impl(self, feeds: dict[str, np.ndarray]) -> Mapping[str, np.ndarray]:
        """Run once on feeds already checked (one array per input name)."""

    @abstractmethod
    def _deactivate_impl(self) -> None:
        """Free what `_activate_impl` allocated."""

    def _fetch_impl(self, feeds: dict[str, np.ndarray], names: list[str]) -> Mapping[str, Any]:
        """Run once, copying back only the outputs `names`; every other output as a `HeldOutput`.
        By default a backend cannot leave outputs on its device: all come back as arrays."""
        return self._infer_impl(feeds)


def _array_or_held(value: Any) -> Any:
    return value if isinstance(value, HeldOutput) else np.asarray(value)


def check_feeds(specs: list[IOSpec], feeds: Mapping[str, object], model: str) -> dict[str, np.ndarray]:
    """Return the feeds as arrays after checking names, dtype, rank and static dims.

    Each problem raises `BackendInputError` naming the input, so a caller outside the
    contract learns what to fix instead of reading a runtime's stack trace.
    """
    expected = [spec.name for spec in specs]
    missing = [name for name in expected if name not in feeds]
    unknown = [name for name in feeds if name not in expected]
    if missing or unknown:
        parts = []
        if missing:
            parts.append(f"missing input(s) {missing}")
        if unknown:
            parts.append(f"unknown input(s) {unknown}")
        raise BackendInputError(f"{model}: {'; '.join(parts)}; the model takes {expected}")
    return {spec.name: _checked_array(spec, feeds[spec.name], model) for spec in specs}


def _checked_array(spec: IOSpec, value: object, model: str) -> np.ndarray:
    if isinstance(value, np.generic):
        value = np.asarray(value)
    if not isinstance(value, np.ndarray):
        raise BackendInputError(f"{model}: input '{spec.name}' must be a numpy.ndarray, got {type(value).__name__}")
    if value.dtype != np.dtype(spec.dtype):
        raise BackendInputError(f"{model}: input '{spec.name}' has dtype {value.dtype}, expected {spec.dtype}")
    if value.ndim != len(spec.shape):
        raise BackendInputError(
            f"{model}: input '{spec.name}' has rank {value.ndim} (shape {list(value.shape)}), "
            f"expected rank {len(spec.shape)} (shape {spec.shape})"
        )
    for axis, (size, want) in enumerate(zip(value.shape, spec.shape)):
        if isinstance(want, int) and size != want:
            raise BackendInputError(
                f"{model}: input '{spec.name}' has size {size} on dim {axis} (shape {list(value.shape)}), "
                f"expected {want} (shape {spec.shape})"
            )
    return value
