"""Tool results too long for one message: an outline the model can read, and pages of the rest.

A result longer than the limit is never cut in the middle: a JSON result reaches the model as
a valid-JSON outline (top-level keys, list lengths, the first items, the start of long
strings) with a note naming the local tool `read_tool_result`, which reads any part of the
stored full result, addressed by a JSON Pointer (RFC 6901, e.g. `/entries/12`), in pages
that are themselves valid JSON. A text result reaches the model as its first page and a note.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel

PAGER_TOOL = "read_tool_result"

# Outline shapes tried from the richest to the barest until one fits: how deep it goes,
# how many first items of a list it shows, how many characters of a long string.
_OUTLINE_LEVELS = ((4, 10, 300), (4, 5, 300), (4, 3, 300), (3, 2, 160), (2, 1, 80), (1, 1, 40), (1, 0, 40), (0, 0, 0))
# Room the page wrapper (path, offsets, note) needs beside the items.
_WRAPPER_ROOM = 600


def pager_tool_definition() -> dict[str, Any]:
    return {
        "name": PAGER_TOOL,
        "description": (
            "Read a part of an earlier tool result that was too long to send whole (its outline said so). "
            '`path` is a JSON Pointer into the result ("" for the whole, "/entries" for a key, "/entries/12" for '
            "an item); a long list, object or string comes back a page at a time: pass the page's `next_offset` as "
            "`offset` for the next one. Every page is valid JSON."
        ),
        "input_schema": {
            "type": "object",
            "properties": {
                "call_id": {"type": "string", "description": "the tool_use id of the call whose result to read"},
                "path": {
                    "type": "string",
                    "description": "JSON Pointer into the result, e.g. /entries/3 (default: the whole result)",
                },
                "offset": {
                    "type": "integer",
                    "minimum": 0,
                    "description": "first item (list), key (object) or character (text) of the page",
                },
            },
            "required": ["call_id"],
        },
    }


class PagedAnswer(BaseModel):
    text: str
    is_error: bool


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def outline(value: Any, depth: int, items: int, chars: int) -> Any:
    """A smaller stand-in for `value`, valid JSON: long lists and strings shown by their start."""
    if isinstance(value, str):
        return value if len(value) <= max(chars, 40) else {"string_length": len(value), "start": value[:chars]}
    if isinstance(value, list):
        if depth <= 0:
            return {"list_length": len(value)}
        if len(value) <= items:
            return [outline(v, depth - 1, items, chars) for v in value]
        return {"list_length": len(value), "first_items": [outline(v, depth - 1, items, chars) for v in value[:items]]}
    if isinstance(value, dict):
        if depth <= 0:
            return {"object_keys": list(value)[:20], "keys_total": len(value)}
        return {k: outline(v, depth - 1, items, chars) for k, v in value.items()}
    return value


def fitting_outline(value: Any, budget: int) -> Any | None:
    """The richest outline of `value` whose JSON is at most `budget` characters, or None."""
    for depth, items, chars in _OUTLINE_LEVELS:
        shown = outline(value, depth, items, chars)
        if len(_dumps(shown)) <= budget:
            return shown
    return None


def _suggested_path(value: Any) -> str:
    """A path worth reading first: the longest list at the top or one level down."""
    if not isinstance(value, dict):
        return ""
    candidates: list[tuple[int, str]] = []
    for key, child in value.items():
        here = "/" + _escape(key)
        if isinstance(child, list):
            candidates.append((len(child), here))
        elif isinstance(child, dict):
            candidates += [(len(v), f"{here}/{_escape(k)}") for k, v in child.items() if isinstance(v, list)]
    return max(candidates)[1] if candidates else ""


def _escape(key: str) -> str:
    return str(key).replace("~", "~0").replace("/", "~1")


def resolve_pointer(document: Any, pointer: str) -> Any:
    """The value at a JSON Pointer; KeyError naming the step that does not exist.

    Written out rather than taken from a package: RFC 6901 lookup is a few lines, and the
    error has to tell the model what is there instead.
    """
    if pointer in ("", "/"):
        return document
    if not pointer.startswith("/"):
        pointer = "/" + pointer
    value, walked = document, ""
    for raw in pointer[1:].split("/"):
        step = raw.replace("~1", "/").replace("~0", "~")
        if isinstance(value, dict) and step in value:
            value = value[step]
        elif isinstance(value, list) and step.isdigit() and int(step) < len(value):
            value = value[int(step)]
        else:
            have = (
                f"keys: {', '.join(list(value)[:30])}"
                if isinstance(value, dict)
                else f"a list of {len(value)} items (0..{len(value) - 1})"
                if isinstance(value, list)
                else f"a {type(value).__name__}, not a container"
            )
            raise KeyError(f"path {pointer!r}: {walked or '(the result)'} has no {step!r}; it has {have}")
        walked += "/" + raw
    return value


class ResultPager:
    """The full tool results of one conversation, and what of them fits in one message."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.results: dict[str, str] = {}

    def fit(self, call_id: str, text: str) -> str:
        """`text` if it fits, else an outline or first page that does; the whole is kept for paging."""
        self.results[call_id] = text
        if len(text) <= self.limit:
            return text
        try:
            document = json.loads(text)
        except ValueError:
            return self._first_text_page(call_id, text)
        return self._json_outline(call_id, text, document)

    def _json_outline(self, call_id: str, text: str, document: Any) -> str:
        start = _suggested_path(document)
        note = {
            "call_id": call_id,
            "chars": len(text),
            "limit": self.limit,
            "how_to_read": (
                f"This result has {len(text):,} characters, more than the {self.limit:,} sent at once, "
                "so this is its outline: a long list is shown as {list_length, first_items}, "
                "a long string as {string_length, start}, a deep object as {object_keys, keys_total}. "
                f"Read any part whole with {PAGER_TOOL}(call_id={call_id!r}, path=<JSON Pointer>, "
                f"offset=<from the previous page's next_offset>), e.g. path={start!r}."
            ),
        }
        budget = self.limit - len(_dumps({"result_too_long": note, "outline": None}))
        shown = fitting_outline(document, budget)
        if shown is None:  # only a very small limit gets here: keys or length alone
            shown = outline(document, 0, 0, 0)
        return _dumps({"result_too_long": note, "outline": shown})

    def _first_text_page(self, call_id: str, text: str) -> str:
        room = self.limit - 200
        cut = text.rfind("\n", room // 2, room)
        end = cut + 1 if cut > 0 else room
        return (
            text[:end] + f"\n[omskills: {end:,} of {len(text):,} characters shown; read on with "
            f"{PAGER_TOOL}(call_id={call_id!r}, offset={end})]"
        )

    # ---- the paging tool

    def read(self, arguments: dict[str, Any]) -> PagedAnswer:
        call_id = str(arguments.get("call_id", ""))
        path = str(arguments.get("path") or "")
        offset = arguments.get("offset") or 0
        if call_id not in self.results:
            known = ", ".join(list(self.results)[-10:]) or "none yet"
            return PagedAnswer(text=f"no stored result for call_id {call_id!r}; known (latest): {known}", is_error=True)
        if not isinstance(offset, int) or offset < 0:
            return PagedAnswer(text=f"offset must be a whole number >= 0, got {offset!r}", is_error=True)
        text = self.results[call_id]
        try:
            document = json.loads(text)
        except ValueError:
            if path:
                return PagedAnswer(
                    text=f"the result of {call_id} is text, not JSON: read it with offset only", is_error=True
                )
            document = text
        try:
            value = resolve_pointer(document, path)
        except KeyError as err:
            return PagedAnswer(text=str(err.args[0]), is_error=True)
        return PagedAnswer(text=_dumps(self._page(call_id, path, value, offset)), is_error=False)

    def _page(self, call_id: str, path: str, value: Any, offset: int) -> dict[str, Any]:
        head: dict[str, Any] = {"call_id": call_id, "path": path}
        room = self.limit - _WRAPPER_ROOM
        if offset == 0 and len(_dumps(value)) <= room:
            return head | {"value": value}
        if isinstance(value, str):
            end = min(len(value), offset + room)
            while end > offset + 1 and len(_dumps(value[offset:end])) > room:  # JSON escapes lengthen some characters
                end = offset + (end - offset) // 2
            return head | {
                "string_length": len(value),
                "offset": offset,
                "text": value[offset:end],
                "next_offset": end if end < len(value) else None,
            }
        if isinstance(value, list):
            shown, next_offset = _fill(list(enumerate(value)), offset, room, path)
            return head | {
                "list_length": len(value),
                "offset": offset,
                "items": [v for _, v in shown],
                "next_offset": next_offset,
            }
        if isinstance(value, dict):
            shown, next_offset = _fill(list(value.items()), offset, room, path)
            return head | {
                "keys_total": len(value),
                "offset": offset,
                "entries": dict(shown),
                "next_offset": next_offset,
            }
        return head | {"value": value}


def _fill(pairs: list[tuple[Any, Any]], offset: int, room: int, path: str) -> tuple[list[tuple[Any, Any]], int | None]:
    """Whole items from `offset` while they fit in `room`; one too big becomes its outline."""
    shown: list[tuple[Any, Any]] = []
    used = 0
    for index in range(offset, len(pairs)):
        key, item = pairs[index]
        size = len(_dumps(item)) + len(_dumps(key)) + 4
        if size > room - used:
            if shown and size <= room:
                return shown, index  # whole on the next page
            stand_in = fitting_outline(item, min(room - used, room // 4) - 200)
            item = {"item_too_long": {"chars": size, "read_path": f"{path}/{_escape(str(key))}"}, "outline": stand_in}
            size = len(_dumps(item)) + len(_dumps(key)) + 4
            if shown and size > room - used:
                return shown, index
        shown.append((key, item))
        used += size
    return shown, None
