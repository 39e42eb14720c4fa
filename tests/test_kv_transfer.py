"""KV transfer as a plugin kind (prefill/decode disaggregation): the built-in ``tcp``
backend passes the conformance kit (real ZMQ sockets on 127.0.0.1, real KV pools),
the kit fails a backend that gets the KV wrong, and backends are found and refused
through the registry like any plugin kind."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from helpers_mooncake import MOONCAKE

from radixserve.cache.memory_pool import KVPool
from radixserve.disaggregation.tcp_transfer import TcpSender, TcpTransfer
from radixserve.hooks import Register, hookimpl
from radixserve.kernels.kv_transfer import KVSender, KVSide
from radixserve.registry import BUILTIN_KV_TRANSFER_PLUGIN, PluginError, PluginRegistry
from radixserve.testing import check_kv_transfer_backend
from radixserve.testing.conformance import KV_TRANSFER_CASES


def test_tcp_passes_the_kv_transfer_kit():
    report = check_kv_transfer_backend("tcp")
    report.raise_for_failures(min_run=2 * len(KV_TRANSFER_CASES))


class _ReversedSender(TcpSender):
    """Sends a request's tokens last first: every byte arrives, in the wrong slots."""

    def send(
        self, room: int, slots: torch.Tensor, endpoints: Sequence[str], timeout_s: float, metadata: bytes = b""
    ) -> None:
        super().send(room, slots.flip(0), endpoints, timeout_s, metadata)


class ReversingTransfer(TcpTransfer):
    name = "reversing"

    @classmethod
    def open_sender(cls, pool: KVPool, side: KVSide) -> KVSender:
        return _ReversedSender(pool, side)


def test_the_kit_fails_a_backend_that_puts_the_kv_in_the_wrong_slots():
    report = check_kv_transfer_backend(ReversingTransfer, dtypes=(torch.float32,))
    failing = {result.case for result in report.failures}
    # Every case that moves more than one token fails, naming the layer that differs;
    # one token reversed is the same token, and the refusals do not depend on the order.
    moving = {c.name for c in KV_TRANSFER_CASES if c.outcome == "done" and c.tokens > 1}
    assert failing == moving, str(report)
    assert all("differs in" in (r.error or "") for r in report.failures)
    with pytest.raises(AssertionError, match="same_layout"):
        report.raise_for_failures()


def _side(**changes) -> KVSide:
    fields = dict(device="cpu", dtype="float32", num_layers=2, head_dim=8, total_kv_heads=4, heads=(0, 4), page_size=16)
    return KVSide(**{**fields, **changes})


def test_the_registry_finds_tcp_and_refuses_loudly():
    registry = PluginRegistry(load_entry_points=False)
    assert registry.kv_transfer_backend("tcp", _side()) is TcpTransfer
    rows = registry.report()["backends"]["kv_transfer"]
    assert {"name": "tcp", "plugin": BUILTIN_KV_TRANSFER_PLUGIN, "priority": 0} in rows
    with pytest.raises(PluginError, match=r"'mooncake' is not a registered KV transfer backend; registered: tcp"):
        registry.kv_transfer_backend("mooncake", _side())
    with pytest.raises(PluginError, match="latent KV"):
        registry.kv_transfer_backend("tcp", _side(latent=True))


class _ThirdParty:
    @hookimpl
    def register_kv_transfer_backends(self, register: Register) -> None:
        register(ReversingTransfer)


def test_a_plugin_registers_a_kv_transfer_backend_through_the_hook():
    registry = PluginRegistry(load_entry_points=False)
    registry.register_plugin(_ThirdParty(), "third-party")
    assert registry.kv_transfer_backend("reversing", _side()) is ReversingTransfer


def test_a_pair_is_refused_at_the_handshake_naming_every_difference():
    reasons = TcpTransfer.pair_reasons(_side(), _side(dtype="bfloat16", head_dim=16))
    assert any(r.startswith("dtype:") for r in reasons) and any(r.startswith("head_dim:") for r in reasons)
    # tp 2 decode rank 1 and a prefill rank holding heads 0-1 have nothing to exchange
    (reason,) = TcpTransfer.pair_reasons(_side(heads=(0, 2)), _side(heads=(2, 4)))
    assert reason.startswith("heads: no KV head in common")
    assert TcpTransfer.pair_reasons(_side(page_size=1), _side(page_size=16, head_major=True)) == []


# ---- mooncake (plugins/mooncake): Mooncake's transfer engine, over its TCP transport here ----
@MOONCAKE
def test_mooncake_passes_the_kv_transfer_kit(monkeypatch):
    """One-sided writes straight into the receiver's pool, converting page sizes,
    layouts and tensor-parallel splits by where each run of bytes goes. The senders'
    engine listens on 127.0.0.2, so the KV crosses Mooncake's TCP transport between
    two engines (one engine writing into its own memory would copy it locally)."""
    monkeypatch.setenv("RADIXSERVE_MOONCAKE_HOST", "127.0.0.2")
    report = check_kv_transfer_backend("mooncake")
    report.raise_for_failures(min_run=2 * len(KV_TRANSFER_CASES))


@MOONCAKE
def test_mooncake_registers_through_its_entry_point_and_says_what_it_cannot_read():
    from radixserve_mooncake.transfer import HOST_DISTRIBUTION, MooncakeTransfer

    registry = PluginRegistry()
    assert registry.kv_transfer_backend("mooncake", _side()) is MooncakeTransfer
    # The build without CUDA reads host memory only: a GPU worker is refused before it starts.
    with pytest.raises(PluginError, match=f"{HOST_DISTRIBUTION} reads host memory only; the KV is on 'cuda'"):
        registry.kv_transfer_backend("mooncake", _side(device="cuda"))


def test_mooncake_runs_merge_what_is_contiguous_on_both_sides():
    pytest.importorskip("radixserve_mooncake", reason="radixserve-plugin-mooncake is not installed")
    from radixserve_mooncake.transfer import merge_runs, unit_offsets

    side = _side(page_size=4)  # 4 heads of 8 float32s: a token's row is 128 bytes
    slots = torch.tensor([4, 5, 6, 7, 9])  # one whole page, then a slot of the next
    offsets = unit_offsets(side, slots, (0, 4), side)
    runs = merge_runs(offsets, offsets + 4096, 32)
    assert runs.source.tolist() == [4 * 128, 9 * 128] and runs.lengths == [4 * 128, 128]
    assert (runs.target - runs.source).tolist() == [4096, 4096]
    # A tp 2 receiver holding heads 2-3: each token's half row is a run of its own.
    half = _side(page_size=4, heads=(2, 4))
    runs = merge_runs(unit_offsets(side, slots, (2, 4), half), unit_offsets(half, slots, (2, 4), half), 32)
    assert runs.source.tolist() == [s * 128 + 64 for s in slots.tolist()]
    assert runs.target.tolist() == [s * 64 for s in slots.tolist()] and set(runs.lengths) == {64}
