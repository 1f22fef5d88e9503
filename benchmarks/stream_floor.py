"""The floor under the orchestrator's cost per sampler: a client that only sends each sampler its two commands.

    .venv/bin/python -m benchmarks.stream_floor --samplers 128 --switches 20 --spread-ms 300 [--transport grpc|tcp]

Per switch a sampler costs the orchestrator at least two commands on its sidecar's operation stream (sleep, then
wake: one message each way, :mod:`llmd_timeslice.orchestrator.sidecar_stream`). This measures what those cost
with nothing else around them: a client process keeps one stream per sampler open to do-nothing servers (another
process) and, per switch, sends every stream the orchestrator's sleep command and then its wake command (the same
``OperationCommand`` messages), each time waiting for every answer. The servers answer each command after a random
delay, uniform in ``[0, spread]``, so the answers arrive spread out as real engines' sleeps and wakes do (the scale
benchmark passes the spread its own sleeps took), not in one burst the client reads in a single wake-up.

``--transport grpc``: grpc.aio, the orchestrator's library (``SnapshotOperationsService.RunOperations``).
``--transport tcp``: the same bytes as length-prefixed frames on plain asyncio TCP streams: what a transport
without gRPC would bottom out at.

Prints one JSON object: ``cpu_ms_per_switch`` (the client process's CPU, every thread, per switch) and
``cpu_ms_per_sampler_switch`` (divided by the samplers).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import struct
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.report import number, prepare_out
from llmd_timeslice.api.llmd_timeslice.v1alpha1 import snapshot_ext_pb2 as xpb
from llmd_timeslice.api.llmd_timeslice.v1alpha1 import snapshot_ext_pb2_grpc as xpb_grpc
from llmd_timeslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as spb

WARMUP_SWITCHES = 2
MAX_SPREAD_MS = 60_000.0
_FRAME = struct.Struct("!I")


def _commands(job: str) -> tuple[xpb.OperationCommand, xpb.OperationCommand]:
    """The orchestrator's sleep and wake commands of one sampler (as ``GrpcSwitchActions._operation`` builds them)."""
    cfg = spb.BackendConfig(app_endpoint=spb.AppEndpointConfig(app=spb.APP_VLLM, mode=spb.SUSPEND_MODE_OFFLOAD))
    sleep, wake = xpb.OperationCommand(), xpb.OperationCommand()
    sleep.snapshot.CopyFrom(spb.SnapshotRequest(job_id=job, group="scale", backend_config=cfg, leader_term=1))
    wake.restore.CopyFrom(spb.RestoreRequest(job_id=job, group="scale", backend_config=cfg, leader_term=1))
    return sleep, wake


def _answer(command_id: int) -> xpb.OperationEvent:
    event = xpb.OperationEvent(command_id=command_id)
    event.result.operation.status = spb.OPERATION_STATUS_COMPLETE
    return event


# ------------------------------------------------------------------------------------------------ servers
class _DoNothingSidecar(xpb_grpc.SnapshotOperationsServiceServicer):
    def __init__(self, spread_s: float) -> None:
        self.spread_s = spread_s

    async def RunOperations(self, request_iterator, context):  # noqa: N802 - the gRPC method's name
        await context.send_initial_metadata(())  # the orchestrator's stream opens on it (sidecar_stream.py)
        try:
            async for cmd in request_iterator:
                await asyncio.sleep(random.random() * self.spread_s)
                yield _answer(cmd.command_id)
        except asyncio.CancelledError:  # the client went away: the end of a measurement
            return


async def _serve(samplers: int, spread_s: float, transport: str) -> None:
    """``samplers`` servers; prints their ports on one line, then serves until stdin closes."""
    from grpc import aio

    async def frames(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                (size,) = _FRAME.unpack(await reader.readexactly(_FRAME.size))
                cmd = xpb.OperationCommand.FromString(await reader.readexactly(size))
                await asyncio.sleep(random.random() * spread_s)
                data = _answer(cmd.command_id).SerializeToString()
                writer.write(_FRAME.pack(len(data)) + data)
        except asyncio.IncompleteReadError:
            writer.close()

    ports: list[int] = []
    grpc_servers: list[aio.Server] = []
    tcp_servers: list[asyncio.Server] = []
    for _ in range(samplers):
        if transport == "grpc":
            server = aio.server()
            xpb_grpc.add_SnapshotOperationsServiceServicer_to_server(_DoNothingSidecar(spread_s), server)
            ports.append(server.add_insecure_port("127.0.0.1:0"))
            await server.start()
            grpc_servers.append(server)
        else:
            tcp = await asyncio.start_server(frames, "127.0.0.1", 0)
            ports.append(tcp.sockets[0].getsockname()[1])
            tcp_servers.append(tcp)
    print(" ".join(map(str, ports)), flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    for server in grpc_servers:
        await server.stop(0)
    for tcp in tcp_servers:
        tcp.close()


# ------------------------------------------------------------------------------------------------- client
async def _client_grpc(ports: list[int], switches: int) -> float:
    from grpc import aio

    channels = [aio.insecure_channel(f"127.0.0.1:{p}") for p in ports]
    calls = [xpb_grpc.SnapshotOperationsServiceStub(ch).RunOperations(wait_for_ready=True) for ch in channels]
    commands = [_commands(f"s{i}") for i in range(len(ports))]
    ids = iter(range(1, 1 << 62))

    async def one(call, cmd: xpb.OperationCommand) -> None:
        cmd.command_id = next(ids)
        await call.write(cmd)
        event = await call.read()
        assert event.command_id == cmd.command_id

    cpu = await _switches(calls, commands, one, switches)
    for call in calls:
        call.cancel()
    for ch in channels:
        await ch.close()
    return cpu


async def _client_tcp(ports: list[int], switches: int) -> float:
    streams = [await asyncio.open_connection("127.0.0.1", p) for p in ports]
    commands = [_commands(f"s{i}") for i in range(len(ports))]
    ids = iter(range(1, 1 << 62))

    async def one(stream: tuple[asyncio.StreamReader, asyncio.StreamWriter], cmd: xpb.OperationCommand) -> None:
        reader, writer = stream
        cmd.command_id = next(ids)
        data = cmd.SerializeToString()
        writer.write(_FRAME.pack(len(data)) + data)
        await writer.drain()
        (size,) = _FRAME.unpack(await reader.readexactly(_FRAME.size))
        assert xpb.OperationEvent.FromString(await reader.readexactly(size)).command_id == cmd.command_id

    cpu = await _switches(streams, commands, one, switches)
    for _, writer in streams:
        writer.close()
    return cpu


async def _switches(streams: list, commands: list, one, switches: int) -> float:
    """CPU seconds of this process (all its threads) over ``switches`` switches, after the warm-up ones."""
    t0 = 0.0
    for i in range(WARMUP_SWITCHES + switches):
        if i == WARMUP_SWITCHES:
            t0 = time.process_time()
        for which in (0, 1):  # every sampler's sleep, then every sampler's wake
            await asyncio.gather(*(one(s, c[which]) for s, c in zip(streams, commands, strict=True)))
    return time.process_time() - t0


def measure(samplers: int, switches: int, spread_s: float, transport: str = "grpc") -> dict:
    """Run the servers in a child process and the client here; returns the figures (module doc)."""
    return measure_each((samplers,), switches, spread_s, transport)[0]


def measure_each(samplers: tuple[int, ...], switches: int, spread_s: float, transport: str = "grpc") -> list[dict]:
    """:func:`measure` at each N of ``samplers``, one after the other, against one child process serving
    ``max(samplers)`` do-nothing servers: each measurement streams to the first N of them (the others sit idle in
    that process and cost the measured client nothing), so the child starts once, not once per N. Raises
    RuntimeError when the servers did not start."""
    most = max(samplers)
    server = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.stream_floor", "--serve", "--samplers", str(most), "--spread-ms",
         str(spread_s * 1000), "--transport", transport],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    out = []
    try:
        assert server.stdout is not None
        ports = [int(p) for p in server.stdout.readline().split()]
        if len(ports) != most:
            raise RuntimeError(
                f"stream floor: the servers did not start: got {len(ports)} ports of {most} (too many for this "
                "machine's open-file limit or memory? try fewer --samplers)"
            )
        client = _client_grpc if transport == "grpc" else _client_tcp
        for n in samplers:
            cpu = asyncio.run(client(ports[:n], switches))
            out.append(
                {
                    "transport": transport,
                    "samplers": n,
                    "switches": switches,
                    "spread_ms": spread_s * 1000,
                    "cpu_ms_per_switch": cpu * 1000 / switches,
                    "cpu_ms_per_sampler_switch": cpu * 1000 / switches / n,
                }
            )
    finally:
        if server.stdin is not None:
            server.stdin.close()
        try:
            server.wait(10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.stream_floor",
        description=__doc__.split("\n")[0],
        epilog="Prints one JSON object: cpu_ms_per_switch (the client process's CPU, every thread, ms per switch) and "
        "cpu_ms_per_sampler_switch (the same divided by --samplers); --out also writes it to a file. "
        "benchmarks.scale runs this after its own runs, as the floor of its marginal orchestrator CPU.",
    )
    ap.add_argument("--samplers", type=number(int, 1), default=128, help="streams, one per sampler (default 128)")
    ap.add_argument("--switches", type=number(int, 1), default=20, help="switches measured, after 2 warm-up (default 20)")
    ap.add_argument(
        "--spread-ms",
        type=number(float, 0, MAX_SPREAD_MS, " ms"),
        default=300.0,
        help="answers come uniformly over [0, this] ms after a command (default 300)",
    )
    ap.add_argument("--transport", choices=("grpc", "tcp"), default="grpc", help="grpc.aio (default) or plain asyncio TCP")
    ap.add_argument("--out", type=Path, help="also write the JSON object to this file")
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.serve:
        asyncio.run(_serve(a.samplers, a.spread_ms / 1000, a.transport))
        return 0
    if a.out is not None:
        prepare_out(ap, a.out, "stream_floor.json")
    text = json.dumps(measure(a.samplers, a.switches, a.spread_ms / 1000, a.transport))
    if a.out is not None:
        a.out.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
