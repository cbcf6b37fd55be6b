"""Open the backend that serves one deployed graph, as its artifact and shape strategy require.

Each backend class holds its own policy (`RuntimeBackend.unavailable`, `cannot_serve`, `serve`,
`auto_rank`): the built-in ones open an OM in the mode of its ATC shape strategy (`om`) or the
ONNX file on the best provider present (`onnxruntime`), and a backend registered by entry point
serves load_adapted, verify and bundles the same way. "auto" takes the first backend by rank that
this machine runs and that can open every graph.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

from omskills.records.deploy import DeployedGraph
from omskills.registry import RegistryError
from omskills.runtime import BACKENDS
from omskills.runtime.base import BackendError, Placement, Runner, RuntimeBackend

logger = logging.getLogger(__name__)

AUTO = "auto"


def serving_choices() -> list[str]:
    """What a user may ask for: "auto" and every registered backend."""
    return [AUTO, *BACKENDS.names()]


def backend_class(name: str) -> type[RuntimeBackend]:
    try:
        return BACKENDS.get(name)
    except RegistryError:
        raise BackendError(f"backend: {name!r} is not one of {serving_choices()}") from None


def resolve_backend(requested: str, graphs: Sequence[DeployedGraph]) -> str:
    """The backend name for `requested`; "auto": the first by rank that this machine runs and that
    opens every graph. Logs what "auto" chose and why it passed over the others."""
    if requested != AUTO:
        backend_class(requested)
        return requested
    ranked = sorted(
        ((cls.auto_rank, name, cls) for name, cls in BACKENDS.items() if cls.auto_rank is not None),
        key=lambda entry: (entry[0], entry[1]),
    )
    passed: list[str] = []
    for _, name, cls in ranked:
        why = cls.unavailable() or _first_refusal(cls, graphs)
        if why is None:
            logger.info("backend auto: %s%s", name, f" ({'; '.join(passed)})" if passed else "")
            return name
        passed.append(f"not {name}: {why}")
    raise BackendError(f"backend auto: no backend serves every graph ({'; '.join(passed)})")


def _first_refusal(cls: type[RuntimeBackend], graphs: Sequence[DeployedGraph]) -> str | None:
    refused = [(graph.name, why) for graph in graphs if (why := cls.cannot_serve(graph))]
    return f"{[name for name, _ in refused]}: {refused[0][1]}" if refused else None


def open_graph(
    graph: DeployedGraph,
    root: Path,
    backend: str,
    *,
    device_id: int = 0,
    providers: Sequence[str] | None = None,
    model: Path | None = None,
) -> Runner:
    """The backend serving `graph`; `model` replaces the graph's ONNX file (an emulated rewrite of
    it, say)."""
    cls = backend_class(backend)
    why = cls.cannot_serve(graph)
    if why is not None:
        raise BackendError(f"{graph.name}: {why}, so it cannot run on the {backend} backend")
    placement = Placement(device_id=device_id, providers=tuple(providers) if providers else None, model=model)
    return cls.serve(graph, root, placement)
