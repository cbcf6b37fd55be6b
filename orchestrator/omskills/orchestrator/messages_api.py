"""One Messages API call as the agent loop makes it: prompt-cache breakpoints, our retry policy.

The SDK's own retries are off (`max_retries=0`): its default two retries span about 1.3 s,
far shorter than an overload lasts, and they are silent. Here 408, 429, 5xx (529 included) and connection
errors are retried with exponential backoff and jitter, honouring the server's
`retry-after`, for a bounded total time; each retry is announced in one line with the wait it
then takes, and the waits add up to that total. Any other error (a 400, 401, 404 ...) is an
`ApiFailure` at once: the loop stops and says why.
"""

from __future__ import annotations

import email.utils
import time
from collections.abc import Awaitable, Callable
from typing import Any

import anthropic
from anthropic import AsyncAnthropic
from pydantic import BaseModel, Field
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception, wait_exponential_jitter

EPHEMERAL = {"type": "ephemeral"}
# The API takes at most four cache breakpoints: system, tools, and the last two user messages.
_MESSAGE_BREAKPOINTS = 2


class RetryPolicy(BaseModel):
    """How long to keep asking an overloaded or unreachable API."""

    # Total time spent retrying one request before giving up.
    total_seconds: float = Field(600.0, ge=0)
    # The first wait; each retry doubles it (plus up to as much again of jitter), up to max_wait.
    first_wait: float = Field(2.0, ge=0)
    max_wait: float = Field(60.0, ge=0)


class ApiFailure(Exception):
    """The request failed for good: `stop` names it for the loop (api_error_400, api_connection_error)."""

    def __init__(self, stop: str, message: str) -> None:
        super().__init__(message)
        self.stop = stop
        self.message = message


class RetryNotice(BaseModel):
    attempt: int
    status: str  # "529 overloaded_error", "connection error"
    detail: str
    wait: float
    # True when the wait is the server's retry-after rather than our backoff.
    server_asked: bool
    # True when the wait was cut to the retry time left: this retry is the last.
    last: bool = False

    def line(self, policy: RetryPolicy) -> str:
        why = " (retry-after)" if self.server_asked else ""
        last = ", the last" if self.last else ""
        return (
            f"Anthropic API {self.status}: {self.detail} — retry {self.attempt} in {self.wait:.1f}s{why}{last}; "
            f"giving up after {policy.total_seconds:.0f}s"
        )


Notify = Callable[[RetryNotice], None]
# The retry loop's clock and sleep: time.monotonic and the event loop's sleep, a fake pair in tests.
Clock = Callable[[], float]
Sleep = Callable[[float], Awaitable[None]]


def is_transient(err: BaseException) -> bool:
    if isinstance(err, anthropic.APIConnectionError):
        return True
    return isinstance(err, anthropic.APIStatusError) and (err.status_code in (408, 429) or err.status_code >= 500)


def server_retry_after(err: BaseException) -> float | None:
    """Seconds the server asked us to wait (`retry-after-ms`, `retry-after` seconds or date), if it did."""
    if not isinstance(err, anthropic.APIStatusError):
        return None
    headers = err.response.headers
    try:
        if (ms := headers.get("retry-after-ms")) is not None:
            return max(0.0, float(ms) / 1000)
        if (value := headers.get("retry-after")) is not None:
            try:
                return max(0.0, float(value))
            except ValueError:
                when = email.utils.parsedate_to_datetime(value)
                return max(0.0, when.timestamp() - time.time())
    except (TypeError, ValueError):
        return None
    return None


def _describe(err: BaseException) -> tuple[str, str]:
    if isinstance(err, anthropic.APIStatusError):
        kind = f"{err.status_code} {err.type}" if err.type else str(err.status_code)
        return kind, err.api_message or str(err)
    return "connection error", str(err) or type(err).__name__


def failure_of(err: BaseException, model: str, retried_for: float, refused_wait: float | None = None) -> ApiFailure:
    after = f" (after retrying for {retried_for:.0f}s)" if retried_for >= 1 else ""
    if refused_wait is not None:
        after += f" (the server asked to wait {refused_wait:.0f}s more, past the retry time)"
    if isinstance(err, anthropic.APIStatusError):
        kind, detail = _describe(err)
        return ApiFailure(
            f"api_error_{err.status_code}", f"Anthropic API error {kind} for model {model!r}{after}: {detail}"
        )
    return ApiFailure(
        "api_connection_error",
        f"cannot reach the Anthropic API{after} ({err}); check ANTHROPIC_BASE_URL and the network",
    )


class _Schedule:
    """When to retry and when to give up, on one clock started at the first attempt.

    Each wait is the backoff (or the server's retry-after when longer) cut to the retry time
    left, so the waits announced are the waits taken and they add up to the policy's total: the
    last retry is made when the total is spent. (Stopping as soon as the next full wait would
    cross the total gave up one backoff early: at 33 s of an announced 45 s.)
    """

    def __init__(self, policy: RetryPolicy, clock: Clock) -> None:
        self.clock = clock
        self.started = clock()
        self.deadline = self.started + policy.total_seconds
        self.exponential = wait_exponential_jitter(
            multiplier=policy.first_wait, max=policy.max_wait, jitter=policy.first_wait
        )
        self.last = False  # the latest wait was cut to the time left
        self.refused_wait: float | None = None  # a retry-after longer than the time left

    def left(self) -> float:
        return max(0.0, self.deadline - self.clock())

    def spent(self) -> float:
        return self.clock() - self.started

    def wait(self, state: RetryCallState) -> float:
        wanted = self.exponential(state)
        asked = _asked(state)
        if asked is not None:
            wanted = max(wanted, asked)
        left = self.left()
        self.last = wanted >= left
        return min(wanted, left)

    def stop(self, state: RetryCallState) -> bool:
        """Out of time, or the server asks for longer than is left (retrying sooner would ignore it)."""
        asked, left = _asked(state), self.left()
        if asked is not None and asked > left > 0:
            self.refused_wait = asked
        return left <= 0 or self.refused_wait is not None


def _asked(state: RetryCallState) -> float | None:
    return server_retry_after(state.outcome.exception()) if state.outcome else None


def cached_request(system: str, tools: list[dict[str, Any]], messages: list[dict[str, Any]]) -> dict[str, Any]:
    """The request's system, tools and messages with ephemeral cache breakpoints.

    The system prompt and the tool list are the same every turn; the breakpoint on the
    latest user message caches the conversation so far for the next turn, and the one on
    the user message before it reads what the previous turn cached. The stored messages
    are not changed: the marks would pile up past the API's four.
    """
    marked_tools = [*tools[:-1], {**tools[-1], "cache_control": EPHEMERAL}] if tools else []
    marked = list(messages)
    user_turns = [i for i, m in enumerate(messages) if m["role"] == "user"][-_MESSAGE_BREAKPOINTS:]
    for index in user_turns:
        content = marked[index]["content"]
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else list(content)
        if not blocks:
            continue
        blocks[-1] = {**blocks[-1], "cache_control": EPHEMERAL}
        marked[index] = {**marked[index], "content": blocks}
    return {
        "system": [{"type": "text", "text": system, "cache_control": EPHEMERAL}],
        "tools": marked_tools,
        "messages": marked,
    }


async def create_message(
    llm: AsyncAnthropic,
    policy: RetryPolicy,
    notify: Notify,
    request: dict[str, Any],
    *,
    clock: Clock = time.monotonic,
    sleep: Sleep | None = None,
) -> anthropic.types.Message:
    """`llm.messages.create(**request)` under the retry policy; ApiFailure when it fails for good."""
    schedule = _Schedule(policy, clock)

    def announce(state: RetryCallState) -> None:
        err = state.outcome.exception() if state.outcome else None
        if err is None:
            return
        status, detail = _describe(err)
        asked = server_retry_after(err)
        wait = state.upcoming_sleep
        notify(
            RetryNotice(
                attempt=state.attempt_number,
                status=status,
                detail=detail,
                wait=wait,
                server_asked=asked is not None and wait <= asked,
                last=schedule.last,
            )
        )

    retrying = AsyncRetrying(
        retry=retry_if_exception(is_transient),
        wait=schedule.wait,
        stop=schedule.stop,
        before_sleep=announce,
        reraise=True,
        **({"sleep": sleep} if sleep is not None else {}),
    )
    try:
        async for attempt in retrying:
            with attempt:
                response = await llm.messages.create(**request)
        return response
    except (anthropic.APIStatusError, anthropic.APIConnectionError) as err:
        raise failure_of(err, str(request.get("model")), schedule.spent(), schedule.refused_wait) from None
