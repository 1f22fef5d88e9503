"""Bad input, generated (hypothesis): the gate's ExternalProcessor stream (malformed and out-of-order
messages, huge headers, missing or unknown pools) and the control APIs (invalid ids, negative or absurd
numbers, unknown enum values). Every call ends with a response or a gRPC status other than INTERNAL /
UNKNOWN (a crash), nothing is left held or in flight, and the servers keep serving a well-formed call. Every
answer is predicted from the input and asserted: the ExternalProcessor stream's from its phases
(docs/architecture.md): which answer each message gets, the refusal that ends a stream, the error naming the first
message out of phase; each control call's status code from the API's checks in their order (and, where it is
accepted, what it returns).
Crashes found here become named tests (tests/test_bad_input.py)."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import grpc
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as xp
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as xp_grpc
from google.protobuf import struct_pb2
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from epp_plugin.gate.pool_state import EndpointState
from epp_plugin.gate.server import GateConfig, GateServer
from llmd_timeslice import protocol
from llmd_timeslice.api.llmd_timeslice.v1alpha1 import gate_control_pb2 as gpb
from llmd_timeslice.api.llmd_timeslice.v1alpha1 import gate_control_pb2_grpc as gpb_grpc
from llmd_timeslice.api.llmd_timeslice.v1alpha1 import lease_pb2, lease_pb2_grpc, weights_pb2, weights_pb2_grpc
from llmd_timeslice.api.llmd_timeslice.v1alpha1 import orchestrator_info_pb2 as ipb
from llmd_timeslice.api.llmd_timeslice.v1alpha1 import orchestrator_info_pb2_grpc as ipb_grpc
from llmd_timeslice.api.llmd_timeslice.v1alpha1 import snapshot_ext_pb2 as xpb
from llmd_timeslice.api.llmd_timeslice.v1alpha1 import snapshot_ext_pb2_grpc as xpb_grpc
from llmd_timeslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as spb
from llmd_timeslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2_grpc as spb_grpc
from llmd_timeslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2 as opb
from llmd_timeslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2_grpc as opb_grpc
from llmd_timeslice.domain.inventory import Inventory
from llmd_timeslice.orchestrator.server import OrchestratorServer
from llmd_timeslice.orchestrator.switch import SwitchActions
from llmd_timeslice.snapshot.backends.vllm import VllmBackend
from llmd_timeslice.snapshot.server import SidecarServer
from tests.support.fake_engines import FakeVllm

TOKEN = "fuzz"
MD = (("authorization", f"Bearer {TOKEN}"),)
CRASH = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}
FUZZ = settings(
    max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)

text = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=40)
ints = st.one_of(st.integers(-(2**63), 2**63 - 1), st.sampled_from([0, -1, 1, 2**31, -(2**31)]))


class NoopActions(SwitchActions):
    async def suspend_samplers(self, spec, record) -> None:
        await asyncio.sleep(0)

    async def resume_samplers(self, spec, record) -> None:
        await asyncio.sleep(0)


class Servers:
    """Gate, orchestrator and a sidecar in their own event loop thread (the tests call them with sync stubs)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(60)

    async def _start(self) -> None:
        self.engine = FakeVllm().start()
        self.gate = GateServer(GateConfig(ext_proc_port=0, control_port=0, token=TOKEN, max_hold_s=0.3, max_held=50))
        await self.gate.start()
        self.gate.pools["default"].set_states([("10.0.0.1:8000", EndpointState.SERVING, 3)])
        inv = Inventory.model_validate(
            {
                "groups": [
                    {
                        "group_id": "g",
                        "samplers": [{"pool": "default", "address": "10.0.0.1:8000", "sidecar": "127.0.0.1:1", "job_id": "s"}],
                    },
                    {"group_id": "t"},
                ]
            }
        )
        self.orch = OrchestratorServer(inv, port=0, token=TOKEN, actions=NoopActions())
        await self.orch.start()
        # A second gate subscribed to the orchestrator's state stream (the one writer of a gate's states).
        self.subscriber = GateServer(
            GateConfig(ext_proc_port=0, control_port=0, token=TOKEN, orchestrator=f"127.0.0.1:{self.orch.port}", gate_id="fz")
        )
        await self.subscriber.start()
        await asyncio.wait_for(self.subscriber.subscription.connected.wait(), 30)
        self.sidecar = SidecarServer(
            {"s": VllmBackend(self.engine.url, idle_timeout_s=0.2)}, port=0, token=TOKEN, operation_timeout_s=2
        )
        await self.sidecar.start()

    async def _stop(self) -> None:
        await self.sidecar.stop()
        await self.subscriber.stop()
        await self.orch.stop()
        await self.gate.stop()
        self.engine.stop()


@pytest.fixture(scope="module")
def servers():
    s = Servers()
    s.run(s._start())
    chans = {
        "ext_proc": grpc.insecure_channel(f"127.0.0.1:{s.gate.ext_proc_port}"),
        "control": grpc.insecure_channel(f"127.0.0.1:{s.gate.control_port}"),
        "subscriber": grpc.insecure_channel(f"127.0.0.1:{s.subscriber.control_port}"),
        "orch": grpc.insecure_channel(f"127.0.0.1:{s.orch.port}"),
        "sidecar": grpc.insecure_channel(f"127.0.0.1:{s.sidecar.port}"),
    }
    s.chans = chans
    yield s
    for ch in chans.values():
        ch.close()
    s.run(s._stop())
    s.loop.call_soon_threadsafe(s.loop.stop)
    s.thread.join(10)


def _call(call) -> tuple[grpc.StatusCode, object, str]:
    """``(status code, response or None, details)`` of one call; a crash status fails the test at once."""
    try:
        resp = call()
    except grpc.RpcError as exc:
        assert exc.code() not in CRASH, f"{exc.code().name}: {exc.details()}"
        return exc.code(), None, exc.details() or ""
    return grpc.StatusCode.OK, resp, ""


def _code(call) -> grpc.StatusCode:
    return _call(call)[0]


OK = grpc.StatusCode.OK
INVALID = grpc.StatusCode.INVALID_ARGUMENT
NOT_FOUND = grpc.StatusCode.NOT_FOUND
PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION


# ------------------------------------------------------------------------------------------ ext_proc
def _headers(pairs, eos):
    hm = base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k, raw_value=v) for k, v in pairs])
    return xp.HttpHeaders(headers=hm, end_of_stream=eos)


header_name = st.one_of(
    st.sampled_from([":path", ":method", "content-type", protocol.MIN_WEIGHT_VERSION_HEADER, "x-request-id"]),
    st.from_regex(r"[a-z][a-z0-9-]{0,30}", fullmatch=True),
)
header_value = st.one_of(
    st.binary(max_size=64),
    st.sampled_from([b"3", b"-1", b"99999999999999999999", b"", b"abc"]),
    st.integers(1, 200_000).map(lambda n: b"x" * n),
)
headers = st.lists(st.tuples(header_name, header_value), max_size=6)
served = st.one_of(st.none(), st.just("10.0.0.1:8000"), text)


def _response_headers(addr) -> xp.ProcessingRequest:
    req = xp.ProcessingRequest(response_headers=_headers([(":status", b"200")], False))
    if addr is not None:
        req.attributes[protocol.EXT_PROC_ATTRIBUTES_NAMESPACE].CopyFrom(
            struct_pb2.Struct(fields={protocol.UPSTREAM_ADDRESS_ATTRIBUTE: struct_pb2.Value(string_value=addr)})
        )
    return req


message = st.one_of(
    st.builds(lambda h, e: xp.ProcessingRequest(request_headers=_headers(h, e)), headers, st.booleans()),
    st.builds(
        lambda b, e: xp.ProcessingRequest(request_body=xp.HttpBody(body=b, end_of_stream=e)),
        st.binary(max_size=2048),
        st.booleans(),
    ),
    st.just(xp.ProcessingRequest(request_trailers=xp.HttpTrailers())),
    st.builds(_response_headers, served),
    st.builds(lambda b: xp.ProcessingRequest(response_body=xp.HttpBody(body=b)), st.binary(max_size=256)),
    st.just(xp.ProcessingRequest(response_trailers=xp.HttpTrailers())),
    st.just(xp.ProcessingRequest()),  # no message set at all
)
pool_md = st.one_of(st.none(), st.sampled_from(["default", "", "nope"]), st.from_regex(r"[a-z0-9-]{1,20}", fullmatch=True))


def _expected_ext_proc(msgs, pool) -> tuple[list[str], grpc.StatusCode]:
    """What the gate must answer to ``msgs`` (docs/gate.md, the ext_proc edge's stream phases): one answer per
    message its stream phase takes, named by its oneof (``request_headers``: the subset hint; a refusal:
    ``immediate_response:<reason>``, which ends the stream), and the stream's final status
    (FAILED_PRECONDITION / INVALID_ARGUMENT for the first message out of phase)."""
    pool_name = "default" if pool is None else pool
    phase, out = "new", []
    accepted = {
        "new": {"request_headers"},
        "admitted": {"request_body", "request_trailers", "response_headers"},
        "responding": {"request_body", "request_trailers", "response_body", "response_trailers"},
    }
    for m in msgs:
        which = m.WhichOneof("request")
        if which not in accepted[phase]:
            return out, grpc.StatusCode.INVALID_ARGUMENT if which is None else grpc.StatusCode.FAILED_PRECONDITION
        if which == "request_headers":
            if pool_name != "default":
                return [*out, "immediate_response:unknown_pool"], grpc.StatusCode.OK
            raw = None
            for h in m.request_headers.headers.headers:
                if h.key == protocol.MIN_WEIGHT_VERSION_HEADER:
                    raw = h.raw_value.decode("utf-8", "replace")
            try:
                min_version = 0 if raw is None else int(raw)
            except ValueError:
                return [*out, "immediate_response:bad_min_weight_version"], grpc.StatusCode.OK
            if min_version > 3:  # the only endpoint serves weight version 3: held, then 503 at max_hold_s
                return [*out, "immediate_response:hold_expired"], grpc.StatusCode.OK
            phase = "admitted"
        elif which == "response_headers":
            phase = "responding"
        out.append(which)
    return out, grpc.StatusCode.OK


def _answer_name(resp) -> str:
    which = resp.WhichOneof("response")
    return f"{which}:{resp.immediate_response.details}" if which == "immediate_response" else str(which)


@FUZZ
@given(msgs=st.lists(message, max_size=7), pool=pool_md)
@example(
    msgs=[xp.ProcessingRequest(request_headers=_headers([(protocol.MIN_WEIGHT_VERSION_HEADER, b"\x80")], False))], pool="default"
)  # found by this test; tests/test_bad_input.py
@example(msgs=[xp.ProcessingRequest(request_headers=_headers([], False))] * 2, pool=None)
@example(msgs=[_response_headers("10.0.0.1:8000")], pool="default")
def test_fuzz_ext_proc_stream_gets_the_answers_its_phases_call_for_and_leaves_nothing_behind(servers, msgs, pool):
    """Each message the stream's phase takes gets its answer, in order (a refusal ends the stream); the first one
    out of phase ends it with FAILED_PRECONDITION (INVALID_ARGUMENT for an empty message) naming it; nothing stays
    held or in flight."""
    stub = xp_grpc.ExternalProcessorStub(servers.chans["ext_proc"])
    md = () if pool is None else ((protocol.POOL_METADATA_KEY, pool),)
    want, want_code = _expected_ext_proc(msgs, pool)
    resps, code = [], grpc.StatusCode.OK
    try:
        resps.extend(stub.Process(iter(msgs), metadata=md, timeout=5))
    except grpc.RpcError as exc:
        assert exc.code() not in CRASH, f"{exc.code().name}: {exc.details()}"
        code = exc.code()
        assert exc.details().startswith("out_of_phase: "), exc.details()
    assert ([_answer_name(r) for r in resps], code) == (want, want_code)
    for resp, m in zip(resps, msgs, strict=False):  # one answer per message up to the last
        if resp.HasField("response_headers"):
            attrs = m.attributes.get(protocol.EXT_PROC_ATTRIBUTES_NAMESPACE)
            served = attrs.fields[protocol.UPSTREAM_ADDRESS_ATTRIBUTE].string_value if attrs is not None else None
            set_headers = {h.header.key: h.header.raw_value for h in resp.response_headers.response.header_mutation.set_headers}
            assert set_headers.get(protocol.WEIGHT_VERSION_HEADER) == (b"3" if served == "10.0.0.1:8000" else None)
    default = servers.gate.pools["default"]
    servers.run(_settle(default))
    assert default.live == 0 and default.held == 0


async def _settle(pool, timeout_s: float = 3.0) -> None:
    for _ in range(int(timeout_s / 0.01)):
        if pool.live == 0 and pool.held == 0:
            return
        await asyncio.sleep(0.01)


def test_after_fuzzing_ext_proc_a_well_formed_request_is_admitted(servers):
    stub = xp_grpc.ExternalProcessorStub(servers.chans["ext_proc"])
    msgs = [
        xp.ProcessingRequest(request_headers=_headers([(":path", b"/v1/completions")], True)),
        _response_headers("10.0.0.1:8000"),
    ]
    out = list(stub.Process(iter(msgs), metadata=((protocol.POOL_METADATA_KEY, "default"),), timeout=5))
    hint = out[0].dynamic_metadata.fields[protocol.SUBSET_HINT_NAMESPACE].struct_value
    assert [v.string_value for v in hint.fields[protocol.SUBSET_HINT_KEY].list_value.values] == ["10.0.0.1:8000"]
    assert servers.gate.pools["default"].endpoints["10.0.0.1:8000"].weight_version == 3


# ----------------------------------------------------------------------------------------- control APIs
# Each call's answer is predicted from the API's rules (docs/api.md and the servicers' checks, in their order) and
# asserted: the status code, and for an accepted call what it returns.
def _expected_states(before: dict, states) -> dict[str, tuple[int, int]]:
    """The state stream's update of one pool, as the gate applies it: endpoints in order, each with a state of
    SERVING..WAKING (1-4) at its state and weight version, one with any other state skipped (an unknown enum value
    from a newer orchestrator; the orchestrator validates addresses). ``before``: address -> (state, version)."""
    out = dict(before)
    for address, state, version in states:
        if state in (1, 2, 3, 4):
            out[address] = (state, version)
    return out


@FUZZ
@given(pool=text, states=st.lists(st.tuples(text, st.integers(-5, 50), ints), max_size=4))
def test_fuzz_gate_state_stream_updates(servers, pool, states):
    """Bad updates on the state stream (unknown states, odd addresses and versions, any pool name): the gate acks
    every epoch, applies what its rules predict, and keeps answering its control API."""
    stub = gpb_grpc.GateControlServiceStub(servers.chans["subscriber"])
    name = f"fz-{pool}"
    gate = servers.subscriber
    held = gate.pools.get(name)
    before = {a: (int(_WIRE[e.state]), e.weight_version) for a, e in held.endpoints.items()} if held is not None else {}
    epoch, laggards = servers.run(servers.orch.hub.publish(name, [(a, s, v) for a, s, v in states]))
    assert laggards == [] and gate.subscription.synced_epoch >= epoch, (laggards, gate.subscription.synced_epoch, epoch)
    want = _expected_states(before, states)
    got = stub.GetPoolStatus(gpb.GetPoolStatusRequest(pool=name), metadata=MD, timeout=5)
    assert {e.address: (e.state, e.weight_version) for e in got.endpoints} == want
    assert _code(lambda: stub.ListPools(gpb.ListPoolsRequest(), metadata=MD, timeout=5)) == OK


_WIRE = {
    EndpointState.SERVING: gpb.ENDPOINT_STATE_SERVING,
    EndpointState.DRAINING: gpb.ENDPOINT_STATE_DRAINING,
    EndpointState.ASLEEP: gpb.ENDPOINT_STATE_ASLEEP,
    EndpointState.WAKING: gpb.ENDPOINT_STATE_WAKING,
}


def _ids_refusal(job: str, group: str) -> grpc.StatusCode | None:
    """The orchestrator's id checks, in their order: a job id, a group id, a known group."""
    if not job or not group:
        return INVALID
    return None if group in ("g", "t") else NOT_FOUND


def _settled(stub, group: str) -> opb.GetGroupStatusResponse:
    """Group status once no switch is in flight and nobody waits (an acquire that gave up has left the queue)."""
    for _ in range(500):
        st_ = stub.GetGroupStatus(opb.GetGroupStatusRequest(group_id=group), metadata=MD, timeout=5)
        if st_.group.group_state != opb.GroupStatus.STATE_SWITCHING and not st_.group.waiter_queue_depth:
            return st_
        time.sleep(0.01)
    raise AssertionError(f"group {group} did not settle: {st_}")


def _yield_token(token_md: str | None) -> int | None:
    """What the orchestrator reads from the fencing-token metadata (not an integer: -1, refused)."""
    if token_md is None:
        return None
    try:
        return int(token_md)
    except ValueError:
        return -1


@FUZZ
@given(
    job=text,
    group=st.one_of(text, st.sampled_from(["g", "t"])),
    timeout=st.floats(0.01, 0.3),
    token=ints,
    token_md=st.one_of(st.none(), st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=30)),
)
def test_fuzz_orchestrator_acquire_yield_lease(servers, job, group, timeout, token, token_md):
    stub = opb_grpc.TimeSliceOrchestratorServiceStub(servers.chans["orch"])
    leases = lease_pb2_grpc.LeaseServiceStub(servers.chans["orch"])
    md = MD if token_md is None else (*MD, ("x-llmd-timeslice-fencing-token", token_md))  # printable: gRPC's rule
    refused = _ids_refusal(job, group)
    # Acquire: a valid one is granted, or gives up at the caller's (short) deadline.
    code = _code(lambda: stub.Acquire(opb.AcquireRequest(job_id=job, group_id=group), metadata=MD, timeout=timeout))
    # (The caller's deadline, 10-300 ms, may pass before even a refusal comes back on a loaded machine.)
    assert code in {refused or OK, grpc.StatusCode.DEADLINE_EXCEEDED}, code
    holds = code == OK or (refused is None and _settled(stub, group).group.locking_job == job)
    # GetLease: the holder's lease, else NOT_HOLDER.
    code, lease, _ = _call(lambda: leases.GetLease(lease_pb2.GetLeaseRequest(job_id=job, group_id=group), metadata=MD, timeout=5))
    assert code == (refused or (OK if holds else PRECONDITION)), code
    if code == OK:
        assert lease.job_id == job and lease.group_id == group and lease.fencing_token > 0
    # Heartbeat: the token is checked first (positive), then the ids, then that it is the holder's current token.
    code = _code(
        lambda: leases.Heartbeat(
            lease_pb2.HeartbeatRequest(job_id=job, group_id=group, fencing_token=token), metadata=MD, timeout=5
        )
    )
    armed = holds and lease is not None and token == lease.fencing_token
    assert code == (INVALID if token <= 0 else refused or (OK if armed else PRECONDITION)), code
    # Yield: a fencing token in the metadata must be a positive integer; the holder's own (or none while unarmed).
    ytoken = _yield_token(token_md)
    code = _code(lambda: stub.Yield(opb.YieldRequest(job_id=job, group_id=group), metadata=md, timeout=5))
    if ytoken is not None and ytoken <= 0:
        want = INVALID
    elif refused:
        want = refused
    elif not holds:
        want = PRECONDITION
    elif ytoken is not None:
        want = OK if lease is not None and ytoken == lease.fencing_token else PRECONDITION
    else:
        want = PRECONDITION if armed else OK
    assert code == want, (code, want)
    released = code == OK
    code, status, _ = _call(lambda: stub.GetGroupStatus(opb.GetGroupStatusRequest(group_id=group), metadata=MD, timeout=5))
    assert code == (INVALID if not group else OK if group in ("g", "t") else NOT_FOUND), code
    if code == OK:
        assert status.group.locking_job == (job if holds and not released else "")
    _free(stub, leases, job, group)


def _free(stub, leases, job: str, group: str) -> None:
    """Keep the group free for the next example: a grant can race the client's deadline, and a heartbeat with a
    guessed fencing token (tokens are small integers here) arms the lease, after which a yield needs the token."""
    try:
        lease = leases.GetLease(lease_pb2.GetLeaseRequest(job_id=job, group_id=group), metadata=MD, timeout=5)
    except grpc.RpcError:
        return  # not the holder (or an unknown group / invalid id): nothing to free
    md = (*MD, ("x-llmd-timeslice-fencing-token", str(lease.fencing_token)))
    stub.Yield(opb.YieldRequest(job_id=job, group_id=group), metadata=md, timeout=5)


def _valid_weights(version: int, source: str, location: str, info: str) -> bool:
    """WeightUpdate's rules (llmd_timeslice/weights/update.py): ``update_info_json`` empty or a JSON object, a
    version in [1, 2^62), a known source, a location for ``files``, update info for ``vllm_weight_transfer``."""
    try:
        parsed = json.loads(info) if info else {}
    except ValueError:
        return False
    if not isinstance(parsed, dict) or not 0 < version < 2**62 or source not in ("files", "vllm_weight_transfer"):
        return False
    return bool(location) if source == "files" else bool(parsed)


@FUZZ
@given(
    job=text,
    group=st.sampled_from(["g", "t", "zz", ""]),
    version=ints,
    source=st.one_of(text, st.sampled_from(["files", "vllm_weight_transfer"])),
    location=text,
    info=st.one_of(text, st.dictionaries(text, st.integers(), max_size=3).map(json.dumps)),
    token=ints,
    limit=ints,
)
def test_fuzz_weight_versions_and_switch_list(servers, job, group, version, source, location, info, token, limit):
    stub = weights_pb2_grpc.WeightVersionServiceStub(servers.chans["orch"])
    update = weights_pb2.WeightUpdate(version=version, source=source, location=location, update_info_json=info)
    req = weights_pb2.PublishWeightVersionRequest(job_id=job, group_id=group, fencing_token=token, weights=update)
    group_refusal = INVALID if not group else NOT_FOUND if group == "zz" else None
    # Publish: the token (>= 0), the update, the ids; then nobody here holds a group, so it is NOT_HOLDER.
    code = _code(lambda: stub.PublishWeightVersion(req, metadata=MD, timeout=5))
    if token < 0 or not _valid_weights(version, source, location, info) or not job:
        want = INVALID
    else:
        want = group_refusal or PRECONDITION
    assert code == want, (code, want)
    code, status, _ = _call(
        lambda: stub.GetWeightVersion(weights_pb2.GetWeightVersionRequest(group_id=group), metadata=MD, timeout=5)
    )
    assert code == (group_refusal or OK) and (status is None or status.group_id == group)
    info_stub = ipb_grpc.OrchestratorInfoServiceStub(servers.chans["orch"])
    wire_limit = max(-(2**31), min(limit, 2**31 - 1))
    code, listed, _ = _call(
        lambda: info_stub.ListSwitches(ipb.ListSwitchesRequest(limit=wire_limit, group_id=group), metadata=MD, timeout=5)
    )
    want = INVALID if wire_limit < 0 else (NOT_FOUND if group == "zz" else OK)  # "" lists every group
    assert code == want, (code, want)
    if code == OK:
        assert len(listed.switches) <= (wire_limit or 10) and all(not group or s.group_id == group for s in listed.switches)


def _expected_start(job: str, app: int, mode: int) -> grpc.StatusCode:
    """Snapshot / Restore with an ``app_endpoint`` config and no endpoints (docs/snapshot.md): a job id, then a
    known app (UNSPECIFIED, VLLM, SGLANG: 0-2), then a known suspend mode (0-2); then it starts an operation."""
    if not job or app not in (0, 1, 2) or mode not in (0, 1, 2):
        return INVALID
    return OK


@FUZZ
@given(
    job=st.one_of(text, st.just("s")),
    app=st.integers(-3, 20),
    mode=st.integers(-3, 20),
    op=text,
    wait=st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.floats(-10, 0.05)),
    version=ints,
    source=st.one_of(text, st.just("files")),
)
def test_fuzz_sidecar(servers, job, app, mode, op, wait, version, source):
    stub = spb_grpc.SnapshotAgentServiceStub(servers.chans["sidecar"])
    ext = xpb_grpc.SnapshotOperationsServiceStub(servers.chans["sidecar"])
    cfg = spb.BackendConfig(app_endpoint=spb.AppEndpointConfig(app=app, mode=mode))
    for call in (stub.Snapshot, stub.Restore):
        req_cls = spb.SnapshotRequest if call is stub.Snapshot else spb.RestoreRequest
        code, started, _ = _call(
            lambda c=call, r=req_cls: c(r(job_id=job, group="g", backend_config=cfg), metadata=MD, timeout=5)
        )
        assert code == _expected_start(job, app, mode), code
        if code == OK:  # the operation it started is known by its id
            got = stub.GetOperation(spb.GetOperationRequest(operation_id=started.operation_id), metadata=MD, timeout=5)
            assert started.operation_id and got.status != spb.OPERATION_STATUS_UNSPECIFIED
    # An operation id nobody was given is unknown (before its wait is checked).
    assert _code(lambda: stub.GetOperation(spb.GetOperationRequest(operation_id=op), metadata=MD, timeout=5)) == NOT_FOUND
    code = _code(lambda: ext.WaitOperation(xpb.WaitOperationRequest(operation_id=op, timeout_s=wait), metadata=MD, timeout=5))
    assert code == NOT_FOUND
    # RestoreWithWeights: the update first, then the job: only job "s" (the vLLM default) is served here.
    code = _code(
        lambda: ext.RestoreWithWeights(
            xpb.RestoreWithWeightsRequest(
                restore=spb.RestoreRequest(job_id=job, group="g"),
                weights=weights_pb2.WeightUpdate(version=version, source=source, location="/nowhere"),
            ),
            metadata=MD,
            timeout=5,
        )
    )
    valid = 0 < version < 2**62 and source == "files"
    assert code == (INVALID if not valid or not job else OK if job == "s" else NOT_FOUND), code
    code = _code(lambda: ext.GetServedWeightVersion(xpb.GetServedWeightVersionRequest(job_id=job), metadata=MD, timeout=5))
    assert code == (INVALID if not job else OK if job == "s" else NOT_FOUND), code
    status = stub.Status(spb.StatusRequest(), metadata=MD, timeout=5)
    assert job != "s" or any(j.job_id == "s" for j in status.job_statuses)


def test_after_fuzzing_the_control_apis_still_serve(servers):
    stub = opb_grpc.TimeSliceOrchestratorServiceStub(servers.chans["orch"])
    t = stub.GetGroupStatus(opb.GetGroupStatusRequest(group_id="t"), metadata=MD, timeout=5)
    assert not t.group.locking_job and not t.group.waiter_queue_depth, f"a fuzz example left group t held: {t}"
    assert stub.Acquire(opb.AcquireRequest(job_id="after", group_id="t"), metadata=MD, timeout=10).success
    assert stub.Yield(opb.YieldRequest(job_id="after", group_id="t"), metadata=MD, timeout=10).success
    st_ = spb_grpc.SnapshotAgentServiceStub(servers.chans["sidecar"]).Status(spb.StatusRequest(), metadata=MD, timeout=5)
    assert any(j.job_id == "s" for j in st_.job_statuses)
