"""OTLP/JSON export (the logs signal) and upload to a collector in batches, retried from the local queue."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any, TextIO

from edgellm import __version__
from edgellm.errors import EdgeLLMError
from edgellm.telemetry import sink
from edgellm.telemetry.events import FIELDS

SCOPE = "edgellm.telemetry"
SEVERITY_INFO = 9  # OTLP's SeverityNumber: SEVERITY_NUMBER_INFO
SEVERITY_ERROR = 17  # SEVERITY_NUMBER_ERROR


def _value(v: Any) -> dict[str, Any]:
    if isinstance(v, bool):
        return {"boolValue": v}
    if isinstance(v, int):
        return {"intValue": str(v)}  # OTLP/JSON encodes 64-bit integers as strings
    if isinstance(v, float):
        return {"doubleValue": v}
    return {"stringValue": str(v)}


def log_record(event: dict[str, Any]) -> dict[str, Any]:
    attrs = [{"key": f"edgellm.{k}", "value": _value(event[k])} for k in FIELDS if k != "ts" and event.get(k) is not None]
    attrs.append({"key": "edgellm.event_id", "value": _value(int(event["id"]))})
    return {"timeUnixNano": str(round(event["ts"] * 1000) * 1_000_000),  # ts is stored to the millisecond
            "severityNumber": SEVERITY_ERROR if event.get("error_class") else SEVERITY_INFO,
            "severityText": "ERROR" if event.get("error_class") else "INFO",
            "body": {"stringValue": "generation"}, "attributes": attrs}


def request_body(events: list[dict[str, Any]]) -> dict[str, Any]:
    """One ExportLogsServiceRequest holding ``events``."""
    resource = [{"key": "service.name", "value": {"stringValue": "edgellm"}},
                {"key": "service.version", "value": {"stringValue": __version__}}]
    return {"resourceLogs": [{"resource": {"attributes": resource},
                              "scopeLogs": [{"scope": {"name": SCOPE, "version": __version__},
                                             "logRecords": [log_record(e) for e in events]}]}]}


def batches(events: list[dict[str, Any]], size: int) -> Iterator[list[dict[str, Any]]]:
    for i in range(0, len(events), size):
        yield events[i : i + size]


def export_lines(out: TextIO, since: float | None, batch: int = 100) -> int:
    """Write one OTLP/JSON request per line; returns the number of events."""
    events = sink.query(since)
    for chunk in batches(events, batch):
        out.write(json.dumps(request_body(chunk), separators=(",", ":")) + "\n")
    return len(events)


def upload(endpoint: str, *, batch: int = 100, attempts: int = 3, delay_s: float = 1.0,
           timeout_s: float = 30.0) -> tuple[int, int]:
    """POST the events not uploaded yet to ``endpoint`` (an OTLP/HTTP logs URL, e.g. .../v1/logs).

    Each batch is marked uploaded only after a 2xx answer; a batch that still fails after ``attempts``
    tries (backing off ``delay_s``, doubling) stops the run and stays queued for the next one.
    Returns (uploaded, still pending)."""
    if not endpoint.startswith(("http://", "https://")):
        raise EdgeLLMError(f"--endpoint must be an http(s) URL, not {endpoint!r}")
    pending = sink.query(pending_only=True)
    sent = 0
    for chunk in batches(pending, batch):
        data = json.dumps(request_body(chunk), separators=(",", ":")).encode("utf-8")
        if not _post(endpoint, data, attempts, delay_s, timeout_s):
            break
        sink.mark_uploaded([int(e["id"]) for e in chunk])
        sent += len(chunk)
    return sent, len(pending) - sent


def _post(endpoint: str, data: bytes, attempts: int, delay_s: float, timeout_s: float) -> bool:
    for attempt in range(attempts):
        request = urllib.request.Request(endpoint, data=data, method="POST",
                                         headers={"Content-Type": "application/json",
                                                  "User-Agent": f"edgellm/{__version__}"})
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as resp:  # noqa: S310 - http(s) checked
                if 200 <= resp.status < 300:
                    return True
        except (urllib.error.URLError, OSError):
            pass
        if attempt + 1 < attempts:
            time.sleep(delay_s * 2**attempt)
    return False
