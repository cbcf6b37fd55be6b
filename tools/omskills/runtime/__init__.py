"""Runtime backends: run a compiled candidate (ONNX or OM) behind one interface.

    with open_backend("model.onnx", "onnxruntime") as backend:
        outputs = backend.run({"x": array})     # dict name -> np.ndarray, model order
        backend.last_seconds, backend.describe()

`available_backends()` says what this machine can run, e.g. ["onnxruntime:CPUExecutionProvider"].
Backends are entries of the `omskills.backends` registry (entry-point group of the same name):
a third-party backend registers there as the built-in ones do.
"""

from __future__ import annotations

import inspect
from pathlib import Path

from omskills.registry import Registry, RegistryError
from omskills.runtime.base import (
    ANONYMOUS_DIM,
    BackendError,
    BackendInputError,
    BackendKind,
    IOSpec,
    RuntimeBackend,
    check_feeds,
)
from omskills.runtime.om_backend import OM_MODES, OmBackend, OmMode, ais_bench_available, om_mode_for_strategy
from omskills.runtime.onnxruntime_backend import PREFERRED_PROVIDERS, OnnxRuntimeBackend, available_providers

BACKENDS: Registry[type[RuntimeBackend]] = Registry("runtime backend", group="omskills.backends")
BACKENDS.register("onnxruntime", OnnxRuntimeBackend)
BACKENDS.register("om", OmBackend)


def open_backend(path: str | Path, kind: BackendKind, **options: object) -> RuntimeBackend:
    """Load `path` with the backend `kind`; `options` go to that backend's constructor.

    onnxruntime: providers, threads, provider_options, fuse_attention, spin. om: device_id, mode, custom_sizes.
    """
    try:
        backend_class = BACKENDS.get(kind)
    except RegistryError:
        raise BackendError(f"kind: unknown backend {kind!r}; expected one of {BACKENDS.names()}") from None
    accepted = [name for name in inspect.signature(backend_class.__init__).parameters if name not in ("self", "path")]
    unknown = [name for name in options if name not in accepted]
    if unknown:
        raise BackendError(f"{kind} backend: unknown option(s) {unknown}; it takes {accepted}")
    return backend_class(path, **options).activate()


def available_backends() -> list[str]:
    """What this machine can run: one 'onnxruntime:<provider>' per preferred provider, plus 'om'."""
    found = [f"onnxruntime:{name}" for name in PREFERRED_PROVIDERS if name in available_providers()]
    if ais_bench_available():
        found.append("om")
    return found


__all__ = [
    "ANONYMOUS_DIM",
    "BACKENDS",
    "OM_MODES",
    "PREFERRED_PROVIDERS",
    "BackendError",
    "BackendInputError",
    "BackendKind",
    "IOSpec",
    "OmBackend",
    "OmMode",
    "OnnxRuntimeBackend",
    "RuntimeBackend",
    "available_backends",
    "available_providers",
    "check_feeds",
    "ais_bench_available",
    "om_mode_for_strategy",
    "open_backend",
]
