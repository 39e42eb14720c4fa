"""The mooncake KV-transfer backend (plugins/mooncake) where it can run: its tests skip
with the reason it cannot (the plugin not installed, Mooncake's library not loading)."""

from __future__ import annotations

import pytest


def mooncake_problem() -> str | None:
    """Why the mooncake backend cannot run here (None when it can)."""
    try:
        from radixserve_mooncake.transfer import load_problem
    except ImportError:
        return "radixserve-plugin-mooncake is not installed (pip install -e 'plugins/mooncake[cpu]')"
    return load_problem()


MOONCAKE = pytest.mark.skipif(mooncake_problem() is not None, reason=str(mooncake_problem()))
