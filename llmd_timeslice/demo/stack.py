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

EVAL_OBJECTIVE = "eval"
"""The InferenceObjective of the demo's second traffic class (``--eval-rps``)."""
EVAL_PRIORITY = 10
"""Its ``spec.priority``: the priority band its requests are held in (docs/gate.md, "Priority bands")."""


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
    eval_deadline_s: float | None = None,
    min_training_s: float = 1.0,
    yield_request_fraction: float = 0.4,
) -> StackFile:
    """One group ``group_id`` of ``samplers`` vLLM servers (``sampler-0`` ...) on ``model_dir``, on free ports.

    The group discards the samplers' weights when they sleep (``sleep_level_policy: auto``: the trainer publishes a
    weight version each step) and drains for at most 30 s. Logs, token, inventory and Envoy bootstrap go to
    ``workdir`` (``workdir/logs/<component>.log``, ``workdir/control-token``), a relative one taken from the current
    directory (``model_dir`` too).

    With ``eval_deadline_s`` (seconds) the stack also declares the InferenceObjective :data:`EVAL_OBJECTIVE`
    (priority :data:`EVAL_PRIORITY`) and that band's hold deadline, and the group asks its holder to yield once an
    eval request waited ``yield_request_fraction`` of it, at most once per ``min_training_s`` seconds of training
    (docs/group-settings.md). Without it the stack is the plain demo's. Raises ``pydantic.ValidationError`` for a
    deadline ``<= 0`` or above ``max_hold_s`` (the band's longest hold), as the stack file does.
    """
    group: dict = {"group_id": group_id, "sleep_level": 1, "sleep_level_policy": "auto", "drain_timeout_s": 30}
    classes: dict = {}
    if eval_deadline_s is not None:
        group |= {"min_training_s": min_training_s, "yield_request_fraction": yield_request_fraction}
        classes = {
            "objectives": [{"name": EVAL_OBJECTIVE, "priority": EVAL_PRIORITY}],
            "priority_bands": [{"priority": EVAL_PRIORITY, "max_hold_s": max_hold_s, "hold_deadline_s": eval_deadline_s}],
        }
    names = [n for n, f in StackPorts.model_fields.items() if f.default is not None]  # optional ports stay off
    ports = free_ports(len(names) + 2 * samplers)
    stack_ports = dict(zip(names, ports, strict=False))
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
            "groups": [group],
            "engines": [
                {
                    "name": f"sampler-{i}",
                    "group": group_id,
                    "sidecar_port": rest[2 * i],
                    "vllm": {"model": str(model_dir.resolve()), "port": rest[2 * i + 1]},
                }
                for i in range(samplers)
            ],
            **classes,
        }
    )
