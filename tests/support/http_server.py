"""The stdlib threading HTTP server of the tests' fake engines, upstreams and API servers, quiet about clients gone.

``socketserver`` prints a traceback to ``sys.stderr`` for every handler that raises, including a client that went
away while it was answered (Envoy killed, a request cancelled, a connection held and dropped). From a background
thread that lands in whatever the test of the moment captures (seen: a `--help` text, read by CliRunner while a
previous test's server wrote a BrokenPipeError, failed the width check).
"""

from __future__ import annotations

import sys
from http.server import ThreadingHTTPServer


class QuietHTTPServer(ThreadingHTTPServer):
    """``ThreadingHTTPServer`` that drops a handler's ``ConnectionError`` (the client is gone) and reports the rest."""

    def handle_error(self, request, client_address) -> None:
        if isinstance(sys.exc_info()[1], ConnectionError):  # BrokenPipe, ConnectionReset, ConnectionAborted
            return
        super().handle_error(request, client_address)
