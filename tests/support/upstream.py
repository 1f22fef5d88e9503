"""A small real HTTP upstream for router tests: answers with its own address, can stream (SSE).

Runs a stdlib ``ThreadingHTTPServer`` in a background thread. ``GET/POST /`` returns JSON
``{"served_by": "ip:port", "body_bytes": n, "body_sha256": ...}``; ``[/v1]/stream?chunks=N&gap_ms=M``
sends N SSE events M ms apart; ``[/v1]/late_json?delay_ms=M`` sends its headers at once and a chunked JSON
body M ms later (a non-streamed answer still being computed); ``[/v1]/late_headers?delay_ms=M`` answers after M ms,
headers included; ``[/v1]/no_content`` answers 204.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from http.server import BaseHTTPRequestHandler
from urllib.parse import parse_qs, urlparse

from tests.support.http_server import QuietHTTPServer


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:  # quiet
        pass

    def _body(self) -> bytes:
        n = int(self.headers.get("content-length") or 0)
        return self.rfile.read(n) if n else b""

    def _handle(self) -> None:
        body = self._body()
        server: UpstreamServer = self.server.owner  # type: ignore[attr-defined]
        server.hits += 1
        server.paths.append(self.path)
        url = urlparse(self.path)
        if url.path.endswith("/no_content"):
            self.send_response(204)
            self.end_headers()
            return
        if url.path.endswith("/late_headers"):  # the whole answer after delay_ms: headers not yet sent meanwhile
            time.sleep(int(parse_qs(url.query).get("delay_ms", ["2000"])[0]) / 1000)
            payload = json.dumps({"served_by": server.address}).encode()
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)
            return
        if url.path.endswith("/late_json"):
            delay = int(parse_qs(url.query).get("delay_ms", ["2000"])[0]) / 1000
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("transfer-encoding", "chunked")
            self.end_headers()
            self.wfile.flush()
            time.sleep(delay)
            data = json.dumps({"served_by": server.address, "late_ms": int(delay * 1000)}).encode()
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n0\r\n\r\n")
            self.wfile.flush()
            return
        if url.path.endswith("/stream"):
            q = parse_qs(url.query)
            chunks = int(q.get("chunks", ["5"])[0])
            gap = int(q.get("gap_ms", ["100"])[0]) / 1000
            self.send_response(200)
            self.send_header("content-type", "text/event-stream")
            self.send_header("transfer-encoding", "chunked")
            self.end_headers()
            for i in range(chunks):
                data = f"data: {json.dumps({'i': i, 'served_by': server.address})}\n\n".encode()
                self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                self.wfile.flush()
                time.sleep(gap)
            done = b"data: [DONE]\n\n"
            self.wfile.write(f"{len(done):x}\r\n".encode() + done + b"\r\n0\r\n\r\n")
            self.wfile.flush()
            return
        payload = json.dumps(
            {"served_by": server.address, "body_bytes": len(body), "body_sha256": hashlib.sha256(body).hexdigest()}
        ).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    do_GET = _handle
    do_POST = _handle


class _Server(QuietHTTPServer):
    request_queue_size = 4096  # listen backlog: thousands of released requests connect at once


class UpstreamServer:
    """Background HTTP server on ``127.0.0.1:port``; ``address`` is ``ip:port``."""

    def __init__(self, port: int = 0) -> None:
        self._httpd = _Server(("127.0.0.1", port), _Handler)
        self._httpd.daemon_threads = True
        self._httpd.owner = self  # type: ignore[attr-defined]
        self.address = f"127.0.0.1:{self._httpd.server_address[1]}"
        self.hits = 0
        self.paths: list[str] = []
        """Request paths in arrival order."""
        # stop() returns at the serve loop's next poll (0.5 s by default, paid by every test's teardown)
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    def start(self) -> UpstreamServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
