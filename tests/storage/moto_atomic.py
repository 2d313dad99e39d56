"""moto's S3 server with its conditional writes made atomic, as they are on AWS S3.

moto (5.x) answers ``PutObject`` with ``If-None-Match: *`` / ``If-Match`` by reading the key, comparing, and
then writing it, with no lock around the three steps, while its werkzeug server handles each request on its own
thread.  Two conditional PUTs of the same key that arrive together can therefore both succeed, which AWS never
allows (one gets 412, or 409 while the other is in flight).  The ownership race tests send eight at once and
caught moto doing this about once in a few hundred rounds.

This launcher serves moto's own, unmodified application exactly as ``moto_server`` does, with one WSGI
middleware in front: requests carrying ``If-Match`` or ``If-None-Match`` on a write (PUT, POST, DELETE) run one at
a time.  Every other request stays concurrent, so multipart uploads and ranged reads behave as before.  Nothing of
moto's behaviour is replaced; only the atomicity AWS promises for conditional writes is restored.

Run as ``python moto_atomic.py HOST PORT``; it exits on SIGTERM.
"""

from __future__ import annotations

import signal
import sys
import threading
from typing import Any, Callable, Iterable

from moto.moto_server.werkzeug_app import DomainDispatcherApplication, create_backend_app
from werkzeug.serving import run_simple

_WRITES = frozenset({"PUT", "POST", "DELETE"})


class SerialConditionalWrites:
    """WSGI middleware: conditional writes go through one lock, and the whole response is built inside it."""

    def __init__(self, app: Callable[..., Iterable[bytes]]) -> None:
        self.app = app
        self.lock = threading.Lock()

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        conditional = environ.get("REQUEST_METHOD") in _WRITES and (
            "HTTP_IF_MATCH" in environ or "HTTP_IF_NONE_MATCH" in environ)
        if not conditional:
            return self.app(environ, start_response)
        with self.lock:
            # Drain the body under the lock: moto may do its work lazily, while the iterable is consumed.
            return [b"".join(self.app(environ, start_response))]


def main() -> None:
    host, port = sys.argv[1], int(sys.argv[2])
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    app = DomainDispatcherApplication(create_backend_app)
    run_simple(host, port, SerialConditionalWrites(app), threaded=True)


if __name__ == "__main__":
    main()
