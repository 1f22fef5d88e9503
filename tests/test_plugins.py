"""Plugins chosen by name (llmd_timeslice/plugins.py): the registry itself, and each extension point's registry —
waiter policy (orchestrator), endpoint pick (gate and picker), snapshot backend (sidecar): listing, an unknown
name's one-line error, and the chosen plugin being the one used."""

from __future__ import annotations

import asyncio
import typing
from dataclasses import dataclass

import grpc
import pytest

from epp_plugin.endpoint_pick import ENDPOINT_PICKS, LeastInFlight, RoundRobin
from epp_plugin.picker.server import EndpointPicker, PickerConfig
from llmd_timeslice.config import SidecarSettings
from llmd_timeslice.domain.group_settings import GroupSpec, SamplerEndpoint, SchedulingPolicy
from llmd_timeslice.domain.waiter_policy import WAITER_POLICIES, waiter_policy
from llmd_timeslice.orchestrator.groups import Orchestrator
from llmd_timeslice.orchestrator.switch import SwitchActions
from llmd_timeslice.plugins import Registry, UnknownPlugin
from llmd_timeslice.snapshot.backends.cuda import CudaCheckpointBackend
from llmd_timeslice.snapshot.backends.registry import SNAPSHOT_BACKENDS, backend_class, job_default_backend
from llmd_timeslice.snapshot.backends.vllm import VllmBackend
from llmd_timeslice.snapshot.channel import WorkloadRegistry
from llmd_timeslice.snapshot.resolve import BackendResolver, ResolveError


# --------------------------------------------------------------------------- the registry
def test_a_registry_lists_builds_and_refuses_a_name_twice():
    r: Registry[list] = Registry("widget")
    r.register("b", list)
    r.register("a", lambda **kw: ["a", kw])
    assert r.names() == ("b", "a") and "a" in r and "c" not in r
    assert r.create("a", x=1) == ["a", {"x": 1}]
    with pytest.raises(ValueError, match="widget 'a' is already registered"):
        r.register("a", list)
    with pytest.raises(UnknownPlugin) as err:
        r.create("c")
    assert str(err.value) == "unknown widget 'c'; known: b, a"
    assert isinstance(err.value, ValueError) and err.value.known == ("b", "a")


# --------------------------------------------------------------------------- waiter policy
def test_waiter_policies_are_the_scheduling_policy_spellings():
    assert set(WAITER_POLICIES.names()) == {p.value for p in SchedulingPolicy}
    with pytest.raises(UnknownPlugin, match=r"^unknown waiter policy 'lottery'; known: fifo, priority, round_robin$"):
        waiter_policy("lottery")
    assert waiter_policy(str(SchedulingPolicy.PRIORITY)) is waiter_policy("priority")  # the enum spells the name


@dataclass
class W:
    job_id: str


def test_each_waiter_policy_picks_by_its_rule():
    waiters = [W("a"), W("b"), W("c")]
    prio, granted = {"b": 5, "c": 5}, {"a": 7, "b": 3}
    assert waiter_policy("fifo").pick(waiters, priorities=prio, last_granted=granted).job_id == "a"
    assert waiter_policy("priority").pick(waiters, priorities=prio, last_granted=granted).job_id == "b"  # first of equals
    assert waiter_policy("round_robin").pick(waiters, priorities=prio, last_granted=granted).job_id == "c"  # never granted


class NoopActions(SwitchActions):
    async def suspend_samplers(self, spec, record) -> None:
        await asyncio.sleep(0)

    async def resume_samplers(self, spec, record) -> None:
        await asyncio.sleep(0)


@pytest.mark.parametrize(
    "policy, first", [("fifo", "low"), ("priority", "high"), ("round_robin", "low")], ids=["fifo", "priority", "round_robin"]
)
async def test_the_groups_policy_name_chooses_who_is_granted_next(policy, first):
    smp = SamplerEndpoint("p", "10.0.0.1:8000", "10.0.0.1:9001", "s0")
    spec = GroupSpec("g", [smp], policy=SchedulingPolicy(policy), job_priorities={"high": 9})
    orch = Orchestrator([spec], NoopActions())
    await orch.start(reconcile=False)
    try:
        await orch.acquire("high", "g")  # "high" has been granted once: round robin puts it after "low"
        await orch.yield_("high", "g")
        await orch.acquire("holder", "g")
        order: list[str] = []

        async def wait(job: str) -> None:
            await orch.acquire(job, "g")
            order.append(job)
            await orch.yield_(job, "g")

        low = asyncio.create_task(wait("low"))
        while len(orch.groups["g"].waiters) < 1:
            await asyncio.sleep(0.001)
        high = asyncio.create_task(wait("high"))
        while len(orch.groups["g"].waiters) < 2:
            await asyncio.sleep(0.001)
        await orch.yield_("holder", "g")
        await asyncio.wait_for(asyncio.gather(low, high), 5)
        assert order[0] == first, order
    finally:
        await orch.close()


# --------------------------------------------------------------------------- endpoint pick
def test_endpoint_picks_are_listed_and_an_unknown_one_is_one_line():
    assert ENDPOINT_PICKS.names() == ("least_in_flight", "round_robin")
    with pytest.raises(UnknownPlugin, match=r"^unknown endpoint pick 'random'; known: least_in_flight, round_robin$"):
        ENDPOINT_PICKS.create("random")


def test_least_in_flight_picks_the_least_loaded_then_orders_the_rest_by_load():
    load = {"a": 3, "b": 1, "c": 2}
    pick = ENDPOINT_PICKS.create("least_in_flight")
    assert isinstance(pick, LeastInFlight)
    assert pick.order(("a", "b", "c"), 3, load.__getitem__) == ("b", "c", "a")
    assert pick.order(("a", "b", "c"), 1, load.__getitem__) == ("b",)
    # Ties go round-robin: with equal load each call starts one further along.
    assert {pick.pick(("a", "b", "c")) for _ in range(3)} == {"a", "b", "c"}


def test_round_robin_rotates_over_the_candidates_in_order():
    pick = ENDPOINT_PICKS.create("round_robin")
    assert isinstance(pick, RoundRobin)
    assert [pick.pick(("a", "b", "c")) for _ in range(4)] == ["a", "b", "c", "a"]
    assert pick.order(("a", "b", "c"), 2) == ("b", "c") and pick.order(("a",), 3) == ("a",)


def test_the_picker_uses_the_round_robin_pick_per_pool_within_the_subset_hint():
    picker = EndpointPicker(PickerConfig(pools={"p": ["10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"]}))
    assert all(type(p) is ENDPOINT_PICKS.factory("round_robin") for p in picker._picks.values())
    assert [picker.pick("p", None) for _ in range(4)] == ["10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000", "10.0.0.1:8000"]
    subset = ["10.0.0.3:8000", "10.0.0.1:8000"]
    assert {picker.pick("p", subset) for _ in range(4)} == {"10.0.0.1:8000", "10.0.0.3:8000"}
    assert picker.pick("p", ["10.9.9.9:1"]) is None


# --------------------------------------------------------------------------- snapshot backends
def test_snapshot_backends_are_the_sidecars_backend_spellings():
    names = typing.get_args(SidecarSettings.model_fields["backend"].annotation)
    assert SNAPSHOT_BACKENDS.names() == names == ("vllm", "sglang", "cuda", "workload_channel")
    assert [backend_class(n).target for n in names] == ["endpoint", "endpoint", "pids", "channel"]


def test_an_unknown_snapshot_backend_is_one_line_naming_the_known_ones():
    with pytest.raises(UnknownPlugin) as err:
        job_default_backend("tensorrt", engine_url="http://127.0.0.1:1", pids=[])
    assert str(err.value) == "unknown snapshot backend 'tensorrt'; known: vllm, sglang, cuda, workload_channel"
    # A pod annotation naming one: the request is refused with the same list.
    resolver = BackendResolver({}, WorkloadRegistry(), annotations={"snapshot.timeslice.io/backend": "tensorrt"})
    with pytest.raises(ResolveError) as refused:
        resolver.resolve("job", None)
    assert refused.value.code is grpc.StatusCode.FAILED_PRECONDITION
    assert str(refused.value) == (
        "pod annotation names unknown snapshot backend 'tensorrt'; known: vllm, sglang, cuda, workload_channel"
    )


async def test_the_sidecars_backend_name_builds_that_backend():
    vllm = job_default_backend("vllm", engine_url="http://127.0.0.1:8123", pids=[], idle_timeout_s=3.0)
    cuda = job_default_backend("cuda", engine_url="http://127.0.0.1:8123", pids=[4242])
    try:
        assert isinstance(vllm, VllmBackend) and vllm.base_url == "http://127.0.0.1:8123" and vllm.idle_timeout_s == 3.0
        assert isinstance(cuda, CudaCheckpointBackend) and cuda.pids == [4242]
        assert job_default_backend("workload_channel", engine_url="http://127.0.0.1:8123", pids=[]) is None
    finally:
        for b in (vllm, cuda):
            if b is not None:
                await b.close()
    # The resolver builds from the same registry: an annotation naming sglang gets an SglangBackend.
    resolver = BackendResolver({}, WorkloadRegistry(), annotations={"snapshot.timeslice.io/backend": "sglang"})
    got = resolver.resolve("job", None)
    assert type(got.backend) is SNAPSHOT_BACKENDS.factory("sglang") and got.source == "annotation"
    await resolver.close()
    # Each registered backend is built as its target says: pids from the annotation, a registered workload by job.
    ann = {"snapshot.timeslice.io/backend": "cuda", "snapshot.timeslice.io/pids": "42, 43"}
    cuda_res = BackendResolver({}, WorkloadRegistry(), annotations=ann).resolve("job", None).backend
    assert isinstance(cuda_res, CudaCheckpointBackend) and cuda_res.pids == [42, 43]
    ann = {"snapshot.timeslice.io/backend.job": "workload_channel"}
    channel = BackendResolver({}, WorkloadRegistry(), annotations=ann).resolve("job", None).backend
    assert type(channel) is SNAPSHOT_BACKENDS.factory("workload_channel") and channel.job_id == "job"
