"""A TCP proxy on loopback in front of an HTTP server, with a fault switched on and off by the test.

Modes: ``pass`` (bytes flow both ways), ``down`` (every connection is reset as soon as it is accepted: a
server that is gone), ``slow`` (each connection waits ``delay`` seconds before its bytes flow) and ``error``
(every request is answered ``status`` with an S3 error document, then the connection closes). Switching
mode closes the connections opened under the previous one, so a client's pooled keep-alive connections
meet the new fault at once. It listens on 127.0.0.1 only and talks only to the upstream it is given.
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from typing import Optional

_ERROR_BODY = b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>%s</Code><Message>injected by the test's " \
              b"fault proxy</Message></Error>"
_REASONS = {500: ("Internal Server Error", b"InternalError"), 503: ("Service Unavailable", b"SlowDown")}


class FaultProxy:
    def __init__(self, upstream_host: str, upstream_port: int) -> None:
        self.upstream = (upstream_host, upstream_port)
        self.mode = "pass"
        self.delay = 0.0
        self.status = 503
        self.connections = 0  # accepted so far (a test can tell its client came through here)
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._closed = False
        self._thread = threading.Thread(target=self._accept_loop, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def set(self, mode: str, *, delay: float = 0.0, status: int = 503) -> None:
        assert mode in ("pass", "down", "slow", "error"), mode
        with self._lock:
            self.mode, self.delay, self.status = mode, delay, status
            doomed, self._open = self._open, set()
        for s in doomed:
            _close(s)

    def close(self) -> None:
        self._closed = True
        _close(self._listener)
        self.set("down")

    # -- the proxy ------------------------------------------------------------------------------------
    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with self._lock:
            mode, delay, status = self.mode, self.delay, self.status
            self._open.add(conn)
        try:
            if mode == "down":
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # RST
                return
            if mode == "error":
                self._answer_error(conn, status)
                return
            if mode == "slow":
                time.sleep(delay)
            up = socket.create_connection(self.upstream, timeout=30)
            with self._lock:
                self._open.add(up)
            t = threading.Thread(target=_pipe, args=(up, conn), daemon=True)
            t.start()
            _pipe(conn, up)
            t.join(timeout=60)
            with self._lock:
                self._open.discard(up)
        except OSError:
            pass
        finally:
            with self._lock:
                self._open.discard(conn)
            _close(conn)

    @staticmethod
    def _answer_error(conn: socket.socket, status: int) -> None:
        data = b""
        while b"\r\n\r\n" not in data:  # the request's head; a body (if any) is left unread: we close after
            chunk = conn.recv(65536)
            if not chunk:
                return
            data += chunk
        reason, code = _REASONS.get(status, ("Error", b"InternalError"))
        body = _ERROR_BODY % code
        conn.sendall(b"HTTP/1.1 %d %s\r\nContent-Type: application/xml\r\nContent-Length: %d\r\n"
                     b"Connection: close\r\n\r\n%s" % (status, reason.encode(), len(body), body))


def _pipe(src: socket.socket, dst: socket.socket) -> None:
    try:
        while True:
            chunk = src.recv(65536)
            if not chunk:
                break
            dst.sendall(chunk)
    except OSError:
        pass
    finally:
        _close(dst)


def _close(s: Optional[socket.socket]) -> None:
    if s is None:
        return
    try:
        s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    try:
        s.close()
    except OSError:
        pass
