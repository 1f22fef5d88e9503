"""The gate's own Python per request on the fast path, in one process, without the network.

    .venv/bin/python -m benchmarks.gate_check_cost --out /tmp/gate-cost/gate_check_cost.json [--checks 50000]

``benchmarks.router_overhead`` measures the gate process's CPU per request behind a real Envoy; on a 2-core machine
shared by five processes (wrk, two Envoys, picker, gate) that figure swings by ±10 % between runs and does not say
which part is the gate's own code. This one times the two halves of a request's path through the gate's Python on
uvloop, in a real :class:`~epp_plugin.gate.server.GateServer` (one pool, one SERVING endpoint):

* ``check_us``: one HTTP ext_authz check fed to the gate's ``AuthzProtocol`` (httptools parse and header callbacks,
  admission, subset hint answer, bookkeeping) on a transport that records the answer. The check's bytes are those
  Envoy 1.40 sends with the rendered config (method, path, ``host``, ``content-length``, the pool and Envoy id
  headers, ``x-envoy-internal``, ``x-envoy-expected-rq-timeout-ms``: captured from a real Envoy on this machine);
* ``completion_us``: the request's two access-log entries (``UpstreamPoolReady``, then ``DownstreamEnd``) through the
  gate's ``StreamAccessLogs``, decoded from serialized ``StreamAccessLogsMessage`` batches of ``--batch`` requests
  (44 by default: what Envoy sent per 20 ms flush at ~2,200 requests/s). The entries are those Envoy 1.40 writes
  for such a request (captured here: 268 and 567 bytes), each with its own admission id;
* ``floor_check_us``: the baseline, same run: a protocol that only parses the check with httptools and writes a
  fixed answer (what ``benchmarks/authz_floor.py`` serves to Envoy); ``check_ratio_to_floor`` = ``check_us`` /
  ``floor_check_us``.

Checks and completions alternate as in the gate (a batch of checks, then their access-log message), so one batch of
admissions is open at a time. Medians of ``--rounds`` rounds. Also reported: garbage-collector passes and their time
per request (``gc.callbacks``, over the whole round: the harness's building of the messages included, so an upper
bound). What is *not* in these figures and is in the process figure: the socket reads and writes, the
event loop's wake-ups, the access log's gRPC receive, and running with cold caches between other processes; the
difference between ``benchmarks.router_overhead``'s ``gate_cpu_us_per_request`` and ``check_us + completion_us``
is that share (docs/decisions/gate-cpu-per-request.md).
Writes the JSON, a PNG (bars) and a text summary beside ``--out``.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import secrets
import statistics
import string
import time
from pathlib import Path

import uvloop
from envoy.data.accesslog.v3 import accesslog_pb2
from envoy.service.accesslog.v3 import als_pb2
from google.protobuf import text_format

from benchmarks.authz_floor import FloorCheck, floor_answer
from benchmarks.report import prepare_out, write_summary
from epp_plugin.gate.pool_state import EndpointState
from epp_plugin.gate.server import GateConfig, GateServer
from llmd_timeslice import protocol

ENDPOINT = "127.0.0.1:28652"
CHECK = (
    f"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1:31268\r\ncontent-length: 0\r\n{protocol.POOL_HEADER}: default\r\n"
    f"{protocol.ENVOY_ID_HEADER}: envoy-f377e8d884d0\r\nx-envoy-internal: true\r\nx-envoy-expected-rq-timeout-ms: 610000\r\n\r\n"
).encode()
"""An ext_authz check as Envoy 1.40 sends it with the rendered fast-path config (captured here)."""
_ADMISSION_MARK = protocol.ADMISSION_HEADER.encode() + b": "


class _Recorder:
    """The transport half the protocols use: records what they write."""

    def __init__(self) -> None:
        self.out: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.out.append(data)

    def close(self) -> None:
        pass


_UPSTREAM_READY_ENTRY = (
    "common_properties { downstream_remote_address { $client } downstream_local_address { $listener }"
    " start_time { seconds: 1796221169 nanos: 407813000 } upstream_remote_address { $engine }"
    ' upstream_local_address { $upstream_local } upstream_cluster: "endpoints" downstream_direct_remote_address { $client }'
    " intermediate_log_entry: true downstream_wire_bytes_received: 55 access_log_type: UpstreamPoolReady }"
    ' protocol_version: HTTP11 request { request_method: POST scheme: "http" authority: "127.0.0.1:25785"'
    ' path: "/v1/completions" request_id: "d551bab1-50ed-4ab1-83e0-db61b041b297" request_headers_bytes: 252'
    " downstream_header_bytes_received: 22 } response { }"
)
_METADATA = (
    'metadata { filter_metadata { key: "envoy.lb" value { fields { key: "x-gateway-destination-endpoint"'
    ' value { string_value: "$endpoint" } } } } filter_metadata { key: "envoy.lb.subset_hint" value { fields {'
    ' key: "x-gateway-destination-endpoint-subset" value { list_value { values { string_value: "$endpoint" } } } } } } }'
)
_END_ENTRY = (
    "common_properties { downstream_remote_address { $client } downstream_local_address { $listener }"
    " start_time { seconds: 1796221169 nanos: 435044000 } time_to_last_rx_byte { nanos: 8365 }"
    " time_to_first_upstream_tx_byte { nanos: 4116100 } time_to_last_upstream_tx_byte { nanos: 4116221 }"
    " time_to_first_upstream_rx_byte { nanos: 4651449 } time_to_last_upstream_rx_byte { nanos: 4668842 }"
    " time_to_first_downstream_tx_byte { nanos: 4662524 } time_to_last_downstream_tx_byte { nanos: 4673288 }"
    ' upstream_remote_address { $engine } upstream_local_address { $upstream_local } upstream_cluster: "endpoints" $metadata'
    " downstream_direct_remote_address { $client } duration { nanos: 4674823 } upstream_request_attempt_count: 1"
    ' stream_id: "8c2eaa1c-cba7-4a5c-acca-a25b6721eb7f" downstream_wire_bytes_sent: 198'
    " downstream_wire_bytes_received: 55 upstream_wire_bytes_sent: 262 upstream_wire_bytes_received: 128"
    ' access_log_type: DownstreamEnd } protocol_version: HTTP11 request { request_method: POST scheme: "http"'
    ' authority: "127.0.0.1:25785" path: "/v1/completions" request_id: "8c2eaa1c-cba7-4a5c-acca-a25b6721eb7f"'
    " request_headers_bytes: 253 upstream_header_bytes_sent: 230 downstream_header_bytes_received: 22 }"
    " response { response_code { value: 200 } response_headers_bytes: 154 response_body_bytes: 11"
    ' response_code_details: "via_upstream" upstream_header_bytes_received: 94 downstream_header_bytes_sent: 168 }'
)
"""The two entries Envoy 1.40 writes for a fast-path request whose EPP picked by the subset hint (the router's
``UpstreamPoolReady``, then the HCM's ``DownstreamEnd``), as captured from a real Envoy on this machine: 268 and
567 bytes; the logged admission header is added per request."""


def _addr(host: str, port: int) -> str:
    return f'socket_address {{ address: "{host}" port_value: {port} }}'


def _parse(template: str, **fields: str) -> accesslog_pb2.HTTPAccessLogEntry:
    return text_format.Parse(string.Template(template).substitute(fields), accesslog_pb2.HTTPAccessLogEntry())


def entry_templates() -> tuple[accesslog_pb2.HTTPAccessLogEntry, accesslog_pb2.HTTPAccessLogEntry]:
    """The ``UpstreamPoolReady`` and ``DownstreamEnd`` entries of :data:`_UPSTREAM_READY_ENTRY` / :data:`_END_ENTRY`,
    upstream at :data:`ENDPOINT`, without an admission."""
    host, port = ENDPOINT.rsplit(":", 1)
    engine, listener = _addr(host, int(port)), _addr("127.0.0.1", 25785)
    ready = _parse(
        _UPSTREAM_READY_ENTRY,
        client=_addr("127.0.0.1", 56922),
        listener=listener,
        engine=engine,
        upstream_local=_addr("127.0.0.1", 56346),
    )
    end = _parse(
        _END_ENTRY,
        client=_addr("127.0.0.1", 56892),
        listener=listener,
        engine=engine,
        upstream_local=_addr("127.0.0.1", 56336),
        metadata=string.Template(_METADATA).substitute(endpoint=ENDPOINT),
    )
    return ready, end


def _message(templates: tuple[accesslog_pb2.HTTPAccessLogEntry, ...], admissions: list[str]) -> bytes:
    """One serialized ``StreamAccessLogsMessage``: per admission, each template's entry logging its id."""
    msg = als_pb2.StreamAccessLogsMessage()
    for aid in admissions:
        for template in templates:
            e = msg.http_logs.log_entry.add()
            e.CopyFrom(template)
            e.request.request_headers[protocol.ADMISSION_HEADER] = aid
    return msg.SerializeToString()


class _GcClock:
    """Garbage-collector passes and seconds, from ``gc.callbacks``."""

    def __init__(self) -> None:
        self.passes, self.seconds, self._t0 = 0, 0.0, 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.passes += 1
            self.seconds += time.perf_counter() - self._t0


async def measure(checks: int, batch: int, rounds: int) -> dict:
    """Run the rounds; returns the figures (module doc)."""
    gate = GateServer(
        GateConfig(
            ext_proc_port=0,
            authz_port=0,
            control_port=0,
            pools=["default"],
            default_pool="default",
            token=secrets.token_hex(16),  # its control port is served too; nobody calls it here
        )
    )
    await gate.start()
    try:
        gate.pools["default"].set_states([(ENDPOINT, EndpointState.SERVING, 0)])
        assert gate.authz is not None and gate.access_log is not None
        proto, sent = gate.authz.protocol(), _Recorder()
        proto.connection_made(sent)
        floor_sent = _Recorder()
        floor = FloorCheck(floor_answer(ENDPOINT, hint=True))  # the answer shape of an admission for an EPP
        floor.connection_made(floor_sent)
        templates = entry_templates()
        clock = _GcClock()
        gc.callbacks.append(clock)
        rows = []
        try:
            for _ in range(rounds + 1):  # the first round warms up and is dropped
                check_s = completion_s = 0.0
                gc_passes, gc_s = clock.passes, clock.seconds
                # As in the gate: a batch of checks, then their completions in one access-log message, so about
                # one batch of admissions is open at a time (not every check of the round).
                for lo in range(0, checks, batch):
                    n = min(batch, checks - lo)
                    sent.out.clear()
                    t0 = time.perf_counter()
                    for _ in range(n):
                        proto.data_received(CHECK)
                    t1 = time.perf_counter()
                    admissions = [a.split(_ADMISSION_MARK, 1)[1].split(b"\r\n", 1)[0].decode() for a in sent.out]
                    if len(admissions) != n or len(gate.book) != n:
                        raise RuntimeError(f"{len(admissions)} answers and {len(gate.book)} open admissions for {n} checks")
                    raw = _message(templates, admissions)
                    t2 = time.perf_counter()
                    await gate.access_log.StreamAccessLogs(_one(raw), None)
                    t3 = time.perf_counter()
                    if len(gate.book):
                        raise RuntimeError(f"{len(gate.book)} admissions left open after their completions")
                    check_s += t1 - t0
                    completion_s += t3 - t2
                # The collector runs where an allocation crosses its threshold, often in the untimed building of
                # the messages: counted over the whole round, so an upper bound of the gate's own share.
                passes = clock.passes - gc_passes
                spent = clock.seconds - gc_s
                floor_sent.out.clear()
                t4 = time.perf_counter()
                for _ in range(checks):
                    floor.data_received(CHECK)
                t5 = time.perf_counter()
                rows.append(
                    {
                        "check_us": check_s / checks * 1e6,
                        "completion_us": completion_s / checks * 1e6,
                        "floor_check_us": (t5 - t4) / checks * 1e6,
                        "gc_passes_per_1000_requests": passes / checks * 1000,
                        "gc_us_per_request": spent / checks * 1e6,
                    }
                )
        finally:
            gc.callbacks.remove(clock)
        rows = rows[1:]
        med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        return {
            "checks": checks,
            "batch": batch,
            "rounds": rounds,
            "entry_bytes": len(raw) / (2 * n),
            "python": platform.python_version(),
            **med,
            "total_us": med["check_us"] + med["completion_us"],
            "check_ratio_to_floor": med["check_us"] / med["floor_check_us"],
            "per_round": rows,
        }
    finally:
        await gate.stop()


async def _one(raw: bytes):
    yield als_pb2.StreamAccessLogsMessage.FromString(raw)


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = ["floor check", "gate check", "gate completion\n(2 entries)", "gate total"]
    values = [res["floor_check_us"], res["check_us"], res["completion_us"], res["total_us"]]
    fig, ax = plt.subplots(figsize=(7, 3.6))
    bars = ax.bar(names, values, color=["#999999", "#1f77b4", "#2ca02c", "#d62728"])
    for b, v in zip(bars, values, strict=True):
        ax.annotate(f"{v:.2f} µs", (b.get_x() + b.get_width() / 2, v), ha="center", va="bottom")
    ax.set_ylabel("µs of CPU per request (one process, no network)")
    ax.set_title(f"The gate's own Python per request ({res['checks']} checks, median of {res['rounds']} rounds)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.gate_check_cost", description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="JSON file to write (.png and .txt beside it)")
    ap.add_argument("--checks", type=int, default=50_000, help="checks per round (default 50000)")
    ap.add_argument("--batch", type=int, default=44, help="requests per access-log message (default 44)")
    ap.add_argument("--rounds", type=int, default=5, help="rounds after one warm-up round, medians reported (default 5)")
    args = ap.parse_args(argv)
    if args.checks < 1 or args.batch < 1 or args.rounds < 1:
        ap.error(f"--checks, --batch and --rounds must be >= 1, got {args.checks}, {args.batch}, {args.rounds}")
    prepare_out(ap, args.out, "gate_check_cost.json")
    res = uvloop.run(measure(args.checks, args.batch, args.rounds))
    args.out.write_text(json.dumps(res, indent=2))
    plot(res, args.out.with_suffix(".png"))
    write_summary(
        args.out,
        [
            f"benchmarks.gate_check_cost: {res['checks']} checks x {res['rounds']} rounds, access log {res['batch']} "
            f"requests per message ({res['entry_bytes']:.0f} bytes per entry), Python {res['python']}",
            f"  check {res['check_us']:.2f} us, completion {res['completion_us']:.2f} us: gate total {res['total_us']:.2f} us "
            "per request",
            f"  floor check {res['floor_check_us']:.2f} us: check_ratio_to_floor {res['check_ratio_to_floor']:.1f}",
            f"  garbage collector (harness included): {res['gc_passes_per_1000_requests']:.1f} passes per 1,000 requests, "
            f"{res['gc_us_per_request']:.2f} us per request",
        ],
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
