"""A local stand-in for the Anthropic Messages API: scripted replies, recorded requests.

The real `anthropic` SDK is pointed at it with `base_url`; it POSTs to /v1/messages and
gets the next scripted message back (id, type, role, model, content, stop_reason, usage).
A script entry may also be an `HttpError` (a 529, a 400 ... with the API's error body and
headers), or a function of the request body that returns either.
"""

from __future__ import annotations

import itertools
import json
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

Reply = dict[str, Any]


@dataclass
class HttpError:
    """An error answer as the API gives it: status, `{"type": "error", "error": {...}}`, headers."""

    status: int
    error_type: str
    message: str
    headers: dict[str, str] = field(default_factory=dict)

    def body(self) -> dict[str, Any]:
        return {"type": "error", "error": {"type": self.error_type, "message": self.message}}


def overloaded(**headers: str) -> HttpError:
    return HttpError(529, "overloaded_error", "Overloaded", dict(headers))


Answer = Reply | HttpError
Entry = Answer | Callable[[dict[str, Any]], Answer]
_ids = itertools.count(1)


def tool_use(name: str, arguments: dict[str, Any], text: str | None = None) -> list[dict[str, Any]]:
    block = {"type": "tool_use", "id": f"toolu_{next(_ids):04d}", "name": name, "input": arguments}
    return ([{"type": "text", "text": text}] if text else []) + [block]


def message(
    content: list[dict[str, Any]],
    stop_reason: str,
    usage: tuple[int, int] = (100, 20),
    cache: tuple[int, int] | None = None,
) -> Reply:
    """An assistant message; `cache` = (cache_read_input_tokens, cache_creation_input_tokens) when given."""
    tokens: dict[str, int] = {"input_tokens": usage[0], "output_tokens": usage[1]}
    if cache is not None:
        tokens |= {"cache_read_input_tokens": cache[0], "cache_creation_input_tokens": cache[1]}
    return {
        "id": f"msg_{next(_ids):04d}",
        "type": "message",
        "role": "assistant",
        "model": "claude-fake",
        "content": content,
        "stop_reason": stop_reason,
        "stop_sequence": None,
        "usage": tokens,
    }


def calls(*tool_uses: list[dict[str, Any]]) -> Reply:
    """One assistant turn asking for one or more tools."""
    return message([block for blocks in tool_uses for block in blocks], "tool_use")


def done(text: str) -> Reply:
    return message([{"type": "text", "text": text}], "end_turn")


class FakeMessagesAPI:
    def __init__(self, script: list[Entry] | Callable[[int], Answer]) -> None:
        self.script = script
        self.requests: list[dict[str, Any]] = []
        self.base_url = ""

    def next_reply(self) -> Answer:
        index = len(self.requests) - 1
        if callable(self.script):
            return self.script(index)
        entry = self.script[index]
        return entry(self.requests[-1]) if callable(entry) else entry


def _handler(api: FakeMessagesAPI) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (http.server's name)
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if self.path.split("?")[0] != "/v1/messages":
                self.send_error(404)
                return
            api.requests.append(body)
            try:
                answer = api.next_reply()
            except IndexError:
                answer = HttpError(400, "invalid_request_error", "script exhausted")
            if isinstance(answer, HttpError):
                status, payload, headers = answer.status, json.dumps(answer.body()).encode(), answer.headers
            else:
                status, payload, headers = 200, json.dumps(answer).encode(), {}
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("request-id", f"req_{len(api.requests):04d}")
            for name, value in headers.items():
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, *args: Any) -> None:
            pass

    return Handler


@contextmanager
def fake_anthropic(script: list[Entry] | Callable[[int], Answer]) -> Iterator[FakeMessagesAPI]:
    api = FakeMessagesAPI(script)
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(api))
    api.base_url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield api
    finally:
        server.shutdown()
        server.server_close()
