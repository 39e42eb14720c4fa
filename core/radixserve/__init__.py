"""radixserve: a fast LLM inference server with a hardware-agnostic core."""

from __future__ import annotations

from typing import TYPE_CHECKING

from radixserve.version import __version__

if TYPE_CHECKING:
    from radixserve.config import ServerArgs
    from radixserve.engine import Engine


def __getattr__(name: str) -> type[Engine] | type[ServerArgs]:
    # Lazy, so `import radixserve.hooks` in a plugin does not import the runtime.
    if name == "Engine":
        from radixserve.engine import Engine

        return Engine
    if name == "ServerArgs":
        from radixserve.config import ServerArgs

        return ServerArgs
    raise AttributeError(name)


__all__ = ["Engine", "ServerArgs", "__version__"]
