"""A real router stack for tests: gate + picker (in the test's event loop) + the real Envoy binary."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path

import port_for

from epp_plugin.envoy_config import EnvoyRouterConfig
from epp_plugin.envoy_launcher import EnvoyProcess
from epp_plugin.gate.server import GateConfig, GateServer
from epp_plugin.picker.server import PickerConfig, PickerServer
from tests.support.tcp_proxy import TcpProxy


@dataclass
class RouterStack:
    gate: GateServer
    picker: PickerServer
    envoy: EnvoyProcess
    picker_proxy: TcpProxy | None = None

    @property
    def url(self) -> str:
        return self.envoy.url

    def pool(self, name: str = "default"):
        return self.gate.pools[name]

    async def stop(self) -> None:
        await asyncio.to_thread(self.envoy.stop)
        await self.gate.stop(0.5)
        await self.picker.stop(0.5)
        if self.picker_proxy is not None:
            await self.picker_proxy.stop()


async def start_router(workdir: Path, endpoints: list[str], pool: str = "default", *,
                       extra_pools: dict[str, tuple[str, list[str]]] | None = None, epp_message_timeout_s: float = 5.0,
                       picker_delay_s: float = 0.0, **gate_kw) -> RouterStack:
    """Start gate, picker and Envoy on free loopback ports; Envoy logs go to ``workdir``.

    ``extra_pools``: pool -> (path prefix, endpoints), routed per prefix (per-route ext_proc metadata).
    ``picker_delay_s`` > 0: Envoy reaches the picker through a :class:`TcpProxy` that holds its answers back that long
    (a slow EPP).
    """
    extra_pools = extra_pools or {}
    gate = GateServer(GateConfig(ext_proc_port=0, control_port=0, pools=[pool, *extra_pools], default_pool=pool,
                                 **gate_kw))
    await gate.start()
    picker = PickerServer(PickerConfig(port=0, pools={pool: endpoints, **{p: e for p, (_, e) in extra_pools.items()}},
                                       default_pool=pool))
    await picker.start()
    proxy = await TcpProxy("127.0.0.1", picker.port, delay_s=picker_delay_s).start() if picker_delay_s > 0 else None
    cfg = EnvoyRouterConfig(
        listen_port=port_for.select_random(), admin_port=port_for.select_random(), gate_port=gate.ext_proc_port,
        epp_port=proxy.port if proxy is not None else picker.port, pool=pool, max_hold_s=gate.config.max_hold_s,
        pools_by_prefix={prefix: p for p, (prefix, _) in extra_pools.items()}, epp_message_timeout_s=epp_message_timeout_s,
    )
    envoy = EnvoyProcess(cfg, workdir)
    await asyncio.to_thread(envoy.start)
    return RouterStack(gate, picker, envoy, proxy)
