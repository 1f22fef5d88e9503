"""What every component's process does around its server: structured logs on stderr, Prometheus ``/metrics`` on
its own port, the descriptor limit, and running an asyncio server until SIGINT/SIGTERM. Shared by the commands of
``llmd-timeslice`` (``cli.py``) and those the router side contributes (``epp_plugin/commands.py``)."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys

from llmd_timeslice.config import LogLevel


def setup_logging(level: LogLevel | str) -> None:
    logging.basicConfig(
        level=getattr(logging, str(getattr(level, "value", level)).upper(), logging.WARNING),
        format="ts=%(asctime)s level=%(levelname)s logger=%(name)s msg=%(message)s",
        stream=sys.stderr,
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)


def serve_metrics(port: int, host: str) -> None:
    """Serve Prometheus /metrics on ``host:port`` (the component's own bind address) unless port is 0."""
    if port:
        from prometheus_client import start_http_server

        start_http_server(port, addr=host)


def run_until_signal(coro_factory) -> None:
    """Run an async server until SIGINT/SIGTERM, then let it stop cleanly."""

    async def main() -> None:
        task = asyncio.current_task()
        assert task is not None  # main() runs as asyncio.run's task
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, task.cancel)
        try:
            await coro_factory()
        except asyncio.CancelledError:
            pass

    asyncio.run(main())


def run_on_uvloop(coro_factory) -> None:
    """``run_until_signal`` on uvloop's event loop (the gate's HTTP ext_authz edge is measured on it:
    docs/decisions/fast-path-http-server.md)."""
    import uvloop

    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    try:
        run_until_signal(coro_factory)
    finally:
        asyncio.set_event_loop_policy(None)


def raise_open_file_limit() -> None:
    """Each held request is one open connection from Envoy: lift the soft descriptor limit to the hard one."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else 1 << 20
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
