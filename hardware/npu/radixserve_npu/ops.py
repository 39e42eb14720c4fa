"""The one place the plugin reaches torch_npu's operators.

torch_npu is imported on first use, never when the plugin is imported or asked
``unsupported_reasons``, so that ``radixserve plugins`` works on any machine.
Tests replace :func:`load_torch_npu` with a stand-in that emulates the
documented operators in torch.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from types import ModuleType
from typing import Any


def load_torch_npu() -> ModuleType:
    """``import torch_npu`` (which also registers the ``npu`` device and ``torch.npu``)."""
    return importlib.import_module("torch_npu")


def op(name: str) -> Callable[..., Any]:
    """``torch_npu.<name>``; a missing operator is an error naming the torch_npu build."""
    found = find_op(name)
    if found is None:
        module = load_torch_npu()
        raise RuntimeError(
            f"torch_npu {getattr(module, '__version__', '?')} has no operator {name!r}; "
            "install a torch_npu matching your CANN toolkit that provides it"
        )
    return found


def find_op(name: str) -> Callable[..., Any] | None:
    """``torch_npu.<name>``, or None when this torch_npu build does not have it."""
    return getattr(load_torch_npu(), name, None)
