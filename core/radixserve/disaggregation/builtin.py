"""The built-in KV-transfer backends, registered through the same hook as a third
party's (built-in plugin ``radixserve-kv-transfer``): ``tcp``."""

from __future__ import annotations

from radixserve.disaggregation.tcp_transfer import TcpTransfer
from radixserve.hooks import Register, hookimpl


@hookimpl
def register_kv_transfer_backends(register: Register) -> None:
    register(TcpTransfer)
