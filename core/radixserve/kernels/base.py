"""What every selectable backend class has in common."""

from __future__ import annotations

from typing import ClassVar

from radixserve.kernels.query import KernelQuery


class Backend:
    """A candidate for selection.

    ``name`` is what ``--<kind>-backend NAME`` refers to; ``priority`` orders
    candidates for ``auto`` (highest first); ``unsupported_reasons`` must be
    cheap and side-effect free (no device runtime import).
    """

    name: ClassVar[str]
    priority: ClassVar[int] = 0

    @classmethod
    def unsupported_reasons(cls, query: KernelQuery) -> list[str]:
        return []
