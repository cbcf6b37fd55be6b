"""A local stand-in for the Anthropic Messages API: scripted replies, recorded requests.

The real `anthropic` SDK is pointed at it with `base_url`; it POSTs to /v1/messages and
gets the next scripted message back (id, type, role, model, content, stop_reason, usage).
"""

from __future__ import annotations

import itertools
import json
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

Reply = dict[str, Any]
_ids = itertools.count(1)


def tool_use(name: str, arguments: dict[str, Any], text: str | None = None) -> list[dict[str, Any]]:
    block = {"type": "tool_use", "id": f"toolu_{next(_ids):04d}", "name": name, "input": arguments}
    return ([{"type": "text", "text": text}] if text else []) + [block]


def message(content: list[dict[str, Any]], stop_reason: str, usage: tuple[int, int] = (100, 20)) -> Reply:
    return {
        "id": f"msg_{next(_ids):04d}",
        "type": "message",
        "role": "assistant",
        "model": "claude-fake",
        "content": content,
        "stop_reason": stop_reason,
        "stop_sequence": None,
        "usage": {"input_tokens": usage[0], "output_tokens": usage[1]},
    }


def calls(*tool_uses: list[dict[str, Any]]) -> Reply:
    """One assistant turn asking for one or more tools."""
    return message([block for blocks in tool_uses for block in blocks], "tool_use")


def done(text: str) -> Reply:
    return message([{"type": "text", "text": text}], "end_turn")


class FakeMessagesAPI:
    def __init__(self, script: list[Reply] | Callable[[int], Reply]) -> None:
        self.script = script
        self.requests: list[dict[str, Any]] = []
        self.base_url = ""

    def next_reply(self) -> Reply:
        index = len(self.requests) - 1
        if callable(self.script):
            return self.script(index)
        return self.script[index]


def _handler(api: FakeMessagesAPI) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (http.server's name)
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if self.path.split("?")[0] != "/v1/messages":
                self.send_error(404)
                return
            api.requests.append(body)
            try:
                payload = json.dumps(api.next_reply()).encode()
                status = 200
            except IndexError:
                payload = json.dumps({"type": "error", "error": {"type": "invalid_request_error", "message": "script exhausted"}}).encode()
                status = 400
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, *args: Any) -> None:
            pass

    return Handler


@contextmanager
def fake_anthropic(script: list[Reply] | Callable[[int], Reply]) -> Iterator[FakeMessagesAPI]:
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
