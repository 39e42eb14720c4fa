"""RouterArgs: every flag of ``radixserve router``, spelled as SGLang's gateway spells them
where it has the same setting (``--worker-urls``, ``--policy``, ``--cache-threshold``,
``--retry-max-retries``, ``--cb-failure-threshold``, ``--max-concurrent-requests``, ...)."""

from __future__ import annotations

from dataclasses import dataclass

from radixserve.cli_args import CliArgs, flag
from radixserve.load_balance import RouterPolicy, describe, policy_error


@dataclass
class RouterArgs(CliArgs):
    worker_urls: list[str] = flag(
        "worker base URLs (http://host:port); more can be added at runtime with POST /workers", default=[]
    )
    policy: RouterPolicy = flag(
        "how a worker is chosen (the names a worker's --load-balance-method takes mean the same here; ties go "
        "in turn): " + describe("router"),
        default="latency_aware",
    )
    # prefill/decode disaggregation (SGLang's gateway spelling)
    pd_disaggregation: bool = flag(
        "pair a prefill worker and a decode worker for each generation request (their --disaggregation-mode)",
        default=False,
    )
    prefill: list[list[str]] = flag(
        "a prefill worker: URL [BOOTSTRAP_PORT] (unset port: the one the worker reports)", default=[]
    )
    decode: list[str] = flag("a decode worker's URL", default=[], repeat=True)
    prefill_policy: RouterPolicy | None = flag(
        "how the prefill worker of a pair is chosen (unset: --policy)", default=None
    )
    decode_policy: RouterPolicy | None = flag(
        "how the decode worker of a pair is chosen (unset: --policy)", default=None
    )
    host: str = flag("HTTP host", default="127.0.0.1")
    port: int = flag("HTTP port (0 picks a free one)", default=30000)
    api_key: str | None = flag("require this bearer token on the inference routes", default=None)
    admin_api_key: str | None = flag(
        "bearer token for /workers and /flush_cache (unset: --api-key opens them too)", default=None
    )
    worker_api_key: str | None = flag("bearer token the router sends to the workers (their --api-key)", default=None)
    worker_admin_api_key: str | None = flag(
        "bearer token the router sends to the workers' admin routes, e.g. /flush_cache (their --admin-api-key; "
        "unset: --worker-api-key)",
        default=None,
    )
    # cache-aware routing
    cache_threshold: float = flag(
        "cache_aware: route to the longest prefix match when it covers at least this fraction of the request",
        default=0.3,
    )
    balance_abs_threshold: int = flag(
        "cache_aware: the load is imbalanced when the busiest and idlest workers differ by more than this many "
        "requests ...",
        default=32,
    )
    balance_rel_threshold: float = flag("... and the busiest has more than this times the idlest's", default=1.5)
    max_tree_size: int = flag(
        "characters of routed prompts remembered per worker (least recent forgotten)", default=1 << 24
    )
    max_tree_total_chars: int = flag(
        "characters of routed prompts remembered for all workers together: past it, the worker remembered "
        "with the most is cut to its equal share (keeps the tree bounded as the fleet grows)",
        default=1 << 27,
    )
    decision_log_size: int = flag(
        "latency_aware: the last decisions kept, with every candidate's score terms, for GET /debug/decisions "
        "(0: none)",
        default=256,
    )
    # reliability
    retry_max_retries: int = flag(
        "tries on other workers after a connection error or a retryable status, before the first byte", default=3
    )
    retry_initial_backoff_ms: int = flag("backoff before the first retry", default=50)
    retry_max_backoff_ms: int = flag("longest backoff", default=2000)
    retry_backoff_multiplier: float = flag("backoff growth per retry", default=2.0)
    retry_jitter_factor: float = flag("random fraction added to or taken from each backoff", default=0.2)
    cb_failure_threshold: int = flag("consecutive failures that open a worker's circuit breaker", default=5)
    cb_success_threshold: int = flag("successes in half-open that close it again", default=1)
    cb_timeout_duration_secs: float = flag("seconds an open breaker waits before it lets one request try", default=10.0)
    health_check_interval_secs: float = flag("seconds between health checks of each worker", default=5.0)
    health_check_timeout_secs: float = flag("a health check slower than this fails", default=5.0)
    health_failure_threshold: int = flag("failed health checks that mark a worker unhealthy", default=2)
    health_success_threshold: int = flag("passed health checks that mark it healthy again", default=1)
    load_poll_interval_secs: float = flag("seconds between reads of each worker's /get_load", default=1.0)
    request_timeout_secs: float = flag("a request to a worker that takes longer fails", default=1800.0)
    # admission
    max_concurrent_requests: int = flag(
        "requests the router forwards at once (-1: no limit); more wait in a queue", default=-1
    )
    rate_limit_tokens_per_second: float | None = flag(
        "token bucket: requests admitted per second on average, bursts up to --max-concurrent-requests "
        "(unset: no rate limit)",
        default=None,
    )
    queue_size: int = flag("requests that may wait for admission; beyond it the answer is 429", default=100)
    queue_timeout_secs: float = flag("a request waiting longer for admission gets 408", default=60.0)
    max_payload_size: int = flag("max request body in bytes", default=32 * 1024 * 1024)
    shutdown_grace_period_secs: float = flag(
        "on SIGTERM, seconds the requests in flight get to finish while new ones are refused", default=30.0
    )
    keep_alive_timeout_secs: float = flag(
        "seconds an idle client connection stays open; longer than clients and load balancers keep theirs "
        "(httpx and the openai client: 5 s, Go's and Rust's reqwest: 90 s, an AWS ALB: 60 s), so that they "
        "close it first",
        default=120.0,
    )
    log_level: str = flag("logging level", default="info")

    def __post_init__(self) -> None:
        def bad(name: str, msg: str) -> None:
            raise ValueError(f"{name}: {msg}")

        self.worker_urls = [normalize_url(url) for url in self.worker_urls]
        for name in ("policy", "prefill_policy", "decode_policy"):
            value = getattr(self, name)
            problem = policy_error(value, "router") if value is not None else None
            if problem is not None:
                bad(name, problem)
        for entry in self.prefill:
            if len(entry) > 2 or (len(entry) == 2 and not (entry[1].isdigit() or entry[1] == "none")):
                bad("prefill", f"expected URL [BOOTSTRAP_PORT], got {' '.join(entry)!r}")
        self.prefill = [[normalize_url(entry[0]), *entry[1:]] for entry in self.prefill]
        self.decode = [normalize_url(url) for url in self.decode]
        if self.pd_disaggregation and not (self.prefill and self.decode):
            bad("pd_disaggregation", "needs at least one --prefill and one --decode worker")
        if not self.pd_disaggregation and (self.prefill or self.decode):
            bad("prefill" if self.prefill else "decode", "prefill and decode workers need --pd-disaggregation")
        if not 0 <= self.cache_threshold <= 1:
            bad("cache_threshold", f"must be in [0, 1], got {self.cache_threshold}")
        if not 0 <= self.port <= 65535:
            bad("port", f"must be in [0, 65535] (0 picks a free port), got {self.port}")
        if self.keep_alive_timeout_secs <= 0:
            bad("keep_alive_timeout_secs", f"must be > 0, got {self.keep_alive_timeout_secs}")
        if self.retry_max_retries < 0:
            bad("retry_max_retries", f"must be >= 0, got {self.retry_max_retries}")
        for name in ("cb_failure_threshold", "cb_success_threshold", "health_failure_threshold"):
            if getattr(self, name) < 1:
                bad(name, f"must be >= 1, got {getattr(self, name)}")
        if self.max_concurrent_requests == 0 or self.max_concurrent_requests < -1:
            bad("max_concurrent_requests", f"must be -1 (no limit) or >= 1, got {self.max_concurrent_requests}")
        if self.rate_limit_tokens_per_second is not None and self.rate_limit_tokens_per_second <= 0:
            bad("rate_limit_tokens_per_second", f"must be > 0, got {self.rate_limit_tokens_per_second}")
        if self.decision_log_size < 0:
            bad("decision_log_size", f"must be >= 0, got {self.decision_log_size}")
        if self.queue_size < 0:
            bad("queue_size", f"must be >= 0, got {self.queue_size}")

    @property
    def prefill_bootstrap_ports(self) -> dict[str, int | None]:
        """Each prefill worker's URL and its bootstrap port when given (None: as it reports)."""
        return {entry[0]: int(entry[1]) if len(entry) == 2 and entry[1] != "none" else None for entry in self.prefill}


def normalize_url(url: str) -> str:
    """``host:port`` or ``http://host:port/`` -> ``http://host:port``; a ValueError names a bad one."""
    url = url.strip().rstrip("/")
    if "://" not in url:
        url = "http://" + url
    scheme, _, rest = url.partition("://")
    if scheme not in ("http", "https") or not rest or "/" in rest:
        raise ValueError(f"worker_urls: {url!r} is not a worker base URL (http://host:port)")
    return url
