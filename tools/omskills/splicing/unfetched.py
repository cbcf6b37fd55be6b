"""A graph output left on the device, standing where the host expects a tensor.

The study marks an output `unread` when the host read the graph's other outputs after every call
and never that one (an LSTM's cell state and per-step outputs, where the caller keeps only the
last hidden state). The splice then asks its runner for the other outputs only, and puts an
`Unfetched` tensor in the unread one's place. It answers what needs no values (shape, dtype,
device: `contracts.reads.METADATA`) from what the runtime reported. The first torch function
that reads its values copies the output back (that call's own values, which the runtime held),
says so once in the log and counts the copy (`on_read`), and from then on it is that tensor:
a read the study did not see costs a late copy, never a wrong value.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.utils._pytree as pt
from omskills.contracts.reads import reads_values


class Unfetched(torch.Tensor):
    """A tensor whose values are still on the device: copied back at the first read of them."""

    _copy_back: Callable[[], np.ndarray] | None
    _on_read: Callable[[torch.Tensor], None]
    _value: torch.Tensor | None

    @staticmethod
    def __new__(
        cls,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device,
        copy_back: Callable[[], np.ndarray],
        on_read: Callable[[torch.Tensor], None],
    ) -> Unfetched:
        made = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=device)
        made._copy_back, made._on_read, made._value = copy_back, on_read, None
        return made

    @property
    def fetched(self) -> bool:
        return self._value is not None

    def value(self) -> torch.Tensor:
        """The output itself, copied back on the first call (the runtime's hold on it let go)."""
        if self._value is None:
            copy_back, self._copy_back = self._copy_back, None
            array = np.require(copy_back(), requirements="C")  # type: ignore[misc]
            with torch._C.DisableTorchFunctionSubclass():
                self._value = torch.from_numpy(array).to(device=self.device, dtype=self.dtype)
            self._on_read(self._value)
        return self._value

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if not reads_values(func):
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        args, kwargs = pt.tree_map(_value_of, (args, kwargs))
        return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        # What reaches the dispatcher without a torch function (C++ callers) reads the values too.
        args, kwargs = pt.tree_map(_value_of, (args, kwargs or {}))
        return func(*args, **kwargs)


def _value_of(item: Any) -> Any:
    return item.value() if isinstance(item, Unfetched) else item
