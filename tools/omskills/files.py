"""Small helpers on files that every layer uses."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import stat
import tempfile
import threading
from pathlib import Path
from typing import IO

from omskills.errors import InputError

# (resolved path, size, mtime_ns) -> sha256: a file unchanged since it was last hashed in this
# process is not read again (a long-lived MCP server checks the same GB-sized ONNX files often).
_HASHED: dict[tuple[str, int, int], str] = {}
_HASHED_LOCK = threading.Lock()


def sha256_file(path: Path) -> str:
    """The file's sha256, read in 4 MiB blocks (models reach gigabytes)."""
    digest = hashlib.sha256()
    with Path(path).open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


# The bytes `quick_digest` reads at each end of a file.
QUICK_SPAN = 1 << 20


def quick_digest(path: Path) -> str:
    """A cheap content check: the size and the first and last MiB, hashed (2 MiB read whatever
    the size). Files whose size and mtime were kept through a change (a restored timestamp) are
    still caught where the change touches either end, as a header or a truncation does."""
    digest = hashlib.blake2b(digest_size=16)
    with Path(path).open("rb") as handle:
        size = os.fstat(handle.fileno()).st_size
        digest.update(size.to_bytes(8, "little"))
        digest.update(handle.read(QUICK_SPAN))
        if size > QUICK_SPAN:
            handle.seek(max(QUICK_SPAN, size - QUICK_SPAN))
            digest.update(handle.read(QUICK_SPAN))
    return digest.hexdigest()


def file_state(path: Path) -> tuple[int, int]:
    """(size in bytes, mtime in ns): the fast check that a file is the one hashed before."""
    stat = Path(path).stat()
    return stat.st_size, stat.st_mtime_ns


def sha256_cached(path: Path) -> str:
    """sha256_file, remembered for the file's current size and mtime."""
    size, mtime = file_state(path)
    key = (str(Path(path).resolve()), size, mtime)
    with _HASHED_LOCK:
        known = _HASHED.get(key)
    if known is None:
        known = sha256_file(path)
        with _HASHED_LOCK:
            _HASHED[key] = known
    return known


def _umask() -> int:
    """The process umask, read without changing it (os.umask would race with other threads)."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    return 0o022


def atomic_write_text(path: Path, text: str) -> None:
    """Write `text` to `path` through a temporary file and a rename, so a crash mid-write leaves
    the previous file intact. The file keeps its mode (a new one gets 0666 less the umask, as
    open() would give it; mkstemp's 0600 would hide a shared record from its group)."""
    path = Path(path)
    try:
        mode = path.stat().st_mode & 0o7777
    except FileNotFoundError:
        mode = 0o666 & ~_umask()
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fchmod(handle.fileno(), mode)
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def process_alive(pid: object) -> bool:
    """Whether the process a lock file or a file's name records still runs."""
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def inside_without_links(root: Path, relative: str) -> Path:
    """`root / relative` when `relative` stays inside `root` through no symbolic link, checked
    part by part (a link anywhere on the way, to a file or to a folder, could lead outside);
    ValueError saying why not. The folder `root` itself may be reached through links."""
    parts = Path(relative).parts
    if "\x00" in relative or Path(relative).is_absolute() or ".." in parts or not parts:
        raise ValueError("not a path inside the folder (relative, without '..')")
    path = Path(root)
    for part in parts:
        path = path / part
        if path.is_symlink():
            raise ValueError(f"{path} is a symbolic link: refused, it could lead outside {root}")
    return path


def open_lock_file(path: Path) -> IO[str]:
    """A lock file opened for reading and writing (created if missing), never through a symbolic
    link and only when it is a regular file: a link planted in its place would have a lock write,
    or truncate, the file it points at. The one way omskills opens a lock file."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise InputError(f"{path} is a symbolic link: refused, a lock file is never opened through one") from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise InputError(f"{path} is not a regular file: refused as a lock file")
    return os.fdopen(fd, "r+", encoding="utf-8")


DRIVER_MODULE_PREFIX = "omskills_driver_"


def file_module_name(path: Path) -> str:
    """The module name a Python file loaded by path gets: one per file (its path's hash in it), so
    its classes pickle and repeat imports share the module."""
    return f"{DRIVER_MODULE_PREFIX}{path.stem}_{hashlib.sha256(str(path).encode()).hexdigest()[:8]}"


def portable_class_name(qualified: str) -> str:
    """A class's `module.qualname` with the path hash of a file-loaded module left out: the same
    driver file copied elsewhere (into a bundle) defines the same classes."""
    module, dot, rest = qualified.partition(".")
    if dot and module.startswith(DRIVER_MODULE_PREFIX) and len(module) > 9 and module[-9] == "_":
        return f"{module[:-9]}.{rest}"
    return qualified
