"""A loopback TCP proxy that a test can cut (connections reset) or black-hole (bytes silently dropped,
sockets kept open: a network partition), then heal; or slow down: ``delay_s`` holds every byte from the target
back for that many seconds (order kept), like a slow endpoint picker."""

from __future__ import annotations

import asyncio
import contextlib


class TcpProxy:
    def __init__(self, target_host: str, target_port: int, delay_s: float = 0.0) -> None:
        self.target = (target_host, target_port)
        self.delay_s = delay_s
        self.held_back = 0
        """Chunks from the target being held back now (``delay_s``)."""
        self.delivered_late = 0
        """Chunks from the target held back and then passed on (or dropped: cut, black-holed) so far."""
        self.port = 0
        self.mode = "pass"  # pass | blackhole | refuse
        self.refused = 0
        """Connections accepted and closed at once (``cut``: refused) so far."""
        self._server: asyncio.base_events.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._dead: set[asyncio.StreamWriter] = set()  # connections left black-holed by heal(keep_dead=True)

    async def start(self) -> TcpProxy:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delayed: bool = False) -> None:
        if delayed and self.delay_s > 0:
            await self._delayed_pipe(reader, writer)
            return
        with contextlib.suppress(ConnectionError, OSError):
            while data := await reader.read(65536):
                if self.mode == "pass" and writer not in self._dead:
                    writer.write(data)
                    await writer.drain()
        with contextlib.suppress(Exception):
            writer.close()

    async def _delayed_pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Each chunk leaves ``delay_s`` after it arrived (chunks do not add up their delays)."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        async def send() -> None:
            while (item := await queue.get()) is not None:
                due, data = item
                try:
                    await asyncio.sleep(max(0.0, due - loop.time()))
                    if self.mode == "pass" and writer not in self._dead:
                        writer.write(data)
                        await writer.drain()
                finally:
                    self.held_back -= 1
                    self.delivered_late += 1

        sender = asyncio.create_task(send())
        with contextlib.suppress(ConnectionError, OSError):
            while data := await reader.read(65536):
                self.held_back += 1
                queue.put_nowait((loop.time() + self.delay_s, data))
            queue.put_nowait(None)
            await sender
        sender.cancel()
        with contextlib.suppress(Exception):
            writer.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.mode == "refuse":
            self.refused += 1
            writer.close()
            return
        try:
            ur, uw = await asyncio.open_connection(*self.target)
        except OSError:
            writer.close()
            return
        self._writers |= {writer, uw}
        await asyncio.gather(self._pipe(reader, uw), self._pipe(ur, writer, delayed=True))
        self._writers -= {writer, uw}
        self._dead -= {writer, uw}

    def blackhole(self) -> None:
        """Drop every byte from now on (both ways) while keeping connections open; refuse new ones."""
        self.mode = "blackhole"

    def cut(self) -> None:
        """Reset every connection now and refuse new ones."""
        self.mode = "refuse"
        for w in list(self._writers):
            with contextlib.suppress(Exception):
                w.transport.abort()

    def heal(self, keep_dead: bool = False) -> None:
        """Let bytes through again; black-holed connections stay dead (the peers must reconnect): reset, or with
        ``keep_dead`` kept open and silent, as a connection whose retransmissions backed off far past the cable's
        return (nothing tells its peer to reconnect)."""
        if keep_dead:
            self._dead |= self._writers
        else:
            for w in list(self._writers):
                with contextlib.suppress(Exception):
                    w.transport.abort()
        self.mode = "pass"

    async def stop(self) -> None:
        self.cut()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
