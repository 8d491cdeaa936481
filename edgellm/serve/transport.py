"""The server's connection limits: a cap on open connections and a deadline for each request head.

uvicorn bounds neither: a connection that sends half a request head is kept forever, and any number of them
may be open (slowloris). Its h11 protocol is extended here: a connection over `max_connections` is closed as
soon as it is accepted, and one that has no request being served `header_timeout_s` after it was accepted (or
after its last response) is closed. The request body's deadline is the app's (EdgeMiddleware in app.py).
"""

from __future__ import annotations

import argparse
import asyncio
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from edgellm.errors import EdgeLLMError

if TYPE_CHECKING:  # the CLI builds its `serve` flags from this module without the serve extra installed
    import uvicorn
    from starlette.types import ASGIApp


@dataclass(frozen=True)
class Connections:
    """How long a client may take to send a request, and how many connections may be open at once."""

    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    max_connections: int = 100
    max_header_bytes: int = 16 << 10


def add_connection_args(parser: argparse.ArgumentParser) -> None:
    """The `serve` flags of Connections."""
    d = Connections()
    group = parser.add_argument_group("connection limits (slow or too many clients are cut off)")
    group.add_argument("--header-timeout", type=float, default=d.header_timeout_s, metavar="S",
                       help="seconds a connection may take to send a request's head (line and headers), counted "
                            "from connecting or from the previous response; then it is closed "
                            f"(default {d.header_timeout_s:g})")
    group.add_argument("--body-timeout", type=float, default=d.body_timeout_s, metavar="S",
                       help=f"seconds a request body may take to arrive; then 408 (default {d.body_timeout_s:g})")
    group.add_argument("--max-connections", type=int, default=d.max_connections, metavar="N",
                       help=f"open connections; one more is closed at once (default {d.max_connections})")
    group.add_argument("--max-header-bytes", type=int, default=d.max_header_bytes, metavar="N",
                       help=f"size of a request's head; more is 400 (default {d.max_header_bytes})")


def connections_from_args(args: argparse.Namespace) -> Connections:
    """The Connections the parsed `serve` flags ask for; times must be > 0, counts at least 1."""
    for flag, value in (("--header-timeout", args.header_timeout), ("--body-timeout", args.body_timeout)):
        if not (math.isfinite(value) and value > 0):
            raise EdgeLLMError(f"{flag} must be a number of seconds > 0, got {value}")
    for flag, count in (("--max-connections", args.max_connections), ("--max-header-bytes", args.max_header_bytes)):
        if count < 1:
            raise EdgeLLMError(f"{flag} must be at least 1, got {count}")
    return Connections(args.header_timeout, args.body_timeout, args.max_connections, args.max_header_bytes)


def protocol_class(limits: Connections) -> type[asyncio.Protocol]:
    """uvicorn's h11 protocol with the connection cap and the request-head deadline of `limits`."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class GuardedH11Protocol(H11Protocol):
        head_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if len(self.connections) > limits.max_connections:
                transport.close()
                return
            self._arm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm()  # the next request's head must come within the deadline too

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            self.head_timer = self.loop.call_later(limits.header_timeout_s, self._head_deadline)

        def _disarm(self) -> None:
            if self.head_timer is not None:
                self.head_timer.cancel()
                self.head_timer = None

        def _head_deadline(self) -> None:
            self.head_timer = None
            if self.cycle is not None and not self.cycle.response_complete:
                return  # a request is being served: its body deadline and the request timeout apply
            if not self.transport.is_closing():
                self.transport.close()

    return GuardedH11Protocol


def uvicorn_config(app: ASGIApp, *, host: str, port: int, limits: Connections,
                   log_level: str = "info") -> uvicorn.Config:
    """The uvicorn.Config `edgellm serve` runs (tests start servers with it too): the guarded protocol, the head
    size cap, no access log."""
    import uvicorn  # noqa: F811 - at run time, not only for the type

    return uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False,
                          http=protocol_class(limits), h11_max_incomplete_event_size=limits.max_header_bytes)
