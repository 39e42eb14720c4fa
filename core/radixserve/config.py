"""ServerArgs: every flag, one dataclass, one place. The CLI, the Engine and the
server all build it from here."""

from __future__ import annotations

import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from radixserve.cli_args import CliArgs
from radixserve.cli_args import flag as _flag
from radixserve.load_balance import LoadBalanceMethod, describe, policy_error

SchedulePolicy = Literal["fcfs", "lpm", "priority"]
Dtype = Literal["auto", "float32", "bfloat16", "float16"]
BackendSelection = Literal["measure", "priority"]
# How an embedding model pools its final hidden states (radixserve/layers/pooler.py).
PoolingMethod = Literal["last", "mean"]
SCHEDULE_POLICIES: tuple[str, ...] = typing.get_args(SchedulePolicy)
DTYPES: tuple[str, ...] = typing.get_args(Dtype)
BACKEND_SELECTIONS: tuple[str, ...] = typing.get_args(BackendSelection)
POOLING_METHODS: tuple[str, ...] = typing.get_args(PoolingMethod)
DisaggregationMode = Literal["null", "prefill", "decode"]


@dataclass
class ServerArgs(CliArgs):
    # model
    model_path: str | None = _flag(
        "local HuggingFace model directory, hub repo id (org/name) or GGUF file (m.gguf); omitted: the "
        "built-in demo model (random weights)",
        default=None,
        cli_names=("--model", "--model-path"),  # --model is the documented spelling
        metavar="MODEL",
    )
    tokenizer_path: str | None = _flag("tokenizer directory (defaults to --model)", default=None)
    served_model_name: str | None = _flag("model name reported by the API (defaults to --model)", default=None)
    dtype: Dtype = _flag("weight and activation dtype", default="auto")
    kv_cache_dtype: Dtype = _flag("KV cache dtype (auto: same as dtype)", default="auto")
    context_length: int | None = _flag("max tokens per request (defaults to the model's)", default=None)
    quantization: str | None = _flag("quantization method, e.g. int8 (weight-only, per channel)", default=None)
    chat_template: str | None = _flag("Jinja chat template file overriding the tokenizer's", default=None)
    random_seed: int = _flag("seed for weights-free randomness (sampling without a per-request seed)", default=0)
    # embeddings (radixserve/embedding_config.py)
    is_embedding: bool | None = _flag(
        "serve the model for embeddings (/v1/embeddings; it then generates nothing), as SGLang's --is-embedding; "
        "unset: when its architecture is a backbone without an LM head (Qwen3Model, LlamaModel, ...) or its "
        "directory is a sentence-transformers model (modules.json with a Pooling module); --no-is-embedding: never",
        default=None,
    )
    pooling: PoolingMethod | None = _flag(
        "how an embedding model pools its final hidden states: last (the last token's, as Qwen3-Embedding) or "
        "mean (over all tokens); unset: as its sentence-transformers files say (1_Pooling/config.json), else last",
        default=None,
    )
    normalize_embeddings: bool | None = _flag(
        "L2-normalise embeddings; unset: as the sentence-transformers files say (a Normalize module), else on",
        default=None,
    )
    # device and backends
    device: str = _flag(
        "platform: auto (the highest-priority usable one), cpu (built in), cuda (with "
        "hardware/cuda installed), or any registered plugin platform; `radixserve plugins` lists "
        "them",
        default="auto",
    )
    attention_backend: str = _flag("attention backend name or auto (`radixserve plugins` lists them)", default="auto")
    gemm_backend: str = _flag("GEMM backend name or auto", default="auto")
    moe_backend: str = _flag("MoE backend name or auto (used by MoE models only)", default="auto")
    elementwise_backend: str = _flag(
        "elementwise kernels (RMSNorm + residual, rotary, SiLU-and-mul) backend name or auto", default="auto"
    )
    backend_selection: BackendSelection = _flag(
        "how auto picks among the usable backends of a kind: measure (time them on the model's shapes, once per "
        "machine and model shape; the result is cached) or priority (the highest-priority one, no timing)",
        default="measure",
    )
    grammar_backend: str = _flag(
        "structured output (response_format, regex, ebnf, guided_*): auto (the highest-priority grammar backend: "
        "xgrammar), xgrammar, llguidance, any registered one, or none (such requests get a 400)",
        default="auto",
    )
    tool_call_parser: str | None = _flag(
        "how tool calls are read from chat output (tools with tool_choice auto): hermes (Qwen's <tool_call>), "
        "llama3_json, mistral, pythonic, or any registered tool parser; unset: detected from the chat template, "
        "else hermes",
        default=None,
    )
    reasoning_parser: str | None = _flag(
        "split chat output into reasoning_content and content: qwen3 or deepseek-r1 (<think>...</think>), or any "
        "registered reasoning parser; a grammar then applies only after the reasoning",
        default=None,
    )
    grammar_compile_timeout: float = _flag(
        "seconds a request's grammar may take to compile; a request whose compile takes longer ends with a 400",
        default=60.0,
    )
    tp_size: int = _flag(
        "tensor parallel size: that many scheduler processes (ranks), joined by torch.distributed with the "
        "platform's backend, each holding 1/tp_size of every layer",
        default=1,
    )
    nnodes: int = _flag(
        "nodes the tp_size ranks are spread over (tp_size / nnodes each); node 0 serves HTTP", default=1
    )
    node_rank: int = _flag(
        "this node's index among --nnodes (0 serves HTTP, the others run their ranks only)", default=0
    )
    dist_init_addr: str | None = _flag(
        "host:port where the ranks of all nodes meet (a TCP store that node 0 serves); required with --nnodes > 1; "
        "read from MASTER_ADDR/MASTER_PORT under torchrun (docs/architecture.md, 'Tensor parallelism')",
        default=None,
    )
    dist_timeout: float = _flag(
        "seconds a rank waits in a collective or at the rendezvous before it fails (a hung or lost rank ends "
        "the group instead of stalling it)",
        default=600.0,
    )
    dp_size: int = _flag(
        "data parallel size: that many replicas (scheduler groups, each with its own KV pool) behind one "
        "controller that dispatches each request to one of them",
        default=1,
    )
    load_balance_method: LoadBalanceMethod = _flag(
        "how the data-parallel controller picks a replica (ties in turn): " + describe("dp"),
        default="round_robin",
    )
    base_gpu_id: int = _flag(
        "device index of the first rank: rank i of data-parallel replica k runs on device "
        "base_gpu_id + k * tp_size + i, "
        "counted among the visible devices (after CUDA_VISIBLE_DEVICES and the like)",
        default=0,
    )
    # memory and cache
    page_size: int = _flag("KV cache page size in tokens", default=1)
    max_total_tokens: int | None = _flag("KV pool size in tokens (overrides mem_fraction_static)", default=None)
    mem_fraction_static: float | None = _flag(
        "fraction of the device memory for weights + KV pool (defaults to the platform's)", default=None
    )
    disable_radix_cache: bool = _flag("disable prefix caching", default=False)
    # scheduling
    max_running_requests: int | None = _flag("max requests decoding at once", default=None)
    max_queued_requests: int | None = _flag("reject new requests with 503 beyond this many waiting", default=None)
    chunked_prefill_size: int | None = _flag("max prompt tokens per prefill chunk; -1 disables chunking", default=2048)
    max_prefill_tokens: int = _flag("max new prompt tokens in one prefill batch", default=8192)
    schedule_policy: SchedulePolicy = _flag("waiting-queue order", default="fcfs")
    schedule_conservativeness: float = _flag("scales the reserved decode budget when admitting requests", default=1.0)
    init_new_token_ratio: float = _flag("initial fraction of max_new_tokens reserved per running request", default=0.7)
    min_new_token_ratio: float = _flag("floor that the reserved fraction decays to", default=0.1)
    new_token_ratio_decay: float = _flag("decrease of the reserved fraction per decode step", default=0.001)
    stream_interval: int = _flag("send streamed output every N tokens", default=1)
    disable_overlap_schedule: bool | None = _flag(
        "run each step's scheduling and result handling after its forward instead of alongside the next one "
        "(unset: the platform decides; on by default on GPUs, off on the cpu platform; "
        "--no-disable-overlap-schedule overlaps everywhere)",
        default=None,
    )
    decode_log_interval: int = _flag("log a scheduler stats line every N decode steps", default=40)
    disable_graph: bool | None = _flag(
        "run decode steps eagerly instead of replaying device graphs captured at start-up (unset: graphs "
        "wherever the platform and the attention backend can capture them; --no-disable-graph insists on them: "
        "start-up fails, saying why, where they cannot be captured)",
        default=None,
        aliases=("--disable-cuda-graph",),
    )
    graph_max_bs: int | None = _flag(
        "largest decode batch replayed from a graph; larger ones run eagerly (unset: --max-running-requests)",
        default=None,
        aliases=("--cuda-graph-max-bs",),
    )
    # prefill/decode disaggregation (docs/disaggregation.md)
    disaggregation_mode: DisaggregationMode = _flag(
        "null: an ordinary worker; prefill: a request with bootstrap fields is prefilled and its KV and first "
        "token handed to its decode worker; decode: such a request waits for its KV, then decodes. Requests "
        "without bootstrap fields are served whole in every mode",
        default="null",
    )
    disaggregation_bootstrap_port: int = _flag(
        "a prefill worker's bootstrap port, where decode workers say where each request's KV is to go", default=8998
    )
    disaggregation_transfer_backend: str = _flag(
        "how KV moves between the two workers: a registered KV transfer backend (radixserve plugins; tcp is built in)",
        default="tcp",
    )
    disaggregation_timeout_secs: float = _flag(
        "seconds a prefill worker holds a request's KV for its decode worker, and a decode worker waits for it",
        default=60.0,
    )
    # speculative decoding (docs/speculative.md)
    speculative_algorithm: str | None = _flag(
        "propose several tokens a step and keep those the model agrees with (greedy: the same tokens; "
        "sampling: the same distribution): ngram (built in: lookup in the request's own prompt and output), "
        "draft (built in: a smaller model, --speculative-draft-model-path), eagle (built in: an EAGLE head over the "
        "target's hidden states, --speculative-eagle-path) or any registered proposer "
        "(`radixserve plugins` lists them); unset: off",
        default=None,
    )
    speculative_num_draft_tokens: int = _flag("the most tokens proposed for a request in one step", default=4)
    speculative_draft_model_path: str | None = _flag(
        "draft: a smaller model with the same tokenizer (a local HuggingFace directory), run beside the target on "
        "the same device; it decodes the proposals greedily",
        default=None,
    )
    speculative_eagle_path: str | None = _flag(
        "eagle: an EAGLE head trained for the target (a local directory in EAGLE-1/2's layout, a Llama config.json "
        "and fc/layers weights, reading the target's final hidden states and using its embedding and LM head; or in "
        "EAGLE-3's, architecture LlamaForCausalLMEagle3, reading three of the target's layers and proposing from a "
        "draft vocabulary of its own)",
        default=None,
    )
    speculative_ngram_min_match_window_size: int = _flag(
        "ngram: the shortest suffix of a request looked up in its earlier tokens", default=1
    )
    speculative_ngram_max_match_window_size: int = _flag(
        "ngram: the longest suffix looked up (the longest one found wins)", default=12
    )
    speculative_max_batch_size: int = _flag(
        "speculate only while at most this many requests decode; larger batches decode one token a step "
        "(the larger the batch, the more a verify step costs against a decode step; measure yours with "
        "benchmarks/bench_speculative.py --step-cost: a model whose steps are bound by reading its weights "
        "gains at larger batches than a small one)",
        default=4,
    )
    # multi-LoRA serving (docs/lora.md)
    enable_lora: bool = _flag(
        "serve LoRA adapters over the base model: a request names one by its OpenAI `model` or by `lora_path`; "
        "one batch mixes adapters and the base model",
        default=False,
    )
    lora_paths: list[str] = _flag(
        "adapters loaded at start, each NAME=PATH (a PEFT directory: adapter_config.json and "
        "adapter_model.safetensors); more load at run time through /load_lora_adapter",
        default=[],
        metavar="NAME=PATH",
        repeat=True,
    )
    max_lora_rank: int | None = _flag(
        "the largest adapter rank served (the adapters' slots are this wide); unset: the largest of "
        "--lora-paths, at least 16",
        default=None,
    )
    max_loras_per_batch: int = _flag(
        "adapters one batch may use (slots in device memory; the base model takes none): a request whose adapter "
        "would be one more waits, and an idle adapter's slot goes to the next one needed, least recently used first",
        default=8,
    )
    max_loaded_loras: int | None = _flag(
        "adapters held in host memory at once (a load beyond it is refused); unset: no limit", default=None
    )
    lora_backend: str = _flag("LoRA backend name or auto (with --enable-lora)", default="auto")
    # server
    host: str = _flag("HTTP host", default="127.0.0.1")
    port: int = _flag("HTTP port", default=30000)
    api_key: str | None = _flag("require this bearer token", default=None)
    admin_api_key: str | None = _flag(
        "require this bearer token on the admin routes (/flush_cache, /abort_request, /start_profile, "
        "/stop_profile), which --api-key then no longer opens; it opens the other routes too",
        default=None,
    )
    profile_dir: str | None = _flag(
        "directory under which /start_profile writes traces (a request's output_dir is a path relative to it); "
        "unset: $RADIXSERVE_PROFILE_DIR, else a temporary directory made at the first profile",
        default=None,
    )
    max_payload_size: int = _flag("max request body in bytes", default=32 * 1024 * 1024)
    # request limits (radixserve.request_limits; a request beyond one is a 400 naming the field)
    max_n: int = _flag("max choices per request (n)", default=64)
    max_stop_strings: int = _flag("max stop strings per request", default=64)
    max_stop_chars: int = _flag("max characters over all of a request's stop strings", default=8192)
    log_level: str = _flag("logging level; debug also shows the full traceback of a start-up error", default="info")
    log_requests: bool = _flag(
        "also log each request's body (its first 2 KB) and finish reasons in the access log", default=False
    )
    skip_server_warmup: bool = _flag("skip the warm-up generation at startup", default=False)
    shutdown_timeout: float = _flag(
        "seconds that SIGTERM/SIGINT lets in-flight requests finish (new ones get 503) before ending them "
        "with an error; 0 ends them at once",
        default=30.0,
    )
    max_header_size: int = _flag("max size of a request's headers in bytes (431 beyond)", default=64 * 1024)
    timeout_keep_alive: float = _flag(
        "seconds an idle keep-alive connection stays open; longer than clients keep theirs (httpx and the "
        "openai client: 5 s, the router: 4 s, Go's and Rust's reqwest, hence SGLang's gateway: 90 s), so that "
        "the client closes it first",
        default=120.0,
    )

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        def bad(name: str, msg: str) -> None:
            raise ValueError(f"{name}: {msg}")

        if self.page_size < 1:
            bad("page_size", f"must be >= 1, got {self.page_size}")
        if self.max_total_tokens is not None and self.max_total_tokens < self.page_size:
            bad("max_total_tokens", f"must be >= page_size, got {self.max_total_tokens}")
        if self.mem_fraction_static is not None and not 0 < self.mem_fraction_static <= 1:
            bad("mem_fraction_static", f"must be in (0, 1], got {self.mem_fraction_static}")
        if self.backend_selection not in BACKEND_SELECTIONS:
            bad("backend_selection", f"must be one of {BACKEND_SELECTIONS}, got {self.backend_selection!r}")
        if self.schedule_policy not in SCHEDULE_POLICIES:
            bad("schedule_policy", f"must be one of {SCHEDULE_POLICIES}, got {self.schedule_policy!r}")
        if self.dtype not in DTYPES:
            bad("dtype", f"must be one of {DTYPES}, got {self.dtype!r}")
        if self.pooling is not None and self.pooling not in POOLING_METHODS:
            bad("pooling", f"must be one of {POOLING_METHODS}, got {self.pooling!r}")
        if self.is_embedding is False and (self.pooling is not None or self.normalize_embeddings is not None):
            name = "pooling" if self.pooling is not None else "normalize_embeddings"
            bad(name, "is for an embedding model, and --no-is-embedding serves this one for generation")
        if self.kv_cache_dtype not in DTYPES:
            bad("kv_cache_dtype", f"must be one of {DTYPES}, got {self.kv_cache_dtype!r}")
        if (
            self.chunked_prefill_size is not None
            and self.chunked_prefill_size != -1
            and (self.chunked_prefill_size < self.page_size)
        ):
            bad(
                "chunked_prefill_size",
                f"must be -1 (off) or at least page_size ({self.page_size}), got {self.chunked_prefill_size}",
            )
        if self.max_prefill_tokens < self.page_size:
            bad("max_prefill_tokens", f"must be at least page_size ({self.page_size}), got {self.max_prefill_tokens}")
        if self.max_running_requests is not None and self.max_running_requests < 1:
            bad("max_running_requests", f"must be >= 1, got {self.max_running_requests}")
        if self.quantization == "auto":
            bad("quantization", "is never chosen automatically: leave it unset for none, or name a method (e.g. int8)")
        if self.base_gpu_id < 0:
            bad("base_gpu_id", f"must be >= 0, got {self.base_gpu_id}")
        self._validate_parallel(bad)
        for name in ("max_n", "max_stop_strings", "max_stop_chars"):
            if getattr(self, name) < 1:
                bad(name, f"must be >= 1, got {getattr(self, name)}")
        if self.graph_max_bs is not None and self.graph_max_bs < 1:
            bad("graph_max_bs", f"must be >= 1, got {self.graph_max_bs}")
        if self.decode_log_interval < 1:
            bad("decode_log_interval", f"must be >= 1, got {self.decode_log_interval}")
        if self.stream_interval < 1:
            bad("stream_interval", f"must be >= 1, got {self.stream_interval}")
        if not 0 <= self.port <= 65535:
            bad("port", f"must be in [0, 65535] (0 picks a free port), got {self.port}")
        if self.shutdown_timeout < 0:
            bad("shutdown_timeout", f"must be >= 0, got {self.shutdown_timeout}")
        if self.admin_api_key is not None and self.admin_api_key == self.api_key:
            bad("admin_api_key", "must differ from api_key (else every client could use the admin routes)")
        if not (isinstance(self.grammar_compile_timeout, (int, float)) and self.grammar_compile_timeout > 0):
            bad("grammar_compile_timeout", f"must be > 0 seconds, got {self.grammar_compile_timeout}")
        self._validate_speculative(bad)
        self._validate_lora(bad)
        if self.max_header_size < 1024:
            bad("max_header_size", f"must be >= 1024 bytes, got {self.max_header_size}")
        if self.timeout_keep_alive <= 0:
            bad("timeout_keep_alive", f"must be > 0 seconds, got {self.timeout_keep_alive}")

    def _validate_speculative(self, bad: Callable[[str, str], None]) -> None:
        for name in ("speculative_num_draft_tokens", "speculative_max_batch_size"):
            if getattr(self, name) < 1:
                bad(name, f"must be >= 1, got {getattr(self, name)}")
        low, high = self.speculative_ngram_min_match_window_size, self.speculative_ngram_max_match_window_size
        if low < 1:
            bad("speculative_ngram_min_match_window_size", f"must be >= 1, got {low}")
        if high < low:
            bad("speculative_ngram_max_match_window_size", f"must be >= the min match window ({low}), got {high}")
        if self.speculative_draft_model_path is not None and self.speculative_algorithm is None:
            bad("speculative_draft_model_path", "is for --speculative-algorithm draft, and speculation is off")
        if self.speculative_eagle_path is not None and self.speculative_algorithm is None:
            bad("speculative_eagle_path", "is for --speculative-algorithm eagle, and speculation is off")
        if self.speculative_algorithm is not None and self.disable_overlap_schedule is False:
            bad(
                "disable_overlap_schedule",
                "speculative decoding runs its steps without overlap (a step's proposals need the tokens the step "
                "before made); leave --disable-overlap-schedule unset",
            )

    def _validate_lora(self, bad: Callable[[str, str], None]) -> None:
        if self.max_lora_rank is not None and self.max_lora_rank < 1:
            bad("max_lora_rank", f"must be >= 1, got {self.max_lora_rank}")
        if self.max_loras_per_batch < 1:
            bad("max_loras_per_batch", f"must be >= 1, got {self.max_loras_per_batch}")
        if self.max_loaded_loras is not None and self.max_loaded_loras < 1:
            bad("max_loaded_loras", f"must be >= 1, got {self.max_loaded_loras}")
        names = []
        for entry in self.lora_paths:
            name, sep, path = entry.partition("=")
            if not sep or not name or not path:
                bad("lora_paths", f"each entry is NAME=PATH, got {entry!r}")
            if ":" in name or name in (self.served_model_name, self.model_path):
                bad("lora_paths", f"adapter name {name!r} is the served model's name or has a ':'")
            names.append(name)
        if len(set(names)) != len(names):
            bad("lora_paths", f"adapter names repeat: {sorted(names)}")
        if self.max_loaded_loras is not None and len(names) > self.max_loaded_loras:
            bad("lora_paths", f"{len(names)} adapters, more than --max-loaded-loras ({self.max_loaded_loras})")
        if not self.enable_lora and self.lora_paths:
            bad("lora_paths", "needs --enable-lora")

    def lora_adapters(self) -> dict[str, str]:
        """``--lora-paths`` as name -> path."""
        return dict(entry.partition("=")[::2] for entry in self.lora_paths)

    def _validate_parallel(self, bad: Callable[[str, str], None]) -> None:
        if self.tp_size < 1:
            bad("tp_size", f"must be >= 1, got {self.tp_size}")
        if self.nnodes < 1:
            bad("nnodes", f"must be >= 1, got {self.nnodes}")
        if self.tp_size % self.nnodes:
            bad(
                "nnodes",
                f"must divide tp_size ({self.tp_size}) so that every node runs as many ranks, got {self.nnodes}",
            )
        if not 0 <= self.node_rank < self.nnodes:
            bad("node_rank", f"must be in [0, nnodes) = [0, {self.nnodes}), got {self.node_rank}")
        if self.nnodes > 1 and self.dist_init_addr is None:
            bad("dist_init_addr", "is required with --nnodes > 1: host:port of node 0, where every node's ranks meet")
        if self.dist_init_addr is not None:
            host, _, port = self.dist_init_addr.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) <= 65535:
                bad("dist_init_addr", f"must be host:port with a port in [1, 65535], got {self.dist_init_addr!r}")
        if self.dist_timeout <= 0:
            bad("dist_timeout", f"must be > 0 seconds, got {self.dist_timeout}")
        if self.dp_size < 1:
            bad("dp_size", f"must be >= 1, got {self.dp_size}")
        if self.dp_size > 1 and self.nnodes > 1:
            bad("dp_size", "replicas over several nodes are not built yet: with --nnodes > 1, --dp-size must be 1")
        if self.disaggregation_mode != "null" and (self.dp_size > 1 or self.nnodes > 1):
            bad(
                "disaggregation_mode",
                "a prefill or decode worker with --dp-size or --nnodes above 1 is not built yet (--tp-size is)",
            )
        if not 0 < self.disaggregation_bootstrap_port <= 65535:
            bad("disaggregation_bootstrap_port", f"must be in [1, 65535], got {self.disaggregation_bootstrap_port}")
        if self.disaggregation_timeout_secs <= 0:
            bad("disaggregation_timeout_secs", f"must be > 0 seconds, got {self.disaggregation_timeout_secs}")
        problem = policy_error(self.load_balance_method, "dp")
        if problem is not None:
            bad("load_balance_method", problem)

    @property
    def dist_init_host_port(self) -> tuple[str, int]:
        """``--dist-init-addr`` split into host and port (the brackets of an IPv6 host removed)."""
        host, _, port = (self.dist_init_addr or "").rpartition(":")
        return host.strip("[]"), int(port)

    @property
    def ranks_per_node(self) -> int:
        return self.tp_size // self.nnodes

    @property
    def chunk_size(self) -> int | None:
        """Effective prefill chunk size, None when chunking is off."""
        if self.chunked_prefill_size in (None, -1):
            return None
        return self.chunked_prefill_size

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> ServerArgs:
        unknown = set(kwargs) - cls.field_names()
        if unknown:
            raise TypeError(f"unknown server argument(s): {sorted(unknown)}")
        return cls(**kwargs)
