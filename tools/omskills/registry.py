"""Named implementations of one kind, found the same way for model drivers, runtime backends,
comparators and skill tools.

A `Registry` holds entries `name -> target`. A target is the object itself or a reference
"package.module:attribute" that is imported on first use, so listing what is installed imports
nothing. Entries come from code (`register`) and, when the registry has an entry-point group,
from every installed distribution's `[project.entry-points."<group>"]` table (read with
`importlib.metadata`): a third-party package registers exactly as the built-ins do.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import threading
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from omskills.errors import OmskillsError

T = TypeVar("T")


class RegistryError(OmskillsError):
    """An unknown name, or an entry whose target cannot be imported."""


@dataclass(frozen=True)
class RegistryEntry:
    name: str
    reference: str  # "module:attribute", or the object's own module:qualname when registered as an object
    origin: str  # "entry point of <distribution>" or "registered in code"


def import_reference(reference: str, what: str) -> Any:
    """The object named "package.module:attribute.path"."""
    module_name, sep, attribute = reference.partition(":")
    if not sep or not module_name or not attribute:
        raise RegistryError(f"{what}: {reference!r} is not of the form 'package.module:Name'")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as err:
        raise RegistryError(f"{what}: cannot import {module_name!r} ({err})") from None
    for part in attribute.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise RegistryError(f"{what}: {module_name!r} has no {attribute!r}") from None
    return obj


def _reference_of(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '?')}:{getattr(obj, '__qualname__', type(obj).__qualname__)}"


class Registry(Generic[T]):
    def __init__(self, kind: str, group: str | None = None) -> None:
        self.kind = kind  # what the entries are, for messages ("model driver", "runtime backend")
        self.group = group
        self._code: dict[str, tuple[Any, str]] = {}
        self._loaded: dict[str, T] = {}
        self._lock = threading.Lock()

    def register(self, name: str, target: T | str) -> None:
        """Add an entry in code; `target` is the object or its "module:attribute" reference."""
        reference = target if isinstance(target, str) else _reference_of(target)
        with self._lock:
            self._code[name] = (target, reference)
            self._loaded.pop(name, None)

    def _entry_points(self) -> dict[str, importlib.metadata.EntryPoint]:
        if self.group is None:
            return {}
        return {ep.name: ep for ep in importlib.metadata.entry_points(group=self.group)}

    def entries(self) -> list[RegistryEntry]:
        """Every entry, those registered in code first; an installed entry point wins a name clash."""
        found = {
            name: RegistryEntry(name, reference, "registered in code") for name, (_, reference) in self._code.items()
        }
        for name, ep in self._entry_points().items():
            dist = ep.dist.name if ep.dist is not None else "an installed distribution"
            found[name] = RegistryEntry(name, ep.value, f"entry point of {dist}")
        return sorted(found.values(), key=lambda e: e.name)

    def names(self) -> list[str]:
        return [entry.name for entry in self.entries()]

    def __contains__(self, name: object) -> bool:
        return name in self.names()

    def items(self) -> list[tuple[str, T]]:
        """Every entry, loaded."""
        return [(name, self.get(name)) for name in self.names()]

    def get(self, name: str) -> T:
        with self._lock:
            if name in self._loaded:
                return self._loaded[name]
        points = self._entry_points()
        if name in points:
            target: Any = import_reference(points[name].value, f"{self.kind} {name!r}")
        elif name in self._code:
            raw = self._code[name][0]
            target = import_reference(raw, f"{self.kind} {name!r}") if isinstance(raw, str) else raw
        else:
            known = ", ".join(self.names()) or "none"
            raise RegistryError(f"no {self.kind} named {name!r}; installed: {known}")
        with self._lock:
            self._loaded[name] = target
        return target
