"""The bulky parts of a task record, kept in side files beside it.

A person opens `task.yaml` for decisions, verdicts and figures; the per-node, per-sample and
per-site tables behind them (an operator precheck's rows, a profile's nodes, a verification's
per-step figures) would bury those under thousands of lines. A field that holds such a table is
declared `Annotated[list[...], DETAIL]` (a mapping, a model or a long text may be one too); when its
value takes more than a line, a save writes it as JSON to `<record stem>-details/<where it
sits>.<hash>.json`, `<hash>` the first 16 hex digits of the text's sha256, and the record keeps a
reference to that file with its length (items, or characters of a text), one line. Files are named
by their content, so the record a crash or a concurrent reader still holds names files that are
still there: a save writes the new files, then the record, and only then removes the files no
reference names. A load puts the values back
before the record is validated, so every reader sees one record; a detail file that is missing, or
whose bytes do not have the hash its name says, is an error naming the file and the field (a reader
racing a writer reads again).

Which fields are details is declared on the field, by its type: the walk below follows the
record's models, so a new bulky field is a new annotation, not an edit here.
"""

from __future__ import annotations

import hashlib
import json
import re
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any, Union, get_args, get_origin

from omskills.errors import TaskRecordError
from omskills.files import atomic_write_text
from omskills.run_folder import RunFolder
from pydantic import BaseModel
from pydantic.fields import FieldInfo


class _DetailMarker:
    def __repr__(self) -> str:
        return "DETAIL"


# `Annotated[list[Row], DETAIL]`: a table kept in a side file when it is big.
DETAIL = _DetailMarker()

# A value whose JSON is at most this long stays in the record, where it takes one line: a side
# file for what one line says would make the record harder to read, not easier.
INLINE_MAX_CHARS = 100
# A detail file bigger than this is not read (a record's tables reach a few MB at full scale).
MAX_DETAIL_BYTES = 512 * 1024 * 1024
_REF_KEYS = {"detail", "items"}
HASH_DIGITS = 16  # of the sha256 a detail file's name carries: enough to tell any edit
_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]|^\.+")


def details_folder(record_path: Path) -> str:
    """The folder of a record's detail files, relative to the record's folder."""
    return f"{record_path.stem}-details"


def is_reference(value: object) -> bool:
    return isinstance(value, dict) and set(value) == _REF_KEYS


def split_details(
    model: type[BaseModel], data: dict, folder: str | None, untouched: tuple[str, ...] = ()
) -> dict[str, str]:
    """Replace each detail value of `data` (a dump of `model`) that takes more than a line by a
    reference to its side file, and leave out the fields that hold their null or empty default
    (they say nothing but take a line each); returns the files to write, relative path -> JSON
    text. Top-level keys in `untouched` (the sections a user writes) stay as they are; with no
    `folder`, every detail stays inline."""
    files: dict[str, str] = {}

    def keep_aside(where: tuple[str, ...], value: Any) -> Any:
        if folder is None or not isinstance(value, (list, dict, str)) or is_reference(value):
            return value
        if len(json.dumps(value, ensure_ascii=False)) <= INLINE_MAX_CHARS:
            return value
        text = json.dumps(value, indent=1, ensure_ascii=False)
        digest = _sha256(text)
        relative = f"{folder}/{_file_name(where, digest)}"
        files[relative] = text
        return {"detail": relative, "items": len(value)}

    _walk(model, data, (), keep_aside, trim_nones=True, skip=untouched)
    return files


def join_details(model: type[BaseModel], data: dict, root: Path, record_path: Path) -> None:
    """Put each referenced detail of `data` back in place, read from its file under `root`;
    TaskRecordError (naming the field and the file) when one is missing or changed."""

    folder = details_folder(record_path)

    def read_back(where: tuple[str, ...], value: Any) -> Any:
        if not is_reference(value):
            return value
        field = ".".join(where)
        try:
            if Path(str(value["detail"])).parent != Path(folder):
                raise ValueError(f"not a file of {folder}/")
            path = RunFolder(root).file(str(value["detail"]))
            if path.stat().st_size > MAX_DETAIL_BYTES:
                raise ValueError(f"bigger than {MAX_DETAIL_BYTES} bytes")
            text = path.read_text(encoding="utf-8")
        except (OSError, ValueError, TypeError, UnicodeDecodeError) as err:
            raise DetailMissing(
                f"task record {record_path}: {field}: its detail file {value['detail']}: {err}"
            ) from None
        if _digest_in_name(str(value["detail"])) != _sha256(text)[:HASH_DIGITS]:
            raise DetailMissing(
                f"task record {record_path}: {field}: its detail file {value['detail']} changed since it was "
                "written (its sha256 is not the one its name says): restore it, or delete the step's results "
                "to run it again"
            )
        return json.loads(text)

    _walk(model, data, (), read_back)


class DetailMissing(TaskRecordError):
    """A detail file the record names is missing or changed (a writer may be replacing it)."""


def write_details(root: Path, files: dict[str, str]) -> None:
    """Write the detail files not yet on disk (under the record's lock, before the record that
    names them). A file of that name holds that content: it is named by its hash."""
    run = RunFolder(root)
    for relative, text in files.items():
        path = run.file(relative)
        if not path.is_file():
            path.parent.mkdir(exist_ok=True)
            atomic_write_text(path, text)


def remove_unnamed(root: Path, folder: str, files: dict[str, str]) -> None:
    """Remove the detail files of `folder` that the record just written no longer names."""
    path = RunFolder(root).file(folder)
    if not path.is_dir():
        return
    named = {Path(relative).name for relative in files}
    for old in path.glob("*.json"):
        if old.name not in named and old.is_file() and not old.is_symlink():
            old.unlink(missing_ok=True)


def _is_empty_default(field: FieldInfo, value: Any) -> bool:
    if value is None:
        return field.default is None
    if value == [] or value == {}:
        return field.default_factory in (list, dict) or field.default == value
    return False


def _digest_in_name(relative: str) -> str:
    """The hash a detail file's name carries (`<where>.<hash>.json`)."""
    return Path(relative).name.removesuffix(".json").rpartition(".")[2]


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _file_name(where: tuple[str, ...], digest: str) -> str:
    """`toolchain.vision_backbone.precheck.rows.<hash>.json`: the field's path, with what is no
    plain name in a key (keys come from records users edit) made `_`, and cut short. Two fields
    whose names come out the same share a file only when their content is the same."""
    name = ".".join(_UNSAFE.sub("_", part.replace(":", ".")) for part in where)[:150]
    return f"{name}.{digest[:HASH_DIGITS]}.json"


Visit = Callable[[tuple[str, ...], Any], Any]


def _walk(
    annotation: Any,
    value: Any,
    where: tuple[str, ...],
    visit: Visit,
    trim_nones: bool = False,
    skip: tuple[str, ...] = (),
) -> Any:
    """`value` (data of type `annotation`) with `visit` applied to every detail field inside it
    (and, `trim_nones`, without the fields that hold their null or empty default); the fields of
    the outermost model named in `skip` are left as they are. Data that does not have the type's
    shape is left to validation, which says what is wrong."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        if isinstance(value, dict):
            for name, field in annotation.model_fields.items():
                key = field.alias or name
                if key not in value or key in skip:
                    continue
                inner = where + (key,)
                if trim_nones and _is_empty_default(field, value[key]):
                    del value[key]
                else:
                    if DETAIL in field.metadata:
                        value[key] = visit(inner, value[key])
                    # What a detail holds may hold details itself (a record written before the outer
                    # field was one holds references inside it): walked after it is read back.
                    value[key] = _walk(field.annotation, value[key], inner, visit, trim_nones)
        return value
    origin, args = get_origin(annotation), get_args(annotation)
    if origin in (Union, types.UnionType):
        models = [arm for arm in args if arm is not type(None)]
        return _walk(models[0], value, where, visit, trim_nones) if len(models) == 1 else value
    if origin is dict and isinstance(value, dict):
        for key in list(value):
            value[key] = _walk(args[1], value[key], where + (str(key),), visit, trim_nones)
    elif origin is list and isinstance(value, list):
        for i, item in enumerate(value):
            value[i] = _walk(args[0], item, where + (str(i),), visit, trim_nones)
    return value
