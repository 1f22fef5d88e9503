"""A port taken by the test process itself, the moment a component's process let it go."""

from __future__ import annotations

import socket
import time


def bind_when_free(port: int, timeout_s: float) -> socket.socket:
    """A socket listening on 127.0.0.1:``port``, bound as soon as the port is free (polled every 5 ms, blocking: an
    event loop of the caller's runs nothing meanwhile, so a supervisor in it cannot restart its child first).
    ``SO_REUSEADDR`` binds past the port's connections in TIME_WAIT (a readiness probe's).

    Raises:
        AssertionError: still taken after ``timeout_s`` seconds, naming who listens on it.
    """
    from llmd_timeslice.local.ports import listeners

    deadline = time.monotonic() + timeout_s
    while True:
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            s.listen()
            return s
        except OSError:
            s.close()
            assert time.monotonic() < deadline, f"port {port} stayed taken: {listeners(port)}"
            time.sleep(0.005)
