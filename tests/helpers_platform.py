"""Skipping tests that need a device platform, with the platform's own reason."""

from __future__ import annotations

from typing import Optional

import pytest

from radixserve.registry import PluginError, get_registry


def platform_unavailable(name: str) -> Optional[str]:
    """Why the registered platform ``name`` cannot run on this machine (None: it can)."""
    try:
        get_registry().resolve_platform(name)
    except PluginError as exc:
        return str(exc).splitlines()[0]
    return None


def needs_platform(name: str) -> pytest.MarkDecorator:
    """Skips a test where platform ``name`` cannot run, saying why."""
    reason = platform_unavailable(name)
    return pytest.mark.skipif(reason is not None, reason=reason or "")
