"""Which rotary set each request computes its KV with: LongRoPE's short or long
factors (layers/rotary.py has the rule and why). The scheduler reproduces HF's
``generate``, in which all of a sequence's keys are always of the set of its
current length: a request (re)computed from its first token takes the set of
its length (``choose``), and a request on the short set whose next decode step
would take it past the original context is computed again on the long set
(``outgrown``: the scheduler requeues it). With one set (every model but a
LongRoPE one) nothing is chosen and no request outgrows it.
"""

from __future__ import annotations

from dataclasses import dataclass

from radixserve.layers.rotary import LongRope
from radixserve.runtime.execution.request import Req


@dataclass(frozen=True)
class RopeSets:
    long_rope: LongRope | None  # None: the model has one set

    def choose(self, req: Req) -> None:
        """Before ``req`` is computed from its first token (it holds no KV): the set of its length."""
        if self.long_rope is not None:
            req.rope_set = self.long_rope.set_for(req.seq_len)

    def outgrown(self, running: list[Req]) -> list[Req]:
        """The decoding requests on the short set whose next step would compute a
        position past the original context (``kv_len`` counts the steps launched)."""
        rope = self.long_rope
        if rope is None:
            return []
        return [r for r in running if r.kv is not None and r.rope_set < rope.set_for(r.kv.kv_len + 1)]

    def row_offsets(self, reqs: list[Req]) -> list[int] | None:
        """Per request, the first row of its set in the rotary table (None: one set)."""
        if self.long_rope is None:
            return None
        return [r.rope_set * self.long_rope.table_rows for r in reqs]
