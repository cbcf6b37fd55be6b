"""Running a compiled graph behind one runner interface, whichever registered backend runs it."""

#     with open_backend("model.onnx", "onnxruntime") as backend:
#         outputs = backend.run({"x": array})     # dict name -> np.ndarray, model order
#         backend.last_seconds, backend.describe()
#
# `available_backends()` says what this machine can run, e.g. ["onnxruntime:CPUExecutionProvider"]:
# what each registered backend says it runs here (`RuntimeBackend.runs_here`). Backends are entries
# of the `omskills.backends` registry (entry-point group of the same name): a third-party backend
# registers there as the built-in ones do.

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
    Runner,
    RuntimeBackend,
    check_feeds,
)
from omskills.runtime.onnxruntime_backend import PREFERRED_PROVIDERS, OnnxRuntimeBackend, available_providers

BACKENDS: Registry[type[RuntimeBackend]] = Registry("runtime backend", group="omskills.backends")
BACKENDS.register("onnxruntime", OnnxRuntimeBackend)
# The OM backend lives with the rest of Ascend, a layer above this one: registered by reference, it
# is imported only when looked up.
BACKENDS.register("om", "omskills.ascend.om_backend:OmBackend")


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
    """What this machine can run: every registered backend's `runs_here()` labels, in the registry's
    order (one 'onnxruntime:<provider>' per preferred provider present, 'om' where an NPU runs OMs).
    A backend whose module does not import runs nothing here."""
    found: list[str] = []
    for name in BACKENDS.names():
        try:
            backend_class = BACKENDS.get(name)
        except RegistryError:
            continue
        found += backend_class.runs_here()
    return found


__all__ = [
    "ANONYMOUS_DIM",
    "BACKENDS",
    "PREFERRED_PROVIDERS",
    "BackendError",
    "BackendInputError",
    "BackendKind",
    "IOSpec",
    "OnnxRuntimeBackend",
    "Runner",
    "RuntimeBackend",
    "available_backends",
    "available_providers",
    "check_feeds",
    "open_backend",
]
