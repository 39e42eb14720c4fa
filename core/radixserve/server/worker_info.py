"""What a router asks a worker, in the shapes of SGLang's worker endpoints, built
from the scheduler's ``server_info`` control reply (with ``--dp-size`` > 1, the
DP controller's merge: ``stats`` summed, each replica's under ``replicas``):

- ``worker_facts``: ``/server_info["worker"]``, what the worker is and can do;
- ``internal_states``: ``/server_info["internal_states"]``, one entry per replica;
- ``load_entries``: ``/get_load``, one entry per live replica;
- ``scheduler_loads``: ``/v1/loads``, the per-replica snapshot SGLang's newer builds
  serve and SGLang's model gateway (smg 1.x) polls for its load-aware policies.
"""

from __future__ import annotations

import dataclasses
import datetime
import time
from typing import Any

from radixserve.rate_bands import DECODE_BANDS, PREFILL_BANDS, band_entries
from radixserve.server.protocol import FEATURES


def replica_stats(info: dict[str, Any]) -> list[dict[str, Any]]:
    """Each live replica's scheduler stats with its ``dp_rank`` (a dead replica has none)."""
    if "replicas" not in info:
        return [{"dp_rank": 0, **info["stats"]}]
    return [{"dp_rank": r["dp_rank"], **r["stats"]} for r in info["replicas"] if r["stats"] is not None]


def worker_facts(info: dict[str, Any], dp_size: int, embedding: bool, prefill_step_tokens: int) -> dict[str, Any]:
    """The worker's platform (``--device``'s name for it), dtype, backends, parallelism,
    context length, KV pool (tokens, over all replicas), the most requests it runs at once
    and prompt tokens one prefill step computes (a replica's), served features, and decode
    and prefill throughput (tokens/s over all replicas; None until measured), also per
    batch-size band (``rate_bands``), its speculative decoding (None: off) and its LoRA
    adapters (None: LoRA off; else the adapters loaded, by name, with their paths)."""
    stats = info["stats"]
    return {
        "device": info["platform"],
        "dtype": info["dtype"],
        "backends": dict(info["backends"]),
        "tp_size": info["tp_size"],
        "dp_size": dp_size,
        "context_length": info["context_length"],
        "max_total_num_tokens": stats["max_total_tokens"],
        "max_running_requests": info["max_running_requests"] * dp_size,
        "prefill_step_tokens": prefill_step_tokens,
        "features": features(info, embedding),
        "decode_tokens_per_s": stats["decode_tokens_per_s"],
        "prefill_tokens_per_s": stats["prefill_tokens_per_s"],
        **band_reports(stats),
        "speculative": info.get("speculative"),
        "lora": lora_facts(info.get("lora")),
    }


def lora_facts(lora: dict[str, Any] | None) -> dict[str, Any] | None:
    """What a router needs of a worker's LoRA serving: its adapters (name -> path) and how many
    one batch mixes."""
    if lora is None:
        return None
    return {
        "adapters": {a["name"]: a["path"] for a in lora["adapters"]},
        "max_loras_per_batch": lora["max_loras_per_batch"],
        "max_loaded_loras": lora["max_loaded_loras"],
    }


def band_reports(stats: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """The step rates per batch-size band, in ``rate_bands``' report shape."""
    return {
        "decode_bands": band_entries(
            DECODE_BANDS,
            stats["decode_band_tokens_per_s"],
            stats["decode_band_sizes"],
            "running_requests",
            stats["decode_band_output_tokens_per_s"],
        ),
        "prefill_bands": band_entries(
            PREFILL_BANDS, stats["prefill_band_tokens_per_s"], stats["prefill_band_sizes"], "prefill_tokens"
        ),
    }


def features(info: dict[str, Any], embedding: bool) -> dict[str, bool]:
    """``protocol.FEATURES``, less structured output when ``--grammar-backend none`` turned it off;
    an embedding model serves embeddings and nothing of generation."""
    served = dataclasses.asdict(FEATURES)
    served["structured_output"] = FEATURES.structured_output and info.get("grammar_backend") is not None
    if embedding:
        served = dict.fromkeys(served, False)
    return {"generation": not embedding, "embeddings": embedding, **served}


def internal_states(info: dict[str, Any]) -> list[dict[str, Any]]:
    """Each live replica's stats, with SGLang's name for the decode throughput."""
    return [{**stats, "last_gen_throughput": stats["decode_tokens_per_s"]} for stats in replica_stats(info)]


def load_entries(info: dict[str, Any]) -> list[dict[str, Any]]:
    """``/get_load``: SGLang's keys (``num_reqs``: running + waiting; ``num_tokens``:
    the KV tokens in use plus the tokens the waiting requests have to prefill;
    ``num_pending_tokens``: the latter; ``ts_tic``: when, in Unix seconds) and the
    parts: running requests, waiting tokens, KV tokens in use and capacity, decode and prefill rates,
    and those rates per batch-size band (``decode_bands``, ``prefill_bands``)."""
    now = time.time()
    return [
        {
            "dp_rank": stats["dp_rank"],
            "num_reqs": stats["num_running_reqs"] + stats["num_queue_reqs"],
            "num_waiting_reqs": stats["num_queue_reqs"],
            "num_tokens": stats["tokens_in_use"] + stats["num_waiting_tokens"],
            "num_pending_tokens": stats["num_waiting_tokens"],
            "ts_tic": now,
            "num_running_reqs": stats["num_running_reqs"],
            "num_waiting_tokens": stats["num_waiting_tokens"],
            "num_used_tokens": stats["tokens_in_use"],
            "max_total_num_tokens": stats["max_total_tokens"],
            "decode_tokens_per_s": stats["decode_tokens_per_s"],
            "prefill_tokens_per_s": stats["prefill_tokens_per_s"],
            **band_reports(stats),
        }
        for stats in replica_stats(info)
    ]


# The sections ``/v1/loads?include=`` may name. Each replica's snapshot always carries the
# core figures (the ones a gateway reads); there is no disaggregation, speculative decoding
# or LoRA section to add yet.
LOAD_SECTIONS = ("core", "memory", "spec", "lora", "disagg", "queues", "all")


def scheduler_loads(info: dict[str, Any]) -> dict[str, Any]:
    """``/v1/loads``: when (ISO 8601), how many replicas, and for each live one its
    running and waiting requests, the prompt tokens its waiting requests have to compute,
    KV tokens in use and capacity (and their ratio), decode throughput, prefix-cache hit
    rate since start (cached over prompt tokens) and running slots in use (``utilization``)."""
    replicas = replica_stats(info)
    max_running_requests = info["max_running_requests"]  # a replica's
    return {
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "dp_rank_count": len(replicas),
        "loads": [
            {
                "dp_rank": stats["dp_rank"],
                "num_running_reqs": stats["num_running_reqs"],
                "num_waiting_reqs": stats["num_queue_reqs"],
                "num_waiting_uncached_tokens": stats["num_waiting_tokens"],
                "num_total_reqs": stats["num_running_reqs"] + stats["num_queue_reqs"],
                "num_used_tokens": stats["tokens_in_use"],
                "max_total_num_tokens": stats["max_total_tokens"],
                "token_usage": stats["tokens_in_use"] / stats["max_total_tokens"] if stats["max_total_tokens"] else 0.0,
                "gen_throughput": stats["decode_tokens_per_s"] or 0.0,
                "cache_hit_rate": (
                    stats["cached_tokens_total"] / stats["prompt_tokens_total"] if stats["prompt_tokens_total"] else 0.0
                ),
                "utilization": stats["num_running_reqs"] / max_running_requests if max_running_requests else 0.0,
                "max_running_requests": max_running_requests,
            }
            for stats in replicas
        ],
    }
