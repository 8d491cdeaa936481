"""Prometheus text exposition (format 0.0.4), written by hand: counters, gauges and histograms, thread-safe."""

from __future__ import annotations

import math
import threading
from typing import Callable

Labels = tuple[tuple[str, str], ...]

TTFT_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
RATE_BUCKETS = (5.0, 10.0, 25.0, 50.0, 75.0, 100.0, 150.0, 200.0, 300.0, 500.0)
ROW_BUCKETS = (1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0)
COUNTER_HELP = {
    "edgellm_routes_total": "Requests routed, by target (local or a remote) and the rule that chose it.",
    "edgellm_route_fallbacks_total": "Requests that fell back, by source, target and why.",
}


def _fmt(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value)) if value != int(value) else str(int(value))


def _labels(labels: Labels) -> str:
    if not labels:
        return ""
    escaped = (v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"') for _, v in labels)
    return "{" + ",".join(f'{k}="{v}"' for (k, _), v in zip(labels, escaped)) + "}"


class Metrics:
    """The server's metrics; `render()` gives the /metrics body."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._requests: dict[Labels, float] = {}
        self._prompt_tokens = 0
        self._completion_tokens = 0
        self._hist = {
            "edgellm_time_to_first_token_seconds": (TTFT_BUCKETS, [0] * len(TTFT_BUCKETS), [0.0, 0]),
            "edgellm_decode_tokens_per_second": (RATE_BUCKETS, [0] * len(RATE_BUCKETS), [0.0, 0]),
            "edgellm_decode_step_rows": (ROW_BUCKETS, [0] * len(ROW_BUCKETS), [0.0, 0]),
        }
        self._counters: dict[tuple[str, Labels], float] = {}
        self.queue_depth: Callable[[], int] = lambda: 0
        self.running: Callable[[], int] = lambda: 0

    def request(self, endpoint: str, status: int) -> None:
        key = (("endpoint", endpoint), ("status", str(status)))
        with self._lock:
            self._requests[key] = self._requests.get(key, 0) + 1

    def count(self, name: str, **labels: str) -> None:
        """Add one to the counter `name` (declared in COUNTER_HELP) with these labels."""
        if name not in COUNTER_HELP:
            raise KeyError(f"undeclared counter {name}")
        key = (name, tuple(sorted(labels.items())))
        with self._lock:
            self._counters[key] = self._counters.get(key, 0) + 1

    def tokens(self, prompt: int, completion: int) -> None:
        with self._lock:
            self._prompt_tokens += prompt
            self._completion_tokens += completion

    def observe(self, name: str, value: float) -> None:
        bounds, counts, total = self._hist[name]
        with self._lock:
            for i, bound in enumerate(bounds):
                if value <= bound:
                    counts[i] += 1
            total[0] += value
            total[1] += 1

    def render(self) -> str:
        out: list[str] = []

        def head(name: str, kind: str, help: str) -> None:
            out.append(f"# HELP {name} {help}")
            out.append(f"# TYPE {name} {kind}")

        with self._lock:
            head("edgellm_requests_total", "counter", "HTTP requests answered, by endpoint and status code.")
            for labels, value in sorted(self._requests.items()):
                out.append(f"edgellm_requests_total{_labels(labels)} {_fmt(value)}")
            head("edgellm_prompt_tokens_total", "counter", "Prompt tokens processed.")
            out.append(f"edgellm_prompt_tokens_total {self._prompt_tokens}")
            head("edgellm_completion_tokens_total", "counter", "Completion tokens generated.")
            out.append(f"edgellm_completion_tokens_total {self._completion_tokens}")
            for counter, help in COUNTER_HELP.items():
                head(counter, "counter", help)
                for (name, labels), value in sorted(self._counters.items()):
                    if name == counter:
                        out.append(f"{name}{_labels(labels)} {_fmt(value)}")
            helps = {"edgellm_time_to_first_token_seconds": "Request start to first token, seconds.",
                     "edgellm_decode_tokens_per_second": "Decode speed of each finished generation.",
                     "edgellm_decode_step_rows": "Sequences each decode step of the batch ran together."}
            for name, (bounds, counts, (total, count)) in self._hist.items():
                head(name, "histogram", helps[name])
                for bound, c in zip(bounds, counts):
                    out.append(f'{name}_bucket{{le="{_fmt(bound)}"}} {c}')
                out.append(f'{name}_bucket{{le="+Inf"}} {count}')
                out.append(f"{name}_sum {_fmt(total)}")
                out.append(f"{name}_count {count}")
        head("edgellm_queue_depth", "gauge", "Requests waiting for the engine.")
        out.append(f"edgellm_queue_depth {self.queue_depth()}")
        head("edgellm_requests_running", "gauge", "Sequences in the engine's batch (at most serve --parallel).")
        out.append(f"edgellm_requests_running {self.running()}")
        return "\n".join(out) + "\n"
