"""Module-level profiler for a main path: which nn.Modules run, how often, and for how long.

    with ModuleProfiler(model) as profiler:
        ... run the main path; call profiler.mark_prompt() per prompt, profiler.mark_frame()
        after each frame ...
    report = profiler.report()

Hooks go on every submodule (forward pre-hook + forward hook with `always_call`, so a
forward that raises still closes its timing) and are removed on exit whatever happens. The
call tree is the dynamic one: a module's parent is the hooked module whose forward was
running when it was called. Only `module(...)` calls are seen: a method other than
`forward` called directly (e.g. `backbone.forward_image(...)`) is not a node, its time
belongs to whichever module (or the control plane) called it, while the modules it calls
are still timed.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from omskills.records.profile import ModuleProfile, ProfileReport
from torch import nn
from torch.utils.hooks import RemovableHandle


@dataclass
class _Stats:
    calls: int = 0
    inclusive_s: float = 0.0
    exclusive_s: float = 0.0
    active: int = 0  # nesting depth of this path on the current call stack (recursion)
    callers: Counter[str | None] = field(default_factory=Counter)
    frames_called: int = 0
    last_frame: int = -1


@dataclass
class _Frame:
    path: str
    start: float
    children_s: float = 0.0


class ModuleProfiler:
    def __init__(self, root: nn.Module, min_share: float = 0.001, kept_depth: int = 3):
        self.root = root
        self.min_share = min_share
        self.kept_depth = kept_depth
        self._paths: list[tuple[str, nn.Module]] = list(root.named_modules())
        self._stats: dict[str, _Stats] = {}
        self._local = threading.local()
        self._lock = threading.Lock()
        self._handles: list[RemovableHandle] = []
        self._frames = 0
        self._prompts = 0
        self._frame_index = 0
        self._top_level_s = 0.0
        self._started: float | None = None
        self._stopped: float | None = None

    # -- driver API ----------------------------------------------------------------------
    def mark_frame(self) -> None:
        """Call once per main-path step (frame, image, request) after it; later calls count towards the next."""
        with self._lock:
            self._frames += 1
            self._frame_index += 1

    def mark_prompt(self) -> None:
        """Call once per prompt given to the model."""
        with self._lock:
            self._prompts += 1

    # -- context ---------------------------------------------------------------------------
    def __enter__(self) -> ModuleProfiler:
        try:
            for path, module in self._paths:
                self._handles.append(module.register_forward_pre_hook(self._pre_hook(path)))
                self._handles.append(module.register_forward_hook(self._post_hook(path), always_call=True))
        except BaseException:
            self._remove_hooks()
            raise
        self._started = time.perf_counter()
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            self._stopped = time.perf_counter()
        finally:
            self._remove_hooks()

    def _remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    # -- hooks -----------------------------------------------------------------------------
    def _stack(self) -> list[_Frame]:
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack

    def _pre_hook(self, path: str):
        def pre(module: nn.Module, args: Any) -> None:
            stack = self._stack()
            caller = stack[-1].path if stack else None
            with self._lock:
                stats = self._stats.setdefault(path, _Stats())
                stats.calls += 1
                stats.active += 1
                stats.callers[caller] += 1
                if stats.last_frame != self._frame_index:
                    stats.last_frame = self._frame_index
                    stats.frames_called += 1
            stack.append(_Frame(path, time.perf_counter()))

        return pre

    def _post_hook(self, path: str):
        def post(module: nn.Module, args: Any, output: Any) -> None:
            now = time.perf_counter()
            stack = self._stack()
            # Frames above ours belong to calls whose post-hook never ran; drop them.
            if not any(f.path == path for f in stack):
                return  # the profiler was entered while this forward was already running
            with self._lock:
                while stack[-1].path != path:
                    self._stats[stack.pop().path].active -= 1
                frame = stack.pop()
                elapsed = now - frame.start
                stats = self._stats[path]
                stats.exclusive_s += elapsed - frame.children_s
                if stats.active == 1:  # outermost call of this path: recursion is not counted twice
                    stats.inclusive_s += elapsed
                stats.active -= 1
                if stack:
                    stack[-1].children_s += elapsed
                else:
                    self._top_level_s += elapsed

        return post

    # -- report ----------------------------------------------------------------------------
    @property
    def total_seconds(self) -> float:
        if self._started is None:
            return 0.0
        return (self._stopped or time.perf_counter()) - self._started

    def report(self, notes: list[str] | None = None) -> ProfileReport:
        total = self.total_seconds
        modules = dict(self._paths)
        nodes = [self._node(path, stats, modules[path], total) for path, stats in self._stats.items()]
        kept = {n.path for n in nodes if n.depth <= self.kept_depth or n.share >= self.min_share}
        dropped = [n for n in nodes if n.path not in kept]
        kept_nodes = [
            n.model_copy(update={"parent": self._kept_parent(n.parent, kept)}) for n in nodes if n.path in kept
        ]
        return ProfileReport(
            total_seconds=total,
            module_seconds=self._top_level_s,
            frames=self._frames,
            prompts=self._prompts,
            modules_total=len(self._paths),
            modules_called=len(nodes),
            nodes=sorted(kept_nodes, key=lambda n: n.inclusive_s, reverse=True),
            dropped_nodes=len(dropped),
            dropped_exclusive_s=sum(n.exclusive_s for n in dropped),
            min_share=self.min_share,
            kept_depth=self.kept_depth,
            notes=notes or [],
        )

    def _node(self, path: str, stats: _Stats, module: nn.Module, total: float) -> ModuleProfile:
        own = sum(p.numel() for p in module.parameters(recurse=False))
        inclusive_params = sum(p.numel() for p in module.parameters())
        return ModuleProfile(
            path=path,
            parent=stats.callers.most_common(1)[0][0] if stats.callers else None,
            module_class=type(module).__name__,
            depth=0 if path == "" else path.count(".") + 1,
            params_own=own,
            params_total=inclusive_params,
            calls=stats.calls,
            calls_per_frame=stats.calls / self._frames if self._frames else None,
            calls_per_prompt=stats.calls / self._prompts if self._prompts else None,
            frames_called=stats.frames_called,
            inclusive_s=stats.inclusive_s,
            exclusive_s=stats.exclusive_s,
            share=stats.inclusive_s / total if total > 0 else 0.0,
            exclusive_share=stats.exclusive_s / total if total > 0 else 0.0,
        )

    def _kept_parent(self, parent: str | None, kept: set[str]) -> str | None:
        """Nearest kept caller: a dropped caller is replaced by its own caller."""
        seen: set[str] = set()
        while parent is not None and parent not in kept and parent not in seen:
            seen.add(parent)
            callers = self._stats[parent].callers
            parent = callers.most_common(1)[0][0] if callers else None
        return parent if parent in kept else None
