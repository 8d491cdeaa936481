"""One backend in its own process: `python -m edgellm.bench.worker`, driven by JSON lines on stdin.

A process per backend configuration gives each its own cold load and its own peak resident memory,
and keeps one backend's thread pool from competing with another's while the runner alternates them.
Replies are JSON lines on the original stdout; anything native code prints goes to stderr.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any, TextIO

from edgellm.bench.backends import HISTORY_TEXT, PROMPT_TEXT, Backend, make_backend
from edgellm.bench.system import current_rss_bytes, peak_rss_bytes


class Worker:
    """State of one worker: its backend and the fixed prompt/history token ids."""

    def __init__(self) -> None:
        self.backend: Backend | None = None
        self.prompt: list[int] = []
        self.history: list[int] = []

    def handle(self, msg: dict[str, Any]) -> dict[str, Any]:
        op = msg["op"]
        if op == "init":
            self.backend = make_backend(msg["backend"], Path(msg["location"]), msg["threads"], msg["n_ctx"])
            return {}
        backend = self.backend
        if backend is None:
            raise RuntimeError("worker not initialised")
        if op == "load":
            seconds = backend.load()
            return {"load_s": seconds, "rss_bytes": current_rss_bytes()}
        if op == "prepare":
            self.prompt = backend.tokens(PROMPT_TEXT, msg["prompt_tokens"])
            self.history = backend.tokens(HISTORY_TEXT, msg["depth"]) if msg["depth"] else []
            return {"prompt_ids": self.prompt[:8], "prompt_tokens": len(self.prompt), "depth": len(self.history)}
        if op == "run":
            return {"sample": backend.run(self.prompt, msg["gen"], self.history, msg.get("schema")).as_dict()}
        if op == "breakdown":
            return {"breakdown": backend.breakdown(msg["prompt_tokens"], msg["gen"])}
        if op == "memory":  # the size now first: reading it may import psutil, which the peak must include
            rss = current_rss_bytes()
            return {"peak_rss_bytes": peak_rss_bytes(), "rss_bytes": rss}
        raise RuntimeError(f"unknown op {op!r}")


def serve(inp: TextIO, out: TextIO) -> None:
    worker = Worker()
    for line in inp:
        msg = json.loads(line)
        if msg["op"] == "quit":
            break
        try:
            reply = {"ok": True, **worker.handle(msg)}
        except Exception as exc:  # noqa: BLE001 - the runner reports it with the worker's configuration
            reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
        out.write(json.dumps(reply) + "\n")
        out.flush()
    if worker.backend is not None:
        worker.backend.close()


def main() -> None:
    protocol = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)  # stray prints (Python or native) must not corrupt the protocol
    sys.stdout = sys.stderr
    serve(sys.stdin, protocol)


if __name__ == "__main__":
    main()
