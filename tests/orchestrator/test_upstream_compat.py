"""Compatibility: an "existing llm-d client" drives the orchestrator exactly as the guide's manifests start it.

The client (tests/compat/upstream_client.py) uses only stubs generated at test time from a .proto written from
the upstream tables, in its own process, and connects as upstream's Python client does (llm-d-rl-time-slicing
6cf8e9b07c60, ``pkg/client/python/timeslice/orchestrator/client.py``: ``grpc.insecure_channel``, no credentials,
no metadata). The orchestrator is ``llmd-timeslice orchestrator`` with the container args of the Deployment that
``kubectl kustomize manifests/guides/time-slicing/base`` builds, verbatim, except what only a pod has (listed in
:func:`pod_args`): the token Secret's mount, the ports (free ones here; the Service and the NetworkPolicy name
them), the in-cluster API config. So: the token file on the main port, the upstream port as the manifests open it,
Kubernetes discovery of the pods, the state ConfigMap and leader election, all on the test API server.

- upstream's client acquires and yields on the upstream port (and 20 of its jobs are granted in FIFO order);
- the same client on the main port gets UNAUTHENTICATED for every call.
The upstream port serving nothing else: tests/orchestrator/test_upstream_compat_port.py.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
from pathlib import Path

import grpc
import port_for
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_tools import protoc

from llmd_timeslice.domain.inventory import Inventory
from llmd_timeslice.orchestrator.server import OrchestratorServer
from llmd_timeslice.snapshot.backends.vllm import VllmBackend
from llmd_timeslice.snapshot.server import SidecarServer
from tests.orchestrator.test_orchestrator import RecordingActions
from tests.support.cli import CliProcess
from tests.support.fake_engines import FakeVllm
from tests.support.kube_api import FakeKubeApi, write_kubeconfig
from tests.support.kube_pods import NS, FakeKube, make_pod

pytestmark = pytest.mark.timeout(180)
ROOT = Path(__file__).parents[2]
COMPAT = ROOT / "tests" / "compat"
BASE = ROOT / "manifests" / "guides" / "time-slicing" / "base"
TOKEN = "the-secret-token"
ORCHESTRATOR = "llmd-timeslice-orchestrator"


@pytest.fixture(scope="module")
def stubs(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("upstream_stubs")
    include = Path(protoc.__file__).parent / "_proto"
    rc = protoc.main(
        [
            "protoc",
            f"-I{COMPAT}",
            f"-I{include}",
            f"--python_out={out}",
            f"--grpc_python_out={out}",
            str(COMPAT / "upstream_orchestrator.proto"),
        ]
    )
    assert rc == 0
    return out


def run_upstream_client(stubs: Path, target: str, scenario: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(COMPAT / "upstream_client.py"), str(stubs), target, scenario],
        capture_output=True,
        text=True,
        timeout=120,
    )


# ------------------------------------------------------------------ the orchestrator as the manifests start it


def built_base() -> list[dict]:
    kubectl = shutil.which("kubectl")
    assert kubectl, "kubectl (with kustomize) is required: it is on the project's machine image"
    proc = subprocess.run([kubectl, "kustomize", str(BASE)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


def _one(docs: list[dict], kind: str, name: str) -> dict:
    hits = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(hits) == 1, f"expected one {kind} {name}, found {len(hits)}"
    return hits[0]


def _flag(args: list[str], name: str) -> str:
    values = [a.partition("=")[2] for a in args if a.partition("=")[0] == name]
    assert len(values) == 1, f"the manifests' orchestrator args name {name} {len(values)} times: {args}"
    return values[0]


def pod_args(container: dict, env: dict[str, str], ports: dict[str, int], token_file: Path, kubeconfig: str) -> list[str]:
    """The container's args as the kubelet would run them in this test's "pod": ``$(VAR)`` expanded from ``env``
    (as the kubelet expands it), and only what a pod provides replaced: each ``--*-port`` by the free port chosen
    for the container port of that number (``ports``: container port name -> port here), the token file by the
    mounted Secret's stand-in, plus ``--kubeconfig`` (in a pod: the ServiceAccount's in-cluster config)."""
    by_number = {p["containerPort"]: p["name"] for p in container["ports"]}
    mount = next(m["mountPath"] for m in container["volumeMounts"] if m["name"] == "token")
    out = []
    for arg in container["args"]:
        for var, value in env.items():
            arg = arg.replace(f"$({var})", value)
        name, eq, value = arg.partition("=")
        if eq and name.endswith("-port") and int(value) in by_number:
            arg = f"{name}={ports[by_number[int(value)]]}"
        elif name == "--token-file":
            assert value.startswith(mount + "/"), f"--token-file {value} is not in the token Secret's mount {mount}"
            arg = f"{name}={token_file}"
        out.append(arg)
    return [*out, f"--kubeconfig={kubeconfig}"]


class ManifestOrchestrator(CliProcess):
    async def serving(self) -> bool:
        """The readiness probe of the manifests: gRPC health "" on the main port."""
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{self.port}") as ch:
                r = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=0.5)
        except (TimeoutError, grpc.RpcError):
            return False
        return r.status == health_pb2.HealthCheckResponse.SERVING


@pytest.fixture
async def as_installed(tmp_path):
    """The orchestrator started from the manifests, the pods of one sampler (fake vLLM + its real sidecar) in group
    g0 and one trainer pod in group "trainers" on the test API server. Yields ``(orchestrator, ports)``."""
    docs = built_base()
    deployment = _one(docs, "Deployment", ORCHESTRATOR)
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    service = _one(docs, "Service", ORCHESTRATOR)
    policy = _one(docs, "NetworkPolicy", ORCHESTRATOR)
    assert container["command"] == ["llmd-timeslice"] and container["args"][0] == "orchestrator"
    assert _flag(container["args"], "--token-file"), "the manifests start the orchestrator with a token file"
    upstream_port = int(_flag(container["args"], "--upstream-compat-port"))
    named = {p["containerPort"]: p["name"] for p in container["ports"]}
    # The port upstream's client is pointed at is the Service's grpc-upstream, and the NetworkPolicy's trainer rule.
    assert any(p["targetPort"] == named[upstream_port] for p in service["spec"]["ports"])
    trainer_rules = [r for r in policy["spec"]["ingress"] if r.get("from")]
    assert [p["port"] for r in trainer_rules for p in r["ports"]] == [named[upstream_port]]

    kube = FakeKube()
    api = FakeKubeApi(pods=kube)
    engine = FakeVllm().start()
    sidecar = SidecarServer({"sampler-0": VllmBackend(engine.url, idle_timeout_s=1)}, port=0, token=TOKEN)
    orch: ManifestOrchestrator | None = None
    try:
        await sidecar.start()
        sampler = make_pod("sampler-0", "g0", ip="127.0.0.1")
        sampler["spec"]["containers"][0]["ports"][0]["containerPort"] = int(engine.url.rsplit(":", 1)[1])
        sampler["spec"]["containers"][1]["ports"][0]["containerPort"] = sidecar.port
        kube.add(sampler)
        kube.add(make_pod("trainer-0", "trainers", role="trainer", ip="127.0.0.2"))
        token_file = tmp_path / "token"
        token_file.write_text(TOKEN + "\n")
        ports = {p["name"]: port_for.select_random() for p in container["ports"]}
        args = pod_args(
            container, {"POD_NAMESPACE": NS}, ports, token_file, write_kubeconfig(tmp_path / "kubeconfig", api.url, NS)
        )
        orch = ManifestOrchestrator(args, ports["grpc"], tmp_path / "orchestrator.log", env={"POD_NAME": "orch-0"})
        await orch.start()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 60
        while not await orch.serving():
            assert orch.proc.poll() is None, f"the orchestrator exited; its log:\n{(tmp_path / 'orchestrator.log').read_text()}"
            assert loop.time() < deadline, f"not Ready in 60 s; its log:\n{(tmp_path / 'orchestrator.log').read_text()}"
            await asyncio.sleep(0.1)
        yield orch, {named[upstream_port]: ports[named[upstream_port]], "grpc": ports["grpc"]}, tmp_path
    finally:
        if orch is not None:
            orch.stop()
        await sidecar.stop()
        engine.stop()
        api.stop()


async def test_upstreams_client_acquires_and_yields_on_the_upstream_port_and_is_refused_on_the_main_port(stubs, as_installed):
    _orch, ports, logdir = as_installed
    upstream, main = f"127.0.0.1:{ports['grpc-upstream']}", f"127.0.0.1:{ports['grpc']}"
    for target, scenario in ((upstream, "basic"), (upstream, "twenty"), (main, "unauthenticated")):
        r = await asyncio.to_thread(run_upstream_client, stubs, target, scenario)
        assert r.returncode == 0 and r.stdout.strip().endswith("OK"), (
            f"{scenario} on {target}: {r.stdout}{r.stderr}\norchestrator log:\n{(logdir / 'orchestrator.log').read_text()}"
        )


UPSTREAM_CLIENT_ENV = "LLMD_TIMESLICE_UPSTREAM_CLIENT"
"""A checkout of upstream's Python client (llm-d-rl-time-slicing ``pkg/client/python``, package ``timeslice``); it is
not on PyPI, so the test below runs only where one is given (checked with 0.2.1, 6cf8e9b07c60)."""


@pytest.mark.skipif(
    not os.environ.get(UPSTREAM_CLIENT_ENV),
    reason=f"set {UPSTREAM_CLIENT_ENV} to a checkout of llm-d-rl-time-slicing's pkg/client/python (not on PyPI)",
)
async def test_upstreams_own_client_package_acquires_and_yields_as_installed(as_installed):
    _orch, ports, logdir = as_installed
    client_dir = os.environ[UPSTREAM_CLIENT_ENV]
    for port, scenario in ((ports["grpc-upstream"], "acquire_yield"), (ports["grpc"], "unauthenticated")):
        r = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, str(COMPAT / "upstream_package_client.py"), client_dir, f"127.0.0.1:{port}", scenario],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert r.returncode == 0 and r.stdout.strip().endswith("OK"), (
            f"{scenario} on {port}: {r.stdout}{r.stderr}\norchestrator log:\n{(logdir / 'orchestrator.log').read_text()}"
        )


def test_upstream_client_works_unchanged_against_a_group_that_receives_yield_requests(stubs, loop_thread):
    """Acquire (upstream client, on the upstream port of an orchestrator whose main port wants a token), a yield
    request marks its lease, it yields and acquires again: its wire has no Lease extension and nothing it sees
    changes; the orchestrator counts the yield as honoured."""
    inv = Inventory.model_validate(
        {
            "groups": [
                {
                    "group_id": "g0",
                    "min_training_s": 0,
                    "samplers": [
                        {"pool": "default", "address": "127.0.0.1:8001", "sidecar": "127.0.0.1:9101", "job_id": "sampler-0"}
                    ],
                }
            ]
        }
    )
    srv = OrchestratorServer(inv, port=0, token=TOKEN, actions=RecordingActions(), upstream_compat_port=0)
    loop_thread.run(srv.start())
    proc = subprocess.Popen(
        [
            sys.executable,
            str(COMPAT / "upstream_client.py"),
            str(stubs),
            f"127.0.0.1:{srv.upstream_compat_port}",
            "yield_requested",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout.readline().strip() == "ACQUIRED"
        answer = loop_thread.run(srv.orchestrator.request_yield("g0", "eval band waits", band=10, hold_deadline_s=5))
        assert answer.requested and answer.holder == "trainer-0"
        proc.stdin.write("REQUESTED\n")
        proc.stdin.flush()
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0 and out.strip().endswith("OK"), out + err
        g = srv.orchestrator.groups["g0"]
        assert (g.yield_stats.sent, g.yield_stats.honoured) == (1, 1)
    finally:
        proc.kill()
        loop_thread.run(srv.stop())
