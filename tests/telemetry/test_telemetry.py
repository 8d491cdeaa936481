"""Telemetry: off by default, metadata only (searched for the prompt and output text), P50/P90 against
numpy, OTLP export, and upload retried from the local queue against a loopback collector."""

from __future__ import annotations

import datetime
import io
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest

from edgellm.cli import main
from edgellm.errors import ContextOverflowError
from edgellm.generation import GenerationParams
from edgellm.telemetry import otlp, sink
from edgellm.telemetry.events import device_class
from edgellm.telemetry.report import parse_since
from edgellm.telemetry.settings import Settings, save_settings
from tests.support.tiny import tiny_engine

SECRET = "my passport number is ZX4471-QUOKKA"


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("EDGELLM_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("tele")
    eng = tiny_engine(root, "llama", tied=True)
    eng.chat_template = "{% for m in messages %}{{ m.content }} {% endfor %}"
    return eng


PARAMS = GenerationParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def test_off_by_default_and_sampling(engine, home: Path) -> None:
    engine.generate("t1 t2", PARAMS)
    assert not sink.db_path().exists()
    save_settings(Settings(enabled=True, sample_rate=0.0))
    engine.generate("t1 t2", PARAMS)
    assert sink.query() == []
    save_settings(Settings(enabled=True, sample_rate=1.0, level="basic"))
    engine.generate("t1 t2", PARAMS)
    (event,) = sink.query()
    assert event["finish_reason"] == "length" and event["ttft_ms"] is None  # basic: no latency figures
    assert event["model"] == "local" and len(event["version"]) == 12  # a manifest digest, not the folder


def test_events_never_hold_text_or_paths(engine, home: Path, tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["telemetry", "enable"]) == 0
    outputs = [engine.chat([{"role": "user", "content": SECRET}], PARAMS).text]
    stream = engine.stream_chat([{"role": "user", "content": SECRET + " again"}], PARAMS)
    outputs.append(next(stream).text)
    stream.close()  # the consumer stops early: recorded as cancelled
    with pytest.raises(ContextOverflowError):
        list(engine.stream(" ".join(["t5"] * 300), PARAMS))
    capsys.readouterr()
    assert main(["run", str(engine.artifact.folder), SECRET, "-n", "8", "--temperature", "0", "--threads", "1"]) == 0
    run = capsys.readouterr()
    outputs.append(run.out.strip())
    events = sink.query()
    assert [e["finish_reason"] for e in events] == ["length", "cancelled", "error", "length"]
    assert events[2]["error_class"] == "ContextOverflowError"
    assert events[0]["prompt_tokens"] > 0 and events[0]["completion_tokens"] == 8
    assert events[0]["device_class"] == device_class()
    export = io.StringIO()
    assert otlp.export_lines(export, None) == 4
    assert main(["telemetry", "report", "--json"]) == 0
    logs = run.err + capsys.readouterr().out
    haystacks = {"database": sink.db_path().read_bytes().decode("latin-1"), "export": export.getvalue(), "logs": logs}
    needles = [SECRET, "QUOKKA", *[o for o in outputs if len(o) > 3]]
    assert len(needles) >= 4
    for where, text in haystacks.items():
        for needle in needles:
            assert needle not in text, f"{needle!r} found in the {where}"
    for where in ("database", "export"):  # nor a file path of this user
        assert str(tmp_path.parent) not in haystacks[where] and "/home/" not in haystacks[where]


# docs/deploy.md's table of what an event may hold, written out here rather than read from the code's own list.
DOCUMENTED_FIELDS = {"ts", "model", "version", "scheme", "kernel", "edgellm_version", "device_class", "finish_reason",
                     "error_class", "threads", "prompt_tokens", "cached_tokens", "completion_tokens", "ttft_ms",
                     "prefill_tok_s", "decode_tok_s", "total_ms", "peak_rss_mib"}
MEASURED = {"id", "ts", "ttft_ms", "prefill_tok_s", "decode_tok_s", "total_ms", "peak_rss_mib", "uploaded"}


def test_events_do_not_depend_on_content(engine, home: Path) -> None:
    """Two conversations of the same length but different words (and so different token ids, word lengths, hashes
    and outputs) must leave the same events but for the measured figures: nothing derived from the text is kept."""
    save_settings(Settings(enabled=True))
    prompts = ["t201 t7 t150 t33 t88 t19", "t2 t2 t2 t2 t2 t2", "t99 t131 t64 t5 t240 t17"]
    replies = [engine.generate(p, PARAMS) for p in prompts]
    assert len({tuple(r.token_ids) for r in replies}) == 3  # the outputs differ too
    events = sink.query()
    assert len(events) == 3 and set(events[0]) - MEASURED <= DOCUMENTED_FIELDS
    content_free = [{k: v for k, v in e.items() if k not in MEASURED} for e in events]
    assert content_free[0] == content_free[1] == content_free[2], content_free
    exported = []  # what leaves the device: each event's OTLP log record, less its times and measured figures
    for event in events:
        (rec,) = otlp.request_body([event])["resourceLogs"][0]["scopeLogs"][0]["logRecords"]
        rec = {k: v for k, v in rec.items() if not k.endswith("UnixNano")}
        rec["attributes"] = [a for a in rec["attributes"]
                             if a["key"].removeprefix("edgellm.") not in MEASURED | {"event_id"}]
        exported.append(json.dumps(rec, sort_keys=True))
    assert exported[0] == exported[1] == exported[2]


def test_server_records_the_same_events(engine, home: Path) -> None:
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from edgellm.serve.app import create_app

    save_settings(Settings(enabled=True))
    with TestClient(create_app(lambda: engine, "tiny"), base_url="http://localhost") as client:
        deadline = time.monotonic() + 60
        while client.get("/health").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        r = client.post("/v1/chat/completions", json={"model": "tiny", "max_tokens": 5, "temperature": 0,
                                                       "messages": [{"role": "user", "content": SECRET}]})
        assert r.status_code == 200
    (event,) = sink.query()
    assert event["completion_tokens"] == r.json()["usage"]["completion_tokens"]
    assert SECRET not in sink.db_path().read_bytes().decode("latin-1")


def _fake(i: int, *, model: str = "m", version: str = "1", ts: float | None = None) -> dict:
    rng = np.random.default_rng(i)
    return {"ts": ts or time.time(), "model": model, "version": version, "scheme": "q4f16_1", "kernel": "torch",
            "edgellm_version": "0.1.0", "device_class": "x86_64 test / 2 cores / 32 GiB", "finish_reason": "stop",
            "ttft_ms": float(rng.uniform(10, 500)), "decode_tok_s": float(rng.uniform(20, 120)),
            "total_ms": float(rng.uniform(100, 900)), "peak_rss_mib": float(rng.uniform(300, 400))}


def test_report_percentiles_match_numpy(home: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    events = [_fake(i) for i in range(37)] + [_fake(100 + i, version="2") for i in range(5)]
    events.append(_fake(999, version="2", ts=time.time() - 3 * 86400))  # too old for --since 1d
    for e in events:
        sink.insert(e, 1 << 30)
    capsys.readouterr()
    assert main(["telemetry", "report", "--since", "1d", "--json", "--png", str(tmp_path / "p.png")]) == 0
    rows = {r["version"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["1"]["events"] == 37 and rows["2"]["events"] == 5
    for version, evs in (("1", events[:37]), ("2", events[37:42])):
        for metric in ("ttft_ms", "decode_tok_s"):
            for q in (50, 90):
                want = np.percentile([e[metric] for e in evs], q)
                assert rows[version][f"{metric}_p{q}"] == pytest.approx(want, abs=0.01)
    assert (tmp_path / "p.png").stat().st_size > 1000
    assert main(["telemetry", "report"]) == 0 and "P50/P90" in capsys.readouterr().out
    midnight = datetime.datetime(2026, 11, 30, tzinfo=datetime.timezone.utc).timestamp()
    assert parse_since("2026-11-30") == midnight and parse_since("2h", now=midnight) == midnight - 7200


def test_database_size_cap(home: Path) -> None:
    cap = 16 << 10
    for i in range(250):  # about 60 KiB of events without the cap
        sink.insert(_fake(i), cap)
    assert sink.db_path().stat().st_size <= cap + (8 << 10)  # trimmed back after each overshoot
    ids = [e["id"] for e in sink.query()]
    assert ids[-1] == 250 and len(ids) < 125  # the newest kept, the oldest trimmed


class Collector:
    """A loopback OTLP/HTTP collector that refuses the first `fail` requests with 503."""

    def __init__(self, fail: int) -> None:
        self.fail, self.posts, self.ids = fail, 0, []
        state = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_POST(self) -> None:  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                state.posts += 1
                if state.posts <= state.fail:
                    self.send_response(503)
                else:
                    for rl in body["resourceLogs"]:
                        for sl in rl["scopeLogs"]:
                            for rec in sl["logRecords"]:
                                attrs = {a["key"]: a["value"] for a in rec["attributes"]}
                                state.ids.append(int(attrs["edgellm.event_id"]["intValue"]))
                    self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1/logs"


def test_upload_retries_from_the_queue_across_runs(home: Path) -> None:
    for i in range(25):
        sink.insert(_fake(i), 1 << 30)
    collector = Collector(fail=4)
    try:
        assert otlp.upload(collector.url, batch=10, attempts=2, delay_s=0.01) == (0, 25)  # 2 tries, both 503
        assert otlp.upload(collector.url, batch=10, attempts=2, delay_s=0.01) == (0, 25)  # a "restart": 503 again
        assert otlp.upload(collector.url, batch=10, attempts=2, delay_s=0.01) == (25, 0)
        assert otlp.upload(collector.url, batch=10, attempts=2, delay_s=0.01) == (0, 0)  # nothing twice
    finally:
        collector.httpd.shutdown()
    assert sorted(collector.ids) == list(range(1, 26))


def test_otlp_record_shape(home: Path) -> None:
    sink.insert(_fake(1), 1 << 30)
    (event,) = sink.query()
    body = otlp.request_body([event])
    rec = body["resourceLogs"][0]["scopeLogs"][0]["logRecords"][0]
    keys = {a["key"].removeprefix("edgellm.") for a in rec["attributes"]}
    assert keys <= DOCUMENTED_FIELDS | {"event_id"}
    assert int(rec["timeUnixNano"]) == round(event["ts"] * 1000) * 10**6


# LogRecord's fields in OTLP/JSON (lowerCamelCase of opentelemetry-proto's logs.proto) and the SeverityNumber
# enum's values for the two levels edgellm emits (SEVERITY_NUMBER_INFO = 9, SEVERITY_NUMBER_ERROR = 17).
OTLP_LOG_RECORD_FIELDS = {"timeUnixNano", "observedTimeUnixNano", "severityNumber", "severityText", "body",
                          "attributes", "droppedAttributesCount", "flags", "traceId", "spanId", "eventName"}


def test_otlp_records_carry_severity_number(home: Path) -> None:
    sink.insert(_fake(1), 1 << 30)
    sink.insert({**_fake(2), "error_class": "ContextOverflowError", "finish_reason": "error"}, 1 << 30)
    records = otlp.request_body(sink.query())["resourceLogs"][0]["scopeLogs"][0]["logRecords"]
    for rec in records:
        assert set(rec) <= OTLP_LOG_RECORD_FIELDS, set(rec) - OTLP_LOG_RECORD_FIELDS
    assert [(r["severityNumber"], r["severityText"]) for r in records] == [(9, "INFO"), (17, "ERROR")]
