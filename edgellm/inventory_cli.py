"""CLI verbs for what is on this machine: `list` (on disk, with sizes), `ps` (loaded by running servers), `rm`."""

from __future__ import annotations

import argparse
import json
import sys
import time
from datetime import datetime


def _size(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _ago(unix: float) -> str:
    return datetime.fromtimestamp(unix).strftime("%Y-%m-%d %H:%M")


def cmd_list(args: argparse.Namespace) -> int:
    from edgellm.inventory import KIND_HELP, local_models

    models = local_models()
    if args.json:
        print(json.dumps([{"name": m.name, "kind": m.kind, "path": str(m.path), "size_bytes": m.size_bytes,
                           "modified": m.modified, "scheme": m.scheme, "architecture": m.architecture,
                           "current": m.current} for m in models], indent=2))
        return 0
    if not models:
        print("No local models; `edgellm pull NAME` or `edgellm run NAME` fetches one", file=sys.stderr)
        return 0
    width = max(len(m.name) for m in models)
    print(f"{'NAME':<{width}}  {'KIND':<8}  {'SCHEME':<10}  {'SIZE':>10}  MODIFIED")
    for m in models:
        kind = m.kind + ("*" if m.current else "")
        print(f"{m.name:<{width}}  {kind:<8}  {m.scheme or '-':<10}  {_size(m.size_bytes):>10}  {_ago(m.modified)}")
    total = sum(m.size_bytes for m in models)
    kinds = "; ".join(f"{k}: {v}" for k, v in KIND_HELP.items())
    print(f"{len(models)} entries, {_size(total)} in all ({kinds}; * the current store version)", file=sys.stderr)
    return 0


def _until(expires_at: float | None) -> str:
    if expires_at is None:
        return "until the server stops"
    left = expires_at - time.time()
    at = datetime.fromtimestamp(expires_at).strftime("%H:%M:%S")
    return f"until {at} (idle unload in {max(0, round(left))} s)" if left > 0 else f"unloading (was due {at})"


def cmd_ps(args: argparse.Namespace) -> int:
    from edgellm import leases

    held = leases.live()
    if args.json:
        print(json.dumps([{"model": h.model, "pid": h.pid, "folder": h.folder, "size_bytes": h.size_bytes,
                           "expires_at": h.expires_at} for h in held], indent=2))
        return 0
    if not held:
        print("No models loaded by a running `edgellm serve`", file=sys.stderr)
        return 0
    width = max(len(h.model) for h in held)
    print(f"{'MODEL':<{width}}  {'PID':>7}  {'SIZE':>10}  LOADED")
    for h in held:
        print(f"{h.model:<{width}}  {h.pid:>7}  {_size(h.size_bytes):>10}  {_until(h.expires_at)}")
    return 0


def cmd_rm(args: argparse.Namespace) -> int:
    from edgellm.inventory import remove

    for name in args.names:
        for model in remove(name, sources=args.sources):
            print(f"removed {model.name} ({model.kind}, {_size(model.size_bytes)}): {model.path}", file=sys.stderr)
    return 0


def add_inventory_parsers(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("list", help="models on this machine: compiled artifacts, stored versions, pulled sources "
                                    "and downloads, with sizes", parents=[common])
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_list)
    p = sub.add_parser("ps", help="models loaded by running `edgellm serve` processes, and until when",
                       parents=[common])
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_ps)
    p = sub.add_parser("rm", help="delete a model from disk, by the name `edgellm list` shows (refused while a "
                                  "running server holds it)", parents=[common])
    p.add_argument("names", nargs="+", metavar="NAME", help="NAME, NAME:SCHEME, NAME@VERSION or an artifact path")
    p.add_argument("--sources", action="store_true",
                   help="also delete a catalog model's pulled source file and downloaded wheels (the next use "
                        "downloads again)")
    p.set_defaults(func=cmd_rm)
