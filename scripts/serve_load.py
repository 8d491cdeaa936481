"""Load an OpenAI-compatible server with concurrent streamed chat requests; report aggregate tok/s and TTFT.

Works against any server that speaks /v1/chat/completions with server-sent events (edgellm serve, llama.cpp's
llama-server, ...). For each client count, that many clients each send `--requests` streamed chat requests one after
another (a different prompt each); the report gives the streamed completion tokens of all of them over the wall time
from the first request's start to the last one's end, and the time to first token's p50 and p90 over the requests.

    python scripts/serve_load.py --base http://127.0.0.1:8000 --model smollm2-135m --clients 1 4 8 --ban-token 2

`--ban-token ID` (repeatable) sends `logit_bias {ID: -100}` so replies run to `--max-tokens` on every server (the
chat template's end-of-turn token: 2 for SmolLM2, 151645 and 151643 for Qwen2.5). Only the standard library is used.
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

TOPICS = ["a lighthouse keeper", "a lost robot", "the first rain on Mars", "a baker at midnight", "a chess match",
          "an old map", "a city of bridges", "a quiet library", "a river that runs uphill", "a winter garden",
          "a clockmaker's apprentice", "the last train home", "a kite festival", "a ship in a bottle",
          "a forgotten song", "a desert observatory"]


@dataclass
class Reply:
    start: float
    first: float | None  # when the first content arrived
    end: float
    tokens: int


def _stream(base: str, model: str, prompt: str, max_tokens: int, ban: list[int], timeout: float) -> Reply:
    """One streamed chat request; its timings and completion tokens (the usage chunk's count where the server
    sends one, else the content chunks)."""
    url = urlsplit(base)
    conn = http.client.HTTPConnection(url.hostname or "127.0.0.1", url.port or 80, timeout=timeout)
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "stream": True,
            "max_tokens": max_tokens, "temperature": 0, "stream_options": {"include_usage": True}}
    if ban:
        body["logit_bias"] = {str(token): -100 for token in ban}
    start = time.perf_counter()
    conn.request("POST", url.path.rstrip("/") + "/v1/chat/completions", json.dumps(body),
                 {"Content-Type": "application/json"})
    response = conn.getresponse()
    if response.status != 200:
        raise RuntimeError(f"HTTP {response.status}: {response.read(500)!r}")
    first, chunks, usage = None, 0, None
    for raw in response:
        line = raw.decode("utf-8").strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        data = json.loads(line[6:])
        if data.get("usage"):
            usage = data["usage"].get("completion_tokens")
        for choice in data.get("choices") or []:
            if (choice.get("delta") or {}).get("content"):
                chunks += 1
                if first is None:
                    first = time.perf_counter()
    end = time.perf_counter()
    conn.close()
    return Reply(start, first, end, usage if usage is not None else chunks)


def run_load(base: str, model: str, clients: int, requests: int, max_tokens: int, ban: list[int],
             timeout: float) -> dict[str, float]:
    """`clients` threads, `requests` each, one after another; the aggregate numbers."""
    replies: list[Reply] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def client(index: int) -> None:
        for r in range(requests):
            topic = TOPICS[(index * requests + r) % len(TOPICS)]
            try:
                reply = _stream(base, model, f"Write a long story about {topic}.", max_tokens, ban, timeout)
            except BaseException as exc:  # noqa: BLE001 - reported after the run
                with lock:
                    errors.append(exc)
                return
            with lock:
                replies.append(reply)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed, the first: {errors[0]}")
    wall = max(r.end for r in replies) - min(r.start for r in replies)
    ttfts = sorted(r.first - r.start for r in replies if r.first is not None)
    tokens = sum(r.tokens for r in replies)
    return {"clients": clients, "requests": len(replies), "tokens": tokens, "wall_s": wall,
            "tok_per_s": tokens / wall, "ttft_p50_s": statistics.median(ttfts),
            "ttft_p90_s": ttfts[min(len(ttfts) - 1, int(0.9 * len(ttfts)))]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default="http://127.0.0.1:8000", help="the server's base URL")
    parser.add_argument("--model", required=True, help="the model name requests carry")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4, 8], help="client counts to run")
    parser.add_argument("--requests", type=int, default=2, help="requests per client, one after another")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--ban-token", type=int, action="append", default=[], metavar="ID",
                        help="a token the replies may not use (logit_bias -100), e.g. the end-of-turn token")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take")
    parser.add_argument("--label", default="", help="printed in front of each result line")
    parser.add_argument("--json", action="store_true", help="one JSON object per line instead of text")
    args = parser.parse_args(argv)
    if any(c < 1 for c in args.clients) or args.requests < 1 or args.max_tokens < 1:
        parser.error("--clients, --requests and --max-tokens must be positive")
    try:
        _stream(args.base, args.model, "Say hello.", 8, [], args.timeout)  # warm-up: the model is loaded
        for clients in args.clients:
            result = run_load(args.base, args.model, clients, args.requests, args.max_tokens, args.ban_token,
                              args.timeout)
            if args.json:
                print(json.dumps({"label": args.label, **result}), flush=True)
            else:
                print(f"{args.label}{clients} clients: {result['tok_per_s']:.1f} tok/s aggregate "
                      f"({result['tokens']} tokens in {result['wall_s']:.1f} s), TTFT p50 {result['ttft_p50_s']:.2f} s "
                      f"p90 {result['ttft_p90_s']:.2f} s", flush=True)
    except (OSError, RuntimeError) as exc:
        print(f"serve_load: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
