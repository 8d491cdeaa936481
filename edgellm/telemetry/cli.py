"""`edgellm telemetry enable|disable|status|report|export`."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any


def cmd_telemetry(args: argparse.Namespace) -> int:
    from edgellm.telemetry import sink
    from edgellm.telemetry.settings import load_settings, save_settings

    settings = load_settings()
    action = args.telemetry_command
    if action in ("enable", "disable"):
        changes: dict[str, Any] = {"enabled": action == "enable"}
        for key in ("sample_rate", "level", "max_db_mib"):
            if getattr(args, key, None) is not None:
                changes[key] = getattr(args, key)
        settings = save_settings(replace(settings, **changes))
    if action in ("enable", "disable", "status"):
        state = {**asdict(settings), **sink.stats(), "database": str(sink.db_path())}
        if getattr(args, "json", False):
            print(json.dumps(state, indent=2))
        else:
            print(f"telemetry {'on' if settings.enabled else 'off'}: level {settings.level}, sample rate "
                  f"{settings.sample_rate:g}, cap {settings.max_db_mib:g} MiB; {state['events']} events "
                  f"({state['pending_upload']} not uploaded) in {state['database']}")
        return 0
    if action == "report":
        return _report(args)
    return _export(args)


def _since(args: argparse.Namespace) -> float | None:
    from edgellm.telemetry.report import parse_since

    return parse_since(args.since) if args.since else None


def _report(args: argparse.Namespace) -> int:
    from edgellm.telemetry import sink
    from edgellm.telemetry.report import format_table, summarize, write_png

    rows = summarize(sink.query(_since(args)))
    if args.json:
        print(json.dumps(rows, indent=2))
    elif rows:
        print(format_table(rows))
    else:
        print("no telemetry events" + (f" since {args.since}" if args.since else "")
              + "; `edgellm telemetry enable` starts recording")
    if args.png and rows:
        print(f"wrote {write_png(rows, Path(args.png))}", file=sys.stderr)
    return 0


def _export(args: argparse.Namespace) -> int:
    from edgellm.telemetry.otlp import export_lines, upload

    if args.endpoint:
        sent, pending = upload(args.endpoint, batch=args.batch)
        print(f"uploaded {sent} events to {args.endpoint}" + (f"; {pending} stay queued for the next run" if pending else ""))
        return 1 if pending else 0
    if args.output in (None, "-"):
        export_lines(sys.stdout, _since(args), args.batch)
        return 0
    with open(args.output, "w", encoding="utf-8") as out:
        n = export_lines(out, _since(args), args.batch)
    print(f"wrote {n} events to {args.output}", file=sys.stderr)
    return 0


def add_telemetry_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    def verb(parent: Any, name: str, help: str) -> argparse.ArgumentParser:
        q = parent.add_parser(name, help=help, description=help, parents=[common])
        q.set_defaults(func=cmd_telemetry)
        return q

    p = verb(sub, "telemetry", "private, metadata-only usage statistics (off until enabled; never prompts or outputs)")
    ts = p.add_subparsers(dest="telemetry_command", required=True, metavar="ACTION")
    for name, help in (("enable", "start recording generation events on this device"),
                       ("disable", "stop recording (events already stored stay until exported or trimmed)")):
        q = verb(ts, name, help)
        q.add_argument("--sample-rate", type=float, default=None, help="fraction of generations recorded (0..1)")
        q.add_argument("--level", choices=["basic", "full"], default=None,
                       help="basic: model, device, outcome; full (default): + token counts, latencies, memory")
        q.add_argument("--max-db-mib", type=float, default=None, help="size cap of the event database (default 16)")
        q.add_argument("--json", action="store_true")
    q = verb(ts, "status", "whether telemetry is on, its settings, and how many events are stored")
    q.add_argument("--json", action="store_true")
    q = verb(ts, "report", "P50/P90 of TTFT, decode speed, total time and memory per device × model × version")
    q.add_argument("--since", default=None, metavar="WHEN", help="30m, 24h, 7d or a date (UTC) like 2026-11-30")
    q.add_argument("--json", action="store_true")
    q.add_argument("--png", default=None, metavar="FILE", help="also draw the P50/P90 chart")
    q = verb(ts, "export", "write the events as OTLP/JSON lines, or upload them to a collector")
    q.add_argument("--output", "-o", default=None, metavar="FILE", help="default: stdout")
    q.add_argument("--since", default=None, metavar="WHEN")
    q.add_argument("--endpoint", default=None, metavar="URL",
                   help="POST events not yet uploaded to this OTLP/HTTP logs URL; failures stay queued")
    q.add_argument("--batch", type=int, default=100, help="events per request/line (default 100)")
