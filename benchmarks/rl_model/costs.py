"""The RL model's workload (jobs, phases, accelerator groups) and each strategy's switch costs, built from the inputs."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from benchmarks.rl_model.inputs import Input


# --------------------------------------------------------------------------- workload / cost model
@dataclass
class Workload:
    """Derived durations (seconds) and bytes for one configuration."""

    model_b: float
    rollout_s: float
    train_s: float
    cpu_gap_s: float
    weight_sync_s: float
    jobs: int
    group_size: int
    node_accelerators: int
    requests_per_rollout: int
    iterations: int
    layout: str = "interleaved"

    @property
    def gap_s(self) -> float:
        return self.cpu_gap_s + self.weight_sync_s


def make_workload(
    inp: dict[str, Input],
    *,
    model_b: float | None = None,
    rollout_fraction: float | None = None,
    cpu_gap_s: float | None = None,
    layout: str = "interleaved",
    iterations: int | None = None,
    jobs: int | None = None,
) -> Workload:
    """Phase durations scale linearly with parameters from the 7B anchor (same tokens per iteration)."""
    b = float(model_b if model_b is not None else inp["model_b"].value)
    frac = float(rollout_fraction if rollout_fraction is not None else inp["rollout_fraction"].value)
    total = inp["phase_s_at_7b"].value * b / 7.0
    sync = b * 1e9 * inp["weight_bytes_per_param"].value / (inp["weight_sync_gbps"].value * 1e9)
    return Workload(
        model_b=b,
        rollout_s=total * frac,
        train_s=total * (1 - frac),
        cpu_gap_s=float(cpu_gap_s if cpu_gap_s is not None else inp["cpu_gap_s"].value),
        weight_sync_s=sync,
        jobs=int(jobs or inp["jobs"].value),
        group_size=int(inp["group_size"].value),
        node_accelerators=int(inp["node_accelerators"].value),
        requests_per_rollout=int(inp["requests_per_rollout"].value),
        iterations=int(iterations or inp["iterations"].value),
        layout=layout,
    )


@dataclass(frozen=True)
class Component:
    """One part of a switch: ``seconds`` and the input keys it was computed from."""

    name: str
    seconds: float
    inputs: tuple[str, ...]


class Bytes:
    """Bytes moved per accelerator for a model size (device-resident part, capped by the footprint)."""

    def __init__(self, inp: dict[str, Input], model_b: float, group_size: int) -> None:
        hbm = inp["hbm_gb"].value * 1e9
        params = model_b * 1e9
        self.sampler_footprint = inp["vllm_gpu_memory_utilization"].value * hbm
        self.trainer_footprint = inp["trainer_footprint_fraction"].value * hbm
        self.sampler_weights = min(params * inp["weight_bytes_per_param"].value / group_size, self.sampler_footprint)
        state = params * inp["trainer_state_bytes_per_param"].value / group_size
        # Beyond the footprint the state cannot be device-resident: it already lives in host memory
        # (optimizer offload); only what is on the device moves at a switch.
        self.trainer_state = min(state, self.trainer_footprint)
        self.trainer_state_fits = state <= self.trainer_footprint


@dataclass
class Strategy:
    """How one strategy suspends and resumes a worker (``role`` is 'sampler' or 'trainer')."""

    name: str
    suspend: Callable[[str], list[Component]]
    resume: Callable[[str], list[Component]]
    dedicated: bool = False


def _poll(seconds: float, period: float) -> float:
    """Completion of an operation observed by a poll every ``period`` seconds from its start."""
    return math.ceil(seconds / period - 1e-9) * period if period > 0 else seconds


def make_strategy(name: str, inp: dict[str, Input], model_b: float, group_size: int) -> Strategy:
    """The switch-cost functions of a strategy (see the module docstring)."""
    v = {k: i.value for k, i in inp.items()}
    by = Bytes(inp, model_b, group_size)
    pcie = v["pcie_gbps"] * 1e9
    vllm_bw = v["vllm_sleep_wake_gbps"] * 1e9

    if name == "dedicated":

        def none(role):
            return []

        return Strategy(name, none, none, dedicated=True)
    if name == "ceiling":

        def zero(role):
            return []

        return Strategy(name, zero, zero)

    def ckpt(role: str, what: str) -> list[Component]:
        footprint = by.sampler_footprint if role == "sampler" else by.trainer_footprint
        raw = v["ckpt_process_start_s"] + v["ckpt_fixed_s"] + footprint / pcie
        keys = (
            "ckpt_process_start_s",
            "ckpt_fixed_s",
            "pcie_gbps",
            "vllm_gpu_memory_utilization" if role == "sampler" else "trainer_footprint_fraction",
            "hbm_gb",
        )
        return [
            Component(f"{role} cuda-checkpoint {what} (process start + fixed + footprint/PCIe)", raw, keys),
            Component(f"{role} {what}: 1 s operation poll", _poll(raw, v["operation_poll_s"]) - raw, ("operation_poll_s",)),
        ]

    def vllm_step(what: str, polled: bool) -> list[Component]:
        """vLLM's level-1 ``what`` ("sleep" or "wake"): fixed + weights at the sleep/wake bandwidth, and with
        ``polled`` the wait to the next 1 s operation poll."""
        raw = v[f"vllm_{what}_fixed_s"] + by.sampler_weights / vllm_bw
        out = [
            Component(
                f"sampler vLLM level-1 {what} (fixed + weights/15 GB/s)",
                raw,
                (f"vllm_{what}_fixed_s", "vllm_sleep_wake_gbps", "weight_bytes_per_param"),
            )
        ]
        if polled:
            out.append(
                Component(f"sampler {what}: 1 s operation poll", _poll(raw, v["operation_poll_s"]) - raw, ("operation_poll_s",))
            )
        return out

    if name in ("reference", "reference_vllm_sleep"):
        sleep_samplers = name == "reference_vllm_sleep"

        def suspend(role):
            if role == "sampler":
                drain = [Component("sampler drain: readiness probe + metric polling", v["probe_drain_s"], ("probe_drain_s",))]
                return drain + (vllm_step("sleep", True) if sleep_samplers else ckpt("sampler", "checkpoint"))
            return ckpt("trainer", "checkpoint")

        def resume(role):
            if role == "sampler" and sleep_samplers:
                return vllm_step("wake", True)
            return ckpt(role, "restore")

        return Strategy(name, suspend, resume)

    if name in ("llmd_timeslice", "llmd_timeslice_host_blake2b"):
        if name == "llmd_timeslice":  # as implemented: on the device, before copy-out / after copy-in
            check = Component(
                "trainer state checksum on the device (torch reductions)",
                v["device_checksum_fixed_s"] + by.trainer_state / (v["device_checksum_gbps"] * 1e9),
                ("device_checksum_gbps", "device_checksum_fixed_s"),
            )
        else:  # historical: BLAKE2b over the host copy on one core, after copy-out / before copy-in
            check = Component(
                "trainer state checksum: BLAKE2b on one host core",
                by.trainer_state / (v["host_blake2b_gbps"] * 1e9),
                ("host_blake2b_gbps",),
            )
        on_device = name == "llmd_timeslice"

        def suspend(role):
            if role == "sampler":
                return [
                    Component("sampler drain: gate drain barrier (event)", v["ts_drain_s"], ("ts_drain_s",)),
                    *vllm_step("sleep", False),
                    Component("sampler sleep verification + control (sidecar)", v["ts_sleep_control_s"], ("ts_sleep_control_s",)),
                ]
            copy = Component(
                "trainer offload: state/PCIe into reused pinned buffers",
                by.trainer_state / pcie,
                ("trainer_state_bytes_per_param", "pcie_gbps"),
            )
            return [
                *((check, copy) if on_device else (copy, check)),
                Component("trainer release (Yield RPC)", v["ts_release_s"], ("ts_release_s",)),
            ]

        def resume(role):
            if role == "sampler":
                return [
                    *vllm_step("wake", False),
                    Component(
                        "sampler wake verification + control (probe completion, SERVING)",
                        v["ts_wake_control_s"],
                        ("ts_wake_control_s",),
                    ),
                ]
            copy = Component(
                "trainer restore: state/PCIe from pinned buffers",
                by.trainer_state / pcie,
                ("trainer_state_bytes_per_param", "pcie_gbps"),
            )
            return [
                Component("trainer grant (control: publish, Acquire reply)", v["ts_grant_s"], ("ts_grant_s",)),
                *((copy, check) if on_device else (check, copy)),
            ]

        return Strategy(name, suspend, resume)
    raise ValueError(f"unknown strategy {name!r}")


STRATEGIES = ("dedicated", "reference", "llmd_timeslice")
VARIANTS = ("llmd_timeslice_host_blake2b", "reference_vllm_sleep", "ceiling")
