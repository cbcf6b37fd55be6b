"""Make direct `module.forward(...)` calls visible to forward hooks, for the duration of a run.

Some models call a submodule's `forward` method directly (e.g.
`self.vision_backbone.forward(samples)`), which bypasses `nn.Module.__call__` and so every
forward hook: profiler, provenance and contract capture would never see the call. Inside
`route_forward_calls`, such a call is sent through `__call__` once; the inner `forward`
call that `__call__` makes runs the original method. An ordinary `module(...)` call is left as
it is: hooks see each call once, and the output they record is what forward returned.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

from torch import nn


@contextlib.contextmanager
def route_forward_calls(modules: list[nn.Module]) -> Iterator[None]:
    # Depth of __call__ per module on this thread: inside __call__, `forward` is the original.
    state = threading.local()

    def depth() -> dict[int, int]:
        if not hasattr(state, "depth"):
            state.depth = {}
        return state.depth

    def enter(module: nn.Module, _args: Any) -> None:
        depth()[id(module)] = depth().get(id(module), 0) + 1

    def leave(module: nn.Module, _args: Any, _output: Any) -> None:
        depth()[id(module)] -= 1

    def router(module: nn.Module, original: Any) -> Any:
        def forward(*args: Any, **kwargs: Any) -> Any:
            if depth().get(id(module), 0) > 0:
                return original(*args, **kwargs)  # __call__ is running this module: its own forward
            return module(*args, **kwargs)  # a direct .forward(...) call: through __call__ and its hooks

        return forward

    patched: list[nn.Module] = []
    handles: list[Any] = []
    try:
        for module in modules:
            if "forward" not in module.__dict__:
                handles.append(module.register_forward_pre_hook(enter, prepend=True))
                handles.append(module.register_forward_hook(leave, always_call=True))
                module.forward = router(module, module.forward)  # type: ignore[method-assign]
                patched.append(module)
        yield
    finally:
        for handle in handles:
            handle.remove()
        for module in patched:
            del module.forward
