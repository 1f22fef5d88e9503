"""The demo's stack, described as a stack file (:class:`~llmd_timeslice.local.stack_file.StackFile`).

The demo, and the benchmarks that run its RL loop on real vLLM, start this stack through the local launcher
(:class:`llmd_timeslice.local.up.StackRunner`), as ``llmd-timeslice up -f`` starts a stack file: one group of vLLM
CPU servers on one tiny model, a sidecar per server, the orchestrator, the gate (the ``ext_authz`` fast path: the
gate picks the endpoint) and Envoy, every port a free loopback one. Each component's command line comes from
:mod:`llmd_timeslice.local.commands`, so the demo's Envoy gets ``up``'s route timeout, its gate the default pool and
the lost-completion age that go with it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from llmd_timeslice.local.ports import free_ports
from llmd_timeslice.local.stack_file import StackFile, StackPorts


def demo_stack_file(
    workdir: Path,
    model_dir: Path,
    group_id: str,
    samplers: int = 2,
    *,
    name: str = "demo",
    max_hold_s: float = 120.0,
    log_level: Literal["debug", "info", "warning", "error"] = "info",
    gate_edge: Literal["ext_authz", "ext_proc"] = "ext_authz",
) -> StackFile:
    """One group ``group_id`` of ``samplers`` vLLM servers (``sampler-0`` ...) on ``model_dir``, on free ports.

    The group discards the samplers' weights when they sleep (``sleep_level_policy: auto``: the trainer publishes a
    weight version each step) and drains for at most 30 s. Logs, token, inventory and Envoy bootstrap go to
    ``workdir`` (``workdir/logs/<component>.log``, ``workdir/control-token``), a relative one taken from the current
    directory (``model_dir`` too).
    """
    ports = free_ports(len(StackPorts.model_fields) + 2 * samplers)
    stack_ports = dict(zip(StackPorts.model_fields, ports, strict=False))
    rest = ports[len(stack_ports) :]
    return StackFile.model_validate(
        {
            "stack": {
                "name": name,
                "workdir": str(workdir.resolve()),  # as given, not under a stack file's folder (there is none)
                "max_hold_s": max_hold_s,
                "log_level": log_level,
                "gate_edge": gate_edge,
                "ports": stack_ports,
            },
            "groups": [{"group_id": group_id, "sleep_level": 1, "sleep_level_policy": "auto", "drain_timeout_s": 30}],
            "engines": [
                {
                    "name": f"sampler-{i}",
                    "group": group_id,
                    "sidecar_port": rest[2 * i],
                    "vllm": {"model": str(model_dir.resolve()), "port": rest[2 * i + 1]},
                }
                for i in range(samplers)
            ],
        }
    )
