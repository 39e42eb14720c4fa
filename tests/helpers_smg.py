"""SGLang's model gateway (smg) for compatibility tests: its two lines and a context
manager that runs one on a free port of 127.0.0.1."""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

# sglang-router 0.3.2 (the dev extra, on PATH) and smg 1.13, which installs a command of
# the same name and so lives in its own environment, made by .ci/run:
#     python -m venv .venv-smg-1.13 && .venv-smg-1.13/bin/pip install -r requirements-smg-1.13.txt
SMG_COMMANDS = {
    "0.3.2": shutil.which("smg"),
    "1.13": str(SMG_1_13)
    if (SMG_1_13 := Path(__file__).resolve().parent.parent / ".venv-smg-1.13/bin/smg").exists()
    else None,
}
SMG_TIMEOUT_S = 120
NOT_INSTALLED = (
    "smg {version} is not installed (0.3.2: sglang-router==0.3.2, the dev extra; 1.13: "
    "python -m venv .venv-smg-1.13 && .venv-smg-1.13/bin/pip install -r requirements-smg-1.13.txt)"
)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def smg(command: str, args: list[str], log: Path) -> Iterator[str]:
    """``command launch *args`` on a free port; its URL. Stopped on exit."""
    port = free_port()
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [command, "launch", *args, "--host", "127.0.0.1", "--port", str(port)], stdout=out, stderr=out
        )
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
