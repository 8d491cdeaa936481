"""A total time limit on one channel read (the index, or one file), however slowly the bytes arrive.

A socket timeout bounds each ``recv``, so a server that sends one byte every few seconds never trips it.
A :class:`Deadline` instead shuts down the read's sockets when its time is up, from a timer thread: a
read blocked in ``recv`` then returns at once, and the reader sees :attr:`Deadline.passed`.
"""

from __future__ import annotations

import socket
import threading
import time
from types import TracebackType


class Deadline:
    """``seconds`` from now; sockets handed to :meth:`watch` are shut down when it passes. Use as a context
    manager (leaving it cancels the timer)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._end = time.monotonic() + seconds
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._expired = False
        self._timer = threading.Timer(seconds, self._expire)
        self._timer.daemon = True
        self._timer.start()

    def __enter__(self) -> Deadline:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self._timer.cancel()

    @property
    def passed(self) -> bool:
        return self._expired or time.monotonic() >= self._end

    def remaining(self) -> float:
        return max(0.0, self._end - time.monotonic())

    def watch(self, sock: socket.socket) -> socket.socket:
        """Shut ``sock`` down when the deadline passes (at once if it already has)."""
        with self._lock:
            expired = self._expired
            if not expired:
                self._sockets.append(sock)
        if expired:
            _shut(sock)
        return sock

    def _expire(self) -> None:
        with self._lock:
            self._expired = True
            sockets, self._sockets = self._sockets, []
        for sock in sockets:
            _shut(sock)


def _shut(sock: socket.socket) -> None:
    try:  # the plain socket's shutdown, also under TLS: a blocked read returns, the TLS object stays intact
        socket.socket.shutdown(sock, socket.SHUT_RDWR)
    except OSError:
        pass  # already closed
