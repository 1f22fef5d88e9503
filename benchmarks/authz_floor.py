"""The floor of the fast path on this machine: an HTTP ext_authz server that only answers.

Same stack as the gate's edge (asyncio protocol, httptools, uvloop) and the same answer shape as an admission
(an admission header and either ``x-gateway-destination-endpoint``, or with ``hint`` the subset hint naming the
destination, for an EPP behind it), but no core, no bookkeeping and no access log: what any Python ext_authz
service costs here. ``benchmarks.router_overhead`` runs it as the ``authz_floor`` chains, in the same run as the
gate and at the same request rates, so the gate's own share can be read off.

    .venv/bin/python -m benchmarks.authz_floor PORT DESTINATION [hint]
"""

from __future__ import annotations

import asyncio
import sys

import httptools
import uvloop


def floor_answer(destination: str, hint: bool) -> bytes:
    """The floor's fixed answer: an admission header and the destination (``hint``: the subset hint naming it, for an
    EPP behind it; else ``x-gateway-destination-endpoint``)."""
    if hint:
        from epp_plugin.gate.ext_authz import subset_hint_value

        header = b"x-llmd-timeslice-subset-hint: " + subset_hint_value((destination,)).encode()
    else:
        header = b"x-gateway-destination-endpoint: " + destination.encode()
    return b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n" + header + b"\r\nx-llmd-timeslice-admission: 0\r\n\r\n"


class FloorCheck(asyncio.Protocol):
    """One ext_authz connection of the floor: parse each check with httptools, write ``answer``."""

    def __init__(self, answer: bytes) -> None:
        self.answer = answer

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.parser = httptools.HttpRequestParser(self)

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_message_complete(self) -> None:
        self.transport.write(self.answer)


def main() -> None:
    port, destination = int(sys.argv[1]), sys.argv[2]
    answer = floor_answer(destination, sys.argv[3:] == ["hint"])

    async def serve() -> None:
        await asyncio.get_running_loop().create_server(lambda: FloorCheck(answer), "127.0.0.1", port, backlog=4096)
        await asyncio.Event().wait()

    uvloop.run(serve())


if __name__ == "__main__":
    main()
