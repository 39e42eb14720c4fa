"""The listening socket of an HTTP server (``radixserve serve`` and ``radixserve router``)."""

from __future__ import annotations

import errno
import socket

from radixserve.startup_error import StartupError


def bind_socket(host: str, port: int) -> socket.socket:
    """The listening socket; StartupError naming host:port when it cannot be had.

    Made with ``proto=IPPROTO_TCP`` (which accepted sockets inherit): asyncio sets
    TCP_NODELAY only on sockets that say so, and with Nagle on, the body write that
    follows a response's header write waits for the client's delayed ACK (~40 ms on
    every keep-alive request)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        where = base_url(host, port).removeprefix("http://")
        reason = exc.strerror or str(exc)
        if exc.errno == errno.EADDRINUSE:
            raise StartupError(
                f"cannot listen on {where}: the address is already in use",
                "another process holds that port: stop it, pick another --port, or pass --port 0 for a free one",
            ) from exc
        raise StartupError(
            f"cannot listen on {where}: {reason}",
            "check --host (an address of this machine, e.g. 127.0.0.1 or 0.0.0.0) and --port",
        ) from exc
    return sock


def base_url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
