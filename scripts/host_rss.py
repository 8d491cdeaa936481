"""Resident memory of one `edgellm serve` process hosting two real models, as they load and unload.

Starts `edgellm serve FIRST` (its own model), asks it with the official `ollama` client for a short reply from
FIRST, then from SECOND (loaded on that request, `keep_alive` KEEP), waits until SECOND's keep-alive has run out
and /api/ps no longer lists it, then unloads FIRST with `keep_alive` 0. After each step it prints the server
process's VmRSS, RssAnon (heap: activations, KV caches, buffers) and RssFile (mapped files: weights, libraries)
from /proc/PID/status, as a markdown table.

    PYTHONPATH=. python scripts/host_rss.py [--first smollm2-135m] [--second qwen2.5-coder-0.5b] [--keep 10]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import ollama

from edgellm.serve.soak import free_port, wait_healthy

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
OPTIONS = {"num_predict": 8, "temperature": 0}


def status_mib(pid: int) -> dict[str, float]:
    """VmRSS, RssAnon and RssFile of process ``pid`` in MiB."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile"):
            out[key] = int(value.split()[0]) / 1024
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--first", default="smollm2-135m")
    parser.add_argument("--second", default="qwen2.5-coder-0.5b")
    parser.add_argument("--keep", type=float, default=10.0, help="the second model's keep_alive, seconds")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, "-m", "edgellm.cli", "serve", args.first, "--port", str(port),
                               "--threads", str(args.threads)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    rows: list[tuple[str, dict[str, float]]] = []
    try:
        wait_healthy(url, 600, server)
        client = ollama.Client(host=url, timeout=600)

        def record(what: str) -> None:
            time.sleep(1.0)  # let the reply's last frees land
            rows.append((what, status_mib(server.pid)))
            resident = ", ".join(m.model for m in client.ps().models) or "none"
            print(f"{what}: {rows[-1][1]} (resident: {resident})", file=sys.stderr, flush=True)

        record(f"ready: {args.first} loaded, no request yet")
        client.chat(model=args.first, messages=QUESTION, options=OPTIONS)
        record(f"after an 8-token reply from {args.first}")
        client.chat(model=args.second, messages=QUESTION, options=OPTIONS, keep_alive=args.keep)
        record(f"+ {args.second} loaded, after its 8-token reply (keep_alive {args.keep:g} s)")
        while args.second in [m.model for m in client.ps().models]:
            time.sleep(0.5)
        record(f"{args.second}'s keep-alive ran out: unloaded")
        client.chat(model=args.first, messages=[], keep_alive=0)  # Ollama's way to unload a model now
        record(f"{args.first} unloaded too (keep_alive 0): nothing resident")
    finally:
        server.terminate()
        server.wait(timeout=60)
    load = open("/proc/loadavg").read().split()[0]
    print(f"load average {load}\n\n| server process | RSS | anonymous | file-backed |\n|---|---|---|---|")
    previous = None
    for what, mib in rows:
        delta = f" ({mib['VmRSS'] - previous:+.0f})" if previous is not None else ""
        print(f"| {what} | {mib['VmRSS']:.0f} MiB{delta} | {mib['RssAnon']:.0f} MiB | {mib['RssFile']:.0f} MiB |")
        previous = mib["VmRSS"]
    return 0


if __name__ == "__main__":
    sys.exit(main())
