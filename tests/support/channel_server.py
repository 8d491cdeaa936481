"""A static file server on loopback for release-channel tests: honours Range, counts requests and bytes,
can drop the connection part-way through a file (a server killed mid-download), and can trickle a file's
body one byte at a time (a stalled server) until told to stop."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


@dataclass
class Served:
    path: str
    status: int
    sent: int
    range: str | None


@dataclass
class ChannelServer:
    root: Path
    log: list[Served] = field(default_factory=list)
    cut_after: int | None = None  # send this many body bytes of a blob, then drop the connection
    trickle: str | None = None  # paths starting with this get their body one byte every 0.2 s ...
    trickling: threading.Event = field(default_factory=threading.Event)  # (set once a trickle has begun)
    stop_trickle: threading.Event = field(default_factory=threading.Event)  # ... until this is set: then dropped

    def __post_init__(self) -> None:
        state = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:  # keep test output clean
                pass

            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                rel = self.path.lstrip("/")
                path = (state.root / rel).resolve()
                if not path.is_relative_to(state.root.resolve()) or not path.is_file():
                    self.send_error(404)
                    state.log.append(Served(self.path, 404, 0, None))
                    return
                data = path.read_bytes()
                start, status = 0, 200
                rng = self.headers.get("Range")
                if rng and rng.startswith("bytes=") and rng.endswith("-"):
                    start, status = int(rng[6:-1]), 206
                    if start >= len(data):
                        self.send_error(416)
                        state.log.append(Served(self.path, 416, 0, rng))
                        return
                body = data[start:]
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                if status == 206:
                    self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
                self.end_headers()
                if state.cut_after is not None and rel.startswith("blobs/"):
                    body = body[: state.cut_after]
                    self.close_connection = True
                if state.trickle is not None and rel.startswith(state.trickle):
                    self.send_trickle(body)
                    return
                # logged before the body goes out: a client that has read it all may look at the log at once
                state.log.append(Served(self.path, status, len(body), rng))
                self.wfile.write(body)
                self.wfile.flush()

            def send_trickle(self, body: bytes) -> None:
                self.close_connection = True
                self.wfile.flush()
                state.trickling.set()
                try:
                    for i in range(len(body)):
                        if state.stop_trickle.wait(0.2):
                            break
                        self.wfile.write(body[i : i + 1])
                        self.wfile.flush()
                except OSError:  # the client gave up (its deadline)
                    pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def blob_requests(self) -> list[Served]:
        return [s for s in self.log if s.path.startswith("/blobs/")]

    def close(self) -> None:
        self.stop_trickle.set()
        self.httpd.shutdown()
        self.httpd.server_close()
