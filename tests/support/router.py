"""A real router stack for tests: gate + picker (in the test's event loop) + the real Envoy binary.

``picker_process=True`` runs the picker as ``llmd-timeslice picker`` in a process of its own, as a real EPP is
(for bursts where an in-process picker would share the test's event loop with thousands of clients).

Every gate test runs against each edge (``EDGES``): the fast path (``ext_authz``: HTTP ext_authz admission,
completions from the access-log stream, the picker as EPP), the same with the gate picking the endpoint
(``ext_authz-pick``: no EPP, the local stack's chain) and ``ext_proc``.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path

import port_for

from epp_plugin.gate.server import GateConfig, GateServer
from epp_plugin.picker.server import PickerConfig, PickerServer
from llmd_timeslice.local.commands import PickerCommand
from llmd_timeslice.router.envoy_config import EnvoyRouterConfig
from llmd_timeslice.router.envoy_launcher import EnvoyProcess
from tests.support.cli import CliProcess
from tests.support.tcp_proxy import TcpProxy

EDGES = ["ext_authz", "ext_proc"]
"""The two edges; ``ext_authz-pick`` (the fast path without EPP) is added where the endpoint choice matters."""
ALL_CHAINS = ["ext_authz", "ext_authz-pick", "ext_proc"]


EDS_INITIAL_FETCH_TIMEOUT_S = 0.1
"""``ext_authz-pick``: the tests' gates know no endpoint until the test publishes one, so Envoy's start would wait the
product's 2 s for a first assignment that does not come; the endpoints join Envoy's cluster when they are published
(the gate names an endpoint only once Envoy acked it), as with the product's wait spent."""


def envoy_config(edge: str, *, gate_port: int | None, authz_port: int | None, epp_port: int | None, **kw) -> EnvoyRouterConfig:
    """Router config for ``edge`` (one of ``ALL_CHAINS``) on free loopback ports."""
    gate_edge = "ext_proc" if edge == "ext_proc" else "ext_authz"
    kw.setdefault("eds_initial_fetch_timeout_s", EDS_INITIAL_FETCH_TIMEOUT_S)
    return EnvoyRouterConfig(
        listen_port=port_for.select_random(),
        admin_port=port_for.select_random(),
        gate_port=gate_port,
        epp_port=None if edge == "ext_authz-pick" else epp_port,
        gate_edge=gate_edge,
        authz_port=authz_port,
        **kw,
    )


class PickerProcess(CliProcess):
    """``llmd-timeslice picker`` in a child process on a free loopback port."""

    def __init__(self, pools: dict[str, list[str]], default_pool: str, log: Path) -> None:
        port = port_for.select_random()
        eps = [(p, e) for p, addrs in pools.items() for e in addrs]
        cmd = PickerCommand(host="127.0.0.1", port=port, default_pool=default_pool, endpoints=eps)
        super().__init__(cmd.args(), port, log)


@dataclass
class RouterStack:
    gate: GateServer
    picker: PickerServer | PickerProcess
    envoy: EnvoyProcess
    edge: str
    picker_proxy: TcpProxy | None = None

    @property
    def url(self) -> str:
        return self.envoy.url

    def pool(self, name: str = "default"):
        return self.gate.pools[name]

    async def restart_envoy(self) -> None:
        """Kill Envoy (SIGKILL, nothing flushed) and start a new process on the same ports."""
        proc = self.envoy._exec.process
        proc.kill()
        await asyncio.to_thread(proc.wait, 10)
        self.envoy._exec = None
        await asyncio.to_thread(self.envoy.start)

    async def stop(self) -> None:
        await asyncio.to_thread(self.envoy.stop)
        await self.gate.stop(0.5)
        if isinstance(self.picker, PickerProcess):
            await asyncio.to_thread(self.picker.stop)
        else:
            await self.picker.stop(0.5)
        if self.picker_proxy is not None:
            await self.picker_proxy.stop()


async def start_router(
    workdir: Path,
    endpoints: list[str],
    pool: str = "default",
    *,
    edge: str = "ext_authz",
    extra_pools: dict[str, tuple[str, list[str]]] | None = None,
    epp_message_timeout_s: float = 5.0,
    picker_delay_s: float = 0.0,
    picker_process: bool = False,
    envoy_kw: dict | None = None,
    **gate_kw,
) -> RouterStack:
    """Start gate, picker and Envoy on free loopback ports; Envoy logs go to ``workdir``.

    ``extra_pools``: pool -> (path prefix, endpoints), routed per prefix (per-route pool override).
    ``picker_delay_s`` > 0: Envoy reaches the picker through a :class:`TcpProxy` that holds its answers back that long
    (a slow EPP). ``picker_process``: the picker runs in its own process (:class:`PickerProcess`). ``envoy_kw``: more
    :class:`~llmd_timeslice.router.envoy_config.EnvoyRouterConfig` fields.
    """
    extra_pools = extra_pools or {}
    gate = GateServer(
        GateConfig(ext_proc_port=0, authz_port=0, control_port=0, pools=[pool, *extra_pools], default_pool=pool, **gate_kw)
    )
    await gate.start()
    pools = {pool: endpoints, **{p: e for p, (_, e) in extra_pools.items()}}
    picker: PickerServer | PickerProcess
    if picker_process:
        picker = PickerProcess(pools, pool, workdir / "picker.log")
    else:
        picker = PickerServer(PickerConfig(port=0, pools=pools, default_pool=pool))
    await picker.start()
    proxy = await TcpProxy("127.0.0.1", picker.port, delay_s=picker_delay_s).start() if picker_delay_s > 0 else None
    cfg = envoy_config(
        edge,
        gate_port=gate.ext_proc_port,
        authz_port=gate.authz_port,
        epp_port=proxy.port if proxy is not None else picker.port,
        pool=pool,
        max_hold_s=gate.config.max_hold_s,
        epp_message_timeout_s=epp_message_timeout_s,
        pools_by_prefix={prefix: p for p, (prefix, _) in extra_pools.items()},
        **(envoy_kw or {}),
    )
    envoy = EnvoyProcess(cfg, workdir)
    await asyncio.to_thread(envoy.start)
    return RouterStack(gate, picker, envoy, edge, proxy)
