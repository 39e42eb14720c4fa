"""radixserve-plugin-mooncake: the KV-transfer backend ``mooncake``
(``--disaggregation-transfer-backend mooncake``), Mooncake's transfer engine."""

from __future__ import annotations

from radixserve.hooks import Register, hookimpl
from radixserve_mooncake.transfer import MooncakeTransfer


@hookimpl
def register_kv_transfer_backends(register: Register) -> None:
    register(MooncakeTransfer)
