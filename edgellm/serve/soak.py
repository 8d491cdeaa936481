"""Soak and load test for `edgellm serve` (a script, not a unit test).

    python -m edgellm.serve.soak --model smollm2-135m --clients 8 --minutes 5

Starts `edgellm serve` on a free loopback port (or uses `--url`), then runs N client threads for M minutes (or until
`--max-requests`), each sending a random mix of plain, streaming and JSON-schema chat requests with the official
`openai` client, streams it drops after the first chunk, oversize bodies and over-limit requests with httpx. It
watches /health every second and the server's RSS every few seconds, and prints a Markdown report: requests served,
p50/p99 latency per kind, 429s, errors by class, RSS at start and end against a stated growth bound. The exit status
is 1 when any request got a 5xx or failed unexpectedly, /health was not green throughout, or RSS grew past the bound.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from openai.types.chat import ChatCompletionMessageParam

KINDS = ("plain", "stream", "schema", "disconnect", "oversize", "over_limit")
WEIGHTS = (30, 25, 20, 10, 8, 7)
SHED = (429, 408)  # answers that mean "busy": the queue is full, or the request outlived --timeout
PROMPTS = ["What is the capital of France?", "Name three colours.", "Write a haiku about the sea.",
           "What is 12 times 7?", "Give me a fun fact about cats."]
CITY: dict[str, Any] = {"type": "object", "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
                        "required": ["city", "country"]}


@dataclass
class Tally:
    """What the clients saw, shared by the threads (guarded by `lock`)."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    latencies: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    outcomes: Counter[str] = field(default_factory=Counter)
    failures: Counter[str] = field(default_factory=Counter)

    def record(self, kind: str, outcome: str, seconds: float, *, failure: str | None = None) -> None:
        with self.lock:
            self.outcomes[f"{kind}: {outcome}"] += 1
            if outcome == "ok":
                self.latencies[kind].append(seconds)
            if failure:
                self.failures[failure] += 1


def rss_mib(pid: int) -> float | None:
    """Resident set size of process `pid` in MiB (Linux /proc), or None where it cannot be read."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_server(model: str, port: int, max_queue: int, timeout_s: float, log: Path) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "edgellm.cli", "serve", model, "--port", str(port), "--max-queue", str(max_queue),
           "--timeout", str(timeout_s)]
    with log.open("wb") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


def wait_healthy(url: str, timeout_s: float,
                 proc: subprocess.Popen[bytes] | subprocess.Popen[str] | None) -> None:
    """Return once `url`/health answers 200; SystemExit if `proc` exits first or `timeout_s` passes."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise SystemExit(f"the server exited with status {proc.returncode} before it was ready")
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"the server at {url} was not healthy within {timeout_s:.0f} s")


class Client:
    """One simulated user: a loop of random requests until the shared deadline or request budget runs out."""

    def __init__(self, url: str, model: str, tally: Tally, rng: random.Random, max_tokens: int,
                 timeout_s: float) -> None:
        import httpx
        import openai

        self.url, self.model, self.tally, self.rng, self.max_tokens = url, model, tally, rng, max_tokens
        self.openai = openai
        # the client waits longer than the server's --timeout, so a slow request ends as the server's 408
        self.api = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=timeout_s + 60)
        self.http = httpx.Client(timeout=timeout_s + 60)

    def messages(self) -> list[ChatCompletionMessageParam]:
        return [{"role": "user", "content": self.rng.choice(PROMPTS)}]

    def plain(self) -> None:
        r = self.api.chat.completions.create(model=self.model, messages=self.messages(), max_tokens=self.max_tokens)
        assert r.choices[0].message.content is not None

    def stream(self) -> None:
        chunks = self.api.chat.completions.create(model=self.model, messages=self.messages(),
                                                  max_tokens=self.max_tokens, stream=True,
                                                  stream_options={"include_usage": True})
        usage = [c.usage for c in chunks if c.usage is not None]
        assert usage, "no usage chunk at the end of the stream"

    def schema(self) -> None:
        r = self.api.chat.completions.create(
            model=self.model, messages=[{"role": "user", "content": "Which city is the capital of France?"}],
            max_tokens=40, temperature=0,
            response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}})
        if r.choices[0].finish_reason == "stop":
            json.loads(r.choices[0].message.content or "")

    def disconnect(self) -> None:
        body = {"model": self.model, "messages": self.messages(), "max_tokens": 200, "stream": True}
        with self.http.stream("POST", self.url + "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                raise _Status(r.status_code)
            for _ in r.iter_lines():
                break  # drop the connection after the first event

    def oversize(self) -> None:
        body = {"model": self.model, "messages": [{"role": "user", "content": "x" * (2 << 20)}]}
        r = self.http.post(self.url + "/v1/chat/completions", json=body)
        if r.status_code != 413:
            raise _Status(r.status_code)

    def over_limit(self) -> None:
        r = self.http.post(self.url + "/v1/chat/completions",
                           json={"model": self.model, "messages": self.messages(), "seed": 2**70})
        if r.status_code != 400 or "seed" not in r.text:
            raise _Status(r.status_code)

    def run(self, stop: Callable[[], bool]) -> None:
        actions = {kind: getattr(self, kind) for kind in KINDS}
        while not stop():
            kind = self.rng.choices(KINDS, WEIGHTS)[0]
            t0 = time.perf_counter()
            try:
                actions[kind]()
                self.tally.record(kind, "ok", time.perf_counter() - t0)
            except _Status as exc:
                self._status(kind, exc.status)
            except self.openai.APIStatusError as exc:
                self._status(kind, exc.status_code)
            except self.openai.APIConnectionError as exc:  # a client-side timeout or a dropped connection
                self.tally.record(kind, type(exc).__name__, 0.0, failure=f"{kind}: {type(exc).__name__}")
            except self.openai.APIError as exc:  # an error event inside a stream
                code = exc.body.get("code") if isinstance(exc.body, dict) else None
                self._status(kind, 408 if code == "timeout" else 0)
            except Exception as exc:  # noqa: BLE001 - every failure is counted by class
                self.tally.record(kind, type(exc).__name__, 0.0, failure=f"{kind}: {type(exc).__name__}")
        self.http.close()

    def _status(self, kind: str, status: int) -> None:
        """429 (queue full) and 408 (past --timeout) are the server shedding load as documented; others fail."""
        if status in SHED:
            self.tally.record(kind, str(status), 0.0)
            time.sleep(1.0)  # a client backs off before it retries
        else:
            self.tally.record(kind, f"HTTP {status}", 0.0, failure=f"{kind}: HTTP {status}")


class _Status(Exception):
    def __init__(self, status: int) -> None:
        super().__init__(f"HTTP {status}")
        self.status = status


def percentile(values: list[float], q: float) -> float:
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


def report(tally: Tally, args: argparse.Namespace, elapsed_s: float, rss: list[float], health: Counter[str],
           load: tuple[tuple[float, ...], tuple[float, ...]], growth_bound: float) -> tuple[str, bool]:
    lines = [f"`python -m edgellm.serve.soak --model {args.model} --clients {args.clients} --minutes {args.minutes:g}`"
             f" — {elapsed_s / 60:.1f} min, load average at start {load[0][0]:.1f} / end {load[1][0]:.1f} "
             f"on {os.cpu_count()} cores", "",
             "| kind | served | p50 s | p99 s | other outcomes |", "|---|---|---|---|---|"]
    for kind in KINDS:
        done = tally.latencies.get(kind, [])
        other = ", ".join(f"{k.split(': ', 1)[1]} × {v}" for k, v in sorted(tally.outcomes.items())
                          if k.startswith(kind + ": ") and not k.endswith(": ok"))
        p50 = f"{percentile(done, 50):.2f}" if done else "-"
        p99 = f"{percentile(done, 99):.2f}" if done else "-"
        lines.append(f"| {kind} | {len(done)} | {p50} | {p99} | {other or '-'} |")
    everything = [s for kind in KINDS for s in tally.latencies.get(kind, [])]
    shed = {code: sum(v for k, v in tally.outcomes.items() if k.endswith(f": {code}")) for code in SHED}
    lines.append(f"| **all** | {len(everything)} | {percentile(everything, 50) if everything else 0:.2f} | "
                 f"{percentile(everything, 99) if everything else 0:.2f} | "
                 + ", ".join(f"{code} × {n}" for code, n in shed.items()) + " |")
    grew = (rss[-1] - rss[0]) if len(rss) >= 2 else 0.0
    ok_health = health["200"] == sum(health.values())
    lines += ["",
              f"- errors by class: {dict(tally.failures) or 'none'}",
              f"- /health: {health['200']}/{sum(health.values())} checks answered 200",
              f"- server RSS: {rss[0]:.0f} MiB at start, {rss[-1]:.0f} MiB at end, peak {max(rss):.0f} MiB "
              f"(growth {grew:+.0f} MiB; bound {growth_bound:.0f} MiB)" if rss else "- server RSS: not measured"]
    passed = not tally.failures and ok_health and grew <= growth_bound
    lines.append(f"- verdict: {'PASS' if passed else 'FAIL'}")
    return "\n".join(lines), passed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m edgellm.serve.soak", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m", help="what `edgellm serve` serves (default smollm2-135m)")
    p.add_argument("--url", default=None, help="use a running server instead of starting one")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--minutes", type=float, default=5.0)
    p.add_argument("--max-requests", type=int, default=5000, help="stop after this many requests in all")
    p.add_argument("--max-tokens", type=int, default=16, help="max_tokens of plain and streaming requests")
    p.add_argument("--max-queue", type=int, default=8, help="the server's --max-queue when it is started here")
    p.add_argument("--timeout", type=float, default=300.0, help="the server's --timeout when it is started here")
    p.add_argument("--rss-growth-mib", type=float, default=64.0, help="allowed RSS growth, start to end")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log", type=Path, default=Path("soak-server.log"), help="the started server's output")
    args = p.parse_args(argv)

    proc = None
    url = args.url
    if url is None:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        proc = start_server(args.model, port, args.max_queue, args.timeout, args.log)
    try:
        wait_healthy(url, 600, proc)
        import httpx

        health: Counter[str] = Counter()
        rss: list[float] = []
        done = threading.Event()
        served = Tally()
        budget = {"left": args.max_requests}
        budget_lock = threading.Lock()

        def stop() -> bool:
            with budget_lock:
                budget["left"] -= 1
                return done.is_set() or budget["left"] < 0

        def watch() -> None:
            ticks = 0
            while not done.is_set():
                try:
                    health[str(httpx.get(url + "/health", timeout=10).status_code)] += 1
                except httpx.HTTPError as exc:
                    health[type(exc).__name__] += 1
                if proc is not None and ticks % 5 == 0 and (m := rss_mib(proc.pid)) is not None:
                    rss.append(m)
                ticks += 1
                done.wait(1.0)

        rng = random.Random(args.seed)
        clients = [Client(url, args.model, served, random.Random(rng.random()), args.max_tokens, args.timeout)
                   for _ in range(args.clients)]
        for kind in KINDS:  # one of each first: grammar compiler, KV cache and pools exist before RSS is taken
            getattr(clients[0], kind)()
        if proc is not None and (m := rss_mib(proc.pid)) is not None:
            rss.append(m)
        load_start = os.getloadavg()
        t0 = time.monotonic()
        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        threads = [threading.Thread(target=c.run, args=(stop,), daemon=True) for c in clients]
        for t in threads:
            t.start()
        deadline = t0 + args.minutes * 60
        while time.monotonic() < deadline and any(t.is_alive() for t in threads):
            time.sleep(0.5)
        done.set()
        for t in threads:
            t.join(timeout=300)
        watcher.join(timeout=30)
        if proc is not None and (m := rss_mib(proc.pid)) is not None:
            rss.append(m)
        text, passed = report(served, args, time.monotonic() - t0, rss, health, (load_start, os.getloadavg()),
                              args.rss_growth_mib)
        print(text)
        return 0 if passed else 1
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()


if __name__ == "__main__":
    sys.exit(main())
