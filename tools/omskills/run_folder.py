"""The run folder as a value: the one owner of the paths a task record stores.

A record stores every path relative to the folder it sits in (`records.names.RunPath`), so a run
folder can move; the engine's functions return the absolute paths they wrote. `RunFolder` turns
one into the other: `stored` is the path a record may hold (relative, `/`-separated; a path
outside the folder is an error), `stored_if_inside` the same for values that may also lie outside
(an OM written elsewhere stays as it is), `command` and `text` make the folder's absolute paths
inside a command line or a message relative, and `file` finds a stored path again: inside the
folder through no symbolic link, and a regular file or folder (never a FIFO or a device).
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from omskills.files import inside_without_links


@dataclass(frozen=True)
class RunFolder:
    root: Path

    @classmethod
    def of_record(cls, task_path: str | Path) -> RunFolder:
        """The folder a task record sits in."""
        return cls(Path(task_path).resolve().parent)

    def stored(self, path: str | Path) -> str:
        """`path` as the record stores it; ValueError when it lies outside the folder."""
        relative = self._relative(Path(path))
        if relative is None:
            raise ValueError(f"{path} is outside the run folder {self.root}")
        return relative

    def stored_if_inside(self, value: str | None) -> str | None:
        """A path inside the folder as the record stores it; a relative one, or one outside, as it is."""
        if not value or not Path(value).is_absolute():
            return value
        relative = self._relative(Path(value))
        return value if relative is None else relative

    def command(self, args: Sequence[str]) -> list[str]:
        """Command-line arguments with the folder's absolute paths made relative to it
        (`--model=/runs/x/onnx/a.onnx` -> `--model=onnx/a.onnx`): the command runs from the folder."""
        prefix = str(self.root.resolve()) + "/"
        return [arg.replace(prefix, "") for arg in args]

    def text(self, text: str) -> str:
        """The text with the folder's absolute paths made relative to it: reasons and notes may name
        files by their absolute path, and a record or document is read from the folder."""
        root = r"(?<![\w./-])" + re.escape(str(self.root.resolve()))
        return re.sub(root + r"(?![\w.-])", ".", re.sub(root + "/", "", text))

    def file(self, stored: str) -> Path:
        """A stored path as a path to open: inside the folder through no symbolic link, and not a
        FIFO, socket or device (opening one could block or never end). ValueError saying why."""
        path = inside_without_links(self.root, stored)
        try:
            mode = path.stat().st_mode
        except OSError:
            return path  # missing: the reader says so
        if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
            raise ValueError(f"{path} is not a regular file or folder: refused")
        return path

    def _relative(self, path: Path) -> str | None:
        """Compared as given first, so a sub-folder that is a symlink to another disk still belongs
        to the run; then with symlinks resolved on both sides."""
        for inside, root in ((path.absolute(), self.root.absolute()), (path.resolve(), self.root.resolve())):
            relative = os.path.relpath(inside, root)
            if relative != ".." and not relative.startswith("../"):
                return Path(relative).as_posix()
        return None
