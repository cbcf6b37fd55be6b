"""Make direct `module.forward(...)` calls visible to forward hooks, for the duration of a run.

Some models call a submodule's `forward` method directly (SAM 3:
`self.vision_backbone.forward(samples)`), which bypasses `nn.Module.__call__` and so every
forward hook: profiler, provenance and contract capture would never see the call. Inside
`route_forward_calls`, such a call is sent through `__call__` once; the inner `forward`
call that `__call__` makes runs the original method.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator

from torch import nn


@contextlib.contextmanager
def route_forward_calls(modules: list[nn.Module]) -> Iterator[None]:
    state = threading.local()
    patched: list[nn.Module] = []

    def router(module: nn.Module, original: Any) -> Any:
        def forward(*args: Any, **kwargs: Any) -> Any:
            inside = getattr(state, "inside", set())
            if id(module) in inside:
                return original(*args, **kwargs)
            state.inside = inside | {id(module)}
            try:
                return module(*args, **kwargs)  # __call__: hooks, then forward -> original
            finally:
                state.inside = inside

        return forward

    try:
        for module in modules:
            if "forward" not in module.__dict__:
                module.forward = router(module, module.forward)  # type: ignore[method-assign]
                patched.append(module)
        yield
    finally:
        for module in patched:
            del module.forward
