"""The KV-transfer kit: ``check_kv_transfer_backend(backend, device)`` runs a backend's
senders and receivers in this process between KV pools on ``device`` and checks the
contract (radixserve.kernels.kv_transfer):

- the KV arrives bit for bit at the slots the receiver expected, in every layer, and
  nothing else in its pool changes, with the metadata sent; both sides' rooms end DONE;
- the sides may differ in page size, pool layout (token- or head-major) and
  tensor-parallel split (one sender to two receivers, two senders to one);
- what must fail fails with a reason: a pair of different dtypes is refused at the
  handshake (``TransferRefused`` naming the dtype), a room nobody sends ends FAILED
  on the receiver at its timeout, a room the receiver does not expect ends FAILED on
  the sender well before its own timeout (the receiver refuses it).

Every case runs in float32 and bfloat16 (``dtypes``); a case whose sides the backend
declines (``unsupported_reasons``) is reported as skipped."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from radixserve.cache.memory_pool import KVLayout, KVPool
from radixserve.kernels.kv_transfer import (
    KVReceiver,
    KVSender,
    KVSide,
    KVTransferBackend,
    TransferRefused,
    TransferState,
    TransferStatus,
    common_heads,
    dtype_name,
)
from radixserve.testing.conformance.base import (
    BackendSpec,
    CaseResult,
    ConformanceReport,
    SkippedCase,
    _error_text,
    _registry,
    _torch_device,
    resolve_backend,
)

NUM_LAYERS, TOTAL_KV_HEADS, HEAD_DIM = 3, 4, 16
WAIT_S = 10.0  # the most a case waits for rooms to finish
ROOM = 7  # each case's one room (each case opens its own senders and receivers)


@dataclass(frozen=True)
class PoolSpec:
    """One side: the model's KV heads it holds, its page size and layout, and its
    dtype when it differs from the case's."""

    heads: tuple[int, int] = (0, TOTAL_KV_HEADS)
    page_size: int = 16
    head_major: bool = False
    dtype: torch.dtype | None = None


@dataclass(frozen=True)
class TransferCase:
    name: str
    senders: tuple[PoolSpec, ...] = (PoolSpec(),)
    receivers: tuple[PoolSpec, ...] = (PoolSpec(),)
    tokens: int = 37
    # "done": the KV arrives; "refused": the handshake refuses the pair; "receiver_timeout":
    # nothing is sent; "unexpected_room": the sender sends a room the receiver never expected;
    # "receiver_gone": the receiver closes after the handshake, before the room is sent.
    outcome: str = "done"


KV_TRANSFER_CASES: tuple[TransferCase, ...] = (
    TransferCase("same_layout"),
    TransferCase("one_token", tokens=1),
    TransferCase("page_sizes_16_to_1", receivers=(PoolSpec(page_size=1),)),
    TransferCase("page_sizes_1_to_16", senders=(PoolSpec(page_size=1),)),
    TransferCase("token_major_to_head_major", receivers=(PoolSpec(head_major=True),)),
    TransferCase("head_major_to_token_major", senders=(PoolSpec(head_major=True, page_size=4),)),
    TransferCase("tp1_to_tp2", receivers=(PoolSpec(heads=(0, 2)), PoolSpec(heads=(2, 4), page_size=1))),
    TransferCase("tp2_to_tp1", senders=(PoolSpec(heads=(0, 2)), PoolSpec(heads=(2, 4), head_major=True))),
    TransferCase("dtype_mismatch", receivers=(PoolSpec(dtype=torch.float16),), outcome="refused"),
    TransferCase("receiver_timeout", outcome="receiver_timeout"),
    TransferCase("unexpected_room", outcome="unexpected_room"),
    TransferCase("receiver_gone", outcome="receiver_gone"),
)


@dataclass
class _End:
    """One side of a case: its pool, its KVSide and its slots for the room."""

    spec: PoolSpec
    pool: KVPool
    side: KVSide
    slots: torch.Tensor
    before: list[torch.Tensor] = field(default_factory=list)  # a receiver's buffers before the room


def _num_pages(spec: PoolSpec, tokens: int) -> int:
    """Room for twice the case's tokens: slots to spare that must stay as they were."""
    return -(-2 * tokens // spec.page_size) + 1


def _pool(spec: PoolSpec, num_pages: int, dtype: torch.dtype, device: torch.device) -> KVPool:
    heads = spec.heads[1] - spec.heads[0]
    layout = KVLayout(head_major=spec.head_major)
    return KVPool(num_pages, spec.page_size, NUM_LAYERS, heads, HEAD_DIM, dtype, device, layout=layout)


def _side(spec: PoolSpec, dtype: torch.dtype, platform: str) -> KVSide:
    """``spec``'s side of a case run in ``dtype`` (its own dtype when it has one)."""
    return KVSide(
        device=platform,
        dtype=dtype_name(spec.dtype or dtype),
        num_layers=NUM_LAYERS,
        head_dim=HEAD_DIM,
        total_kv_heads=TOTAL_KV_HEADS,
        heads=spec.heads,
        page_size=spec.page_size,
        head_major=spec.head_major,
    )


def _end(
    spec: PoolSpec, dtype: torch.dtype, device: torch.device, platform: str, tokens: int, gen: torch.Generator
) -> _End:
    pool = _pool(spec, _num_pages(spec, tokens), spec.dtype or dtype, device)
    # Slots scattered over the pool (page 0 is reserved), in no order.
    usable = torch.randperm(pool.size, generator=gen)[:tokens] + spec.page_size
    return _End(spec, pool, _side(spec, dtype, platform), usable.to(device))


def _fill(end: _End, k: torch.Tensor, v: torch.Tensor) -> None:
    """Write the model's K and V ``[layers, tokens, heads, d]`` (the heads it holds) at the end's slots;
    the rest of its pool is random too, so that reading the wrong slots shows."""
    gen = torch.Generator().manual_seed(7)
    for buffers in (end.pool.k_buffers, end.pool.v_buffers):
        for buffer in buffers:
            buffer.copy_(torch.randn(buffer.shape, generator=gen).to(buffer.dtype))
    start, stop = end.spec.heads
    for layer in range(NUM_LAYERS):
        end.pool.write_kv(layer, end.slots, k[layer, :, start:stop], v[layer, :, start:stop])


def _check_arrived(end: _End, k: torch.Tensor, v: torch.Tensor) -> str | None:
    """What is wrong with a receiver's pool after the room: None when it holds exactly the
    model's KV of its heads at its slots and its old contents everywhere else."""
    expected = _pool(end.spec, end.pool.num_pages, end.pool.dtype, end.pool.device)
    for mine, old in zip([*expected.k_buffers, *expected.v_buffers], end.before, strict=True):
        mine.copy_(old)
    start, stop = end.spec.heads
    for layer in range(NUM_LAYERS):
        expected.write_kv(layer, end.slots, k[layer, :, start:stop], v[layer, :, start:stop])
    for layer in range(NUM_LAYERS):
        for which, got, want in (
            ("K", end.pool.k_buffers[layer], expected.k_buffers[layer]),
            ("V", end.pool.v_buffers[layer], expected.v_buffers[layer]),
        ):
            if not torch.equal(got, want):
                wrong = (got != want).reshape(-1).nonzero().numel()
                return f"receiver heads {list(end.spec.heads)}: layer {layer} {which} differs in {wrong} elements"
    return None


def _wait(ends: Sequence[KVSender | KVReceiver], room: int, within_s: float) -> list[TransferStatus]:
    deadline = time.monotonic() + within_s
    while True:
        statuses = [end.poll(room) for end in ends]
        if all(s.finished for s in statuses) or time.monotonic() > deadline:
            return statuses
        time.sleep(0.005)


def _run_case(
    cls: type[KVTransferBackend], case: TransferCase, dtype: torch.dtype, device: torch.device, platform: str
) -> str | None:
    """None when the case passes, else what went wrong."""
    gen = torch.Generator().manual_seed(hash(case.name) % 2**31)
    k = torch.randn(NUM_LAYERS, case.tokens, TOTAL_KV_HEADS, HEAD_DIM, generator=gen).to(dtype).to(device)
    v = torch.randn(NUM_LAYERS, case.tokens, TOTAL_KV_HEADS, HEAD_DIM, generator=gen).to(dtype).to(device)
    senders_ends = [_end(spec, dtype, device, platform, case.tokens, gen) for spec in case.senders]
    receivers_ends = [_end(spec, dtype, device, platform, case.tokens, gen) for spec in case.receivers]
    for end in senders_ends:
        _fill(end, k, v)
    for end in receivers_ends:
        _fill(end, torch.zeros_like(k), torch.zeros_like(v))
        end.before = [b.clone() for b in (*end.pool.k_buffers, *end.pool.v_buffers)]
    receivers = [cls.open_receiver(e.pool, e.side, "127.0.0.1") for e in receivers_ends]
    senders = [cls.open_sender(e.pool, e.side) for e in senders_ends]
    room = ROOM
    parties: list[KVSender | KVReceiver] = [*senders, *receivers]
    try:
        pairs = [
            (sender, s_end, receiver, r_end)
            for sender, s_end in zip(senders, senders_ends, strict=True)
            for receiver, r_end in zip(receivers, receivers_ends, strict=True)
            if common_heads(s_end.side, r_end.side) is not None
        ]
        if case.outcome == "refused":
            try:
                senders[0].connect(receivers[0].endpoint, WAIT_S)
            except TransferRefused as exc:
                return None if any("dtype" in r for r in exc.reasons) else f"refused without naming the dtype: {exc}"
            return "a pair of different dtypes was not refused at the handshake"
        for sender, _, receiver, r_end in pairs:
            theirs = sender.connect(receiver.endpoint, WAIT_S)
            if theirs != r_end.side:
                return f"the handshake returned {theirs}, not the receiver's side {r_end.side}"
        if case.outcome == "receiver_timeout":
            receivers[0].expect(room, receivers_ends[0].slots, 0.3)
            (status,) = _wait(receivers, room, WAIT_S)
            if status.state is not TransferState.FAILED or not status.reason:
                return f"a room nobody sent ended {status} on the receiver, not FAILED with a reason"
            return None
        if case.outcome == "receiver_gone":
            receivers[0].close()
            senders[0].send(room, senders_ends[0].slots, [receivers[0].endpoint], 0.5)
            (status,) = _wait(senders, room, WAIT_S)
            if status.state is not TransferState.FAILED or not status.reason:
                return f"a room sent to a receiver that is gone ended {status} on the sender"
            return None
        if case.outcome == "unexpected_room":
            started = time.monotonic()
            senders[0].send(room, senders_ends[0].slots, [receivers[0].endpoint], 60.0)
            (status,) = _wait(senders, room, WAIT_S)
            if status.state is not TransferState.FAILED or not status.reason:
                return f"a room the receiver never expected ended {status} on the sender"
            if time.monotonic() - started > WAIT_S / 2:
                return "the sender learned of the refusal only at its timeout"
            return None
        for receiver, end in zip(receivers, receivers_ends, strict=True):
            receiver.expect(room, end.slots, WAIT_S)
        metadata = f"room {room}: first token 42".encode()
        for sender, s_end in zip(senders, senders_ends, strict=True):
            endpoints = [receiver.endpoint for other, _, receiver, _ in pairs if other is sender]
            sender.send(room, s_end.slots, endpoints, WAIT_S, metadata)
        statuses = _wait([*senders, *receivers], room, WAIT_S)
        if any(s.state is not TransferState.DONE for s in statuses):
            return "rooms ended " + ", ".join(f"{s.state.value} {s.reason}".strip() for s in statuses)
        for end in receivers_ends:
            problem = _check_arrived(end, k, v)
            if problem:
                return problem
        for receiver in receivers:
            if receiver.metadata(room) != metadata:
                return f"the receiver's metadata is {receiver.metadata(room)!r}, not the {metadata!r} sent"
        for party in parties:
            party.forget(room)
            if party.poll(room).state is not TransferState.FAILED:
                return "a forgotten room is still known"
        return None
    finally:
        for party in parties:
            party.close()


def check_kv_transfer_backend(
    backend: BackendSpec,
    device: str = "cpu",
    cases: Sequence[TransferCase] = KV_TRANSFER_CASES,
    dtypes: Sequence[torch.dtype] = (torch.float32, torch.bfloat16),
) -> ConformanceReport:
    """Run ``cases`` for each of ``dtypes`` on ``device`` (a registered platform's name)."""
    registry = _registry(None)
    name, found = resolve_backend("kv_transfer", backend, registry)
    if not (isinstance(found, type) and issubclass(found, KVTransferBackend)):
        raise TypeError(f"{found!r} is not a KVTransferBackend")
    cls: type[KVTransferBackend] = found
    torch_device = _torch_device(device, registry)
    report = ConformanceReport("kv_transfer", name, "the sender's pool", device)
    for case in cases:
        for dtype in dtypes:
            sides = [_side(spec, dtype, device) for spec in (*case.senders, *case.receivers)]
            reasons = sorted({r for side in sides for r in cls.unsupported_reasons(side)})
            if reasons:
                report.skipped.append(SkippedCase(case.name, dtype_name(dtype), reasons))
                continue
            try:
                problem = _run_case(cls, case, dtype, torch_device, device)
            except Exception as exc:
                problem = _error_text(exc)
            report.results.append(CaseResult(case.name, dtype_name(dtype), problem is None, error=problem))
    return report
