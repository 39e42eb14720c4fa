"""What every selectable backend class has in common."""

from __future__ import annotations

from typing import ClassVar

from radixserve.kernels.query import KernelQuery


class Backend:
    """A candidate for selection.

    ``name`` is what ``--<kind>-backend NAME`` refers to; ``priority`` breaks
    ties for ``auto`` (highest first; auto times the candidates that remain,
    see radixserve/backend_timing.py); ``unsupported_reasons`` must be cheap and
    side-effect free (no device runtime import); ``build`` does the one-time
    work (compiling kernels) that may fail.
    """

    name: ClassVar[str]
    priority: ClassVar[int] = 0

    @classmethod
    def unsupported_reasons(cls, query: KernelQuery) -> list[str]:
        return []

    @classmethod
    def build(cls) -> None:
        """Compile or load what the backend's kernels need, once per process; raise
        if that fails. The server calls it before it says it is listening, and
        selection again before it constructs the backend: ``auto`` passes over a
        backend whose build failed (saying why), a forced one fails with it."""
