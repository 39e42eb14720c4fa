"""Per-request latency of a running server over a kept-alive connection vs a fresh one.

    radixserve serve --port 0          # prints "radixserve ready at URL"
    python benchmarks/bench_http_latency.py --url URL
    python benchmarks/bench_http_latency.py --url URL --health 200 --chat 50 --model radixserve-demo

Four medians, in ms: ``GET /health`` through an ``httpx.Client`` and a one-token
chat completion (the TTFT floor: one prefill, one token) through the official
``openai`` client on that ``httpx.Client``; first with keep-alive (every request
on the same connection, as the clients do by default), then with a new
connection per request. Each series starts after a warm-up request.
"""

from __future__ import annotations

import argparse

import httpx
import openai

from radixserve.bench.metrics import median_call_ms

# Every request opens its own connection (httpx closes it after the response).
NO_KEEPALIVE = httpx.Limits(max_keepalive_connections=0)


def one_token_chat(client: openai.OpenAI, model: str) -> None:
    client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", required=True, help="the server, e.g. http://127.0.0.1:30000")
    parser.add_argument("--model", default="radixserve-demo")
    parser.add_argument("--api-key", default="unused")
    parser.add_argument("--health", type=int, default=50, help="GET /health requests per series")
    parser.add_argument("--chat", type=int, default=20, help="one-token chat completions per series")
    args = parser.parse_args()

    for label, limits in (("keep-alive", httpx.Limits()), ("fresh connection", NO_KEEPALIVE)):
        with httpx.Client(base_url=args.url, limits=limits) as http:
            health = median_call_ms(lambda: http.get("/health").raise_for_status(), args.health)
            client = openai.OpenAI(base_url=args.url + "/v1", api_key=args.api_key, max_retries=0, http_client=http)
            chat = median_call_ms(lambda: one_token_chat(client, args.model), args.chat)
        print(
            f"{label:16}  GET /health {health:6.2f} ms (median of {args.health})   "
            f"1-token chat via openai {chat:6.2f} ms (median of {args.chat})"
        )


if __name__ == "__main__":
    main()
