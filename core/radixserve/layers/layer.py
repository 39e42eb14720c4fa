"""The base class of radixserve's model building blocks."""

from __future__ import annotations

from typing import Any

from torch import nn


class Layer(nn.Module):
    """An ``nn.Module`` whose call runs ``forward`` directly.

    ``nn.Module.__call__`` checks for forward hooks, pre-hooks and tracing state
    on every call, a microsecond or two each time. A decoder layer makes about
    ten such calls per step, so on the CPU, where every step's host work adds to
    its time, a 24-layer model spent about half a millisecond of each decode step
    there. Radixserve's layers and models take no hooks; everything else about
    them is a plain ``nn.Module`` (parameters, buffers, ``state_dict``).
    """

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)
