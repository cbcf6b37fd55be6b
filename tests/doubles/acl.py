"""TEST DOUBLE for CANN's pyACL (`import acl`): the context calls only, and no NPU.

ACL keeps one current context per thread; `rt.create_context` makes the new one current, and
`rt.get_context` returns `(context, ret)` with ret 0 on success (CANN "Python AscendCL API":
acl.rt.create_context / get_context / set_context). Contexts here are plain integers. The
InferSession double checks against this module that its own context is current when it runs,
as aclruntime's session must (otherwise ACL fails with 107002 / 107003).
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

ACL_SUCCESS = 0
ACL_ERROR_RT_CONTEXT_NULL = 107002

_state = threading.local()
_created: list[int] = []


def _create_context(device_id: int) -> tuple[int, int]:
    _created.append(len(_created) + 1)
    _state.current = _created[-1]
    return _created[-1], ACL_SUCCESS


def _get_context() -> tuple[int | None, int]:
    current = getattr(_state, "current", None)
    return (current, ACL_SUCCESS) if current else (None, ACL_ERROR_RT_CONTEXT_NULL)


def _set_context(context: int) -> int:
    if context not in _created:
        return ACL_ERROR_RT_CONTEXT_NULL
    _state.current = context
    return ACL_SUCCESS


rt = SimpleNamespace(create_context=_create_context, get_context=_get_context, set_context=_set_context)


def get_soc_name() -> str:
    return "InferSession double, no NPU"


def reset() -> None:
    """Forget every context (between tests)."""
    _created.clear()
    _state.current = None
