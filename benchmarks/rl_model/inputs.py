"""The RL model's inputs: every figure with its kind (published with its source, measured here, assumption), and the
built-in defaults replaced by a real run's measurements (``rl_real.json``)."""

from __future__ import annotations

from dataclasses import dataclass, replace

# --------------------------------------------------------------------------- sources
SOURCES = {
    "llmd_blog": (
        "llm-d blog 'RL Post-Training: Co-Operative Time-Slicing' (2026-06-28), "
        "github.com/llm-d/llm-d.github.io blog/2026-06-28_rl_time-slicing.md: 1 node of 8x H100 SXM5 80GB, "
        "Qwen2.5-7B GRPO (veRL), rollout batch 512, vLLM TP4, FSDP trainers; standalone duty cycle 41% "
        "(DCGM) -> 71% with two sampler workloads interleaved; ~95% theoretical peak"
    ),
    "llmd_guide": (
        "llm-d-rl-time-slicing guides/rl-batch-interleaving/README.md "
        "(github.com/llm-d-incubation/llm-d-rl-time-slicing): supervisor log 'drained in 2.82s', "
        "'vLLM slept (HBM -> host RAM) in 0.97s', 'vLLM woke in 0.05s' (Qwen2.5-0.5B); sleep/wake "
        "'~1 s per 15 GB to host RAM'; 'trainer checkpoint ~ full GPU allocation'; cuda-checkpoint "
        "'~10-35 s per swap for a 1.5 B trainer'"
    ),
    "field": "docs/benchmarks.md, 'Figures from the field' (reference figures and where each comes from)",
    "zero": (
        "Rajbhandari et al., 'ZeRO: Memory Optimizations Toward Training Trillion Parameter Models' (SC'20): "
        "mixed-precision Adam keeps 16 bytes per parameter (2 weights + 2 grads + 12 fp32 master/m/v)"
    ),
    "vllm_docs": "vLLM engine arguments: --gpu-memory-utilization defaults to 0.9 (the KV-cache pool is preallocated)",
    "blake2": "blake2.net: BLAKE2b at 3.08 cycles/byte on Skylake, about 1 GB/s per core",
    "h100": "NVIDIA H100 SXM5: 80 GB HBM3, ~3.35 TB/s",
    "torch_offload": (
        "llmd_timeslice/client/torch_offload.py: tensor_checksum() = torch.sum over the tensor's raw "
        "words + a sum of its 4 KiB-chunk sums weighted by position (two reads of every byte, ~10 torch "
        "ops and 2 host syncs per tensor), on the tensor's device, before copy-out and after copy-in"
    ),
}


@dataclass(frozen=True)
class Input:
    """One model input: its value, unit, kind (published / measured here / assumption) and source."""

    value: float
    unit: str
    kind: str
    source: str

    def to_json(self) -> dict:
        return {"value": self.value, "unit": self.unit, "kind": self.kind, "source": self.source}


def _src(key: str, detail: str = "") -> str:
    """``detail [key]``: the key names an entry of :data:`SOURCES` (written into the JSON)."""
    return f"{detail} [{key}]" if detail else f"[{key}]"


def default_inputs() -> dict[str, Input]:
    """Every input of the model with its default and where it comes from."""
    pub, asm, meas = "published", "assumption", "measured here"
    return {
        # ---- node and workload
        "node_accelerators": Input(8, "accelerators", pub, _src("llmd_blog", "one 8-GPU node")),
        "group_size": Input(4, "accelerators per phase", pub, _src("llmd_blog", "vLLM TP4 samplers; trainer on 4")),
        "model_b": Input(7, "billion parameters", pub, _src("llmd_blog", "Qwen2.5-7B")),
        "phase_s_at_7b": Input(
            120,
            "s of rollout + training per iteration at 7B",
            asm,
            "no per-phase timing is published; 512 prompts x 1024 tokens on 4 H100 per phase is of "
            "the order of a minute each; phases scale linearly with parameters in the sweep",
        ),
        "rollout_fraction": Input(0.5, "rollout / (rollout + training)", asm, "swept 0.25..0.75"),
        "cpu_gap_s": Input(
            3.0,
            "s per iteration (reward on CPU + rollout-buffer processing)",
            asm,
            _src("llmd_blog", "accelerators idle during reward computation on CPU and buffer processing"),
        ),
        "weight_sync_gbps": Input(
            5.0, "GB/s effective trainer->sampler weight sync", asm, "NCCL/IPC weight update incl. gather; 7B bf16 -> 2.8 s"
        ),
        "requests_per_rollout": Input(512, "requests", pub, _src("llmd_blog", "rollout batch size 512")),
        "iterations": Input(24, "iterations per job (3 warm-up, last excluded)", asm, "steady state"),
        "jobs": Input(2, "RL jobs", pub, _src("llmd_blog", "two-job case")),
        # ---- hardware
        "hbm_gb": Input(80, "GB per accelerator", pub, _src("h100")),
        "pcie_gbps": Input(
            50,
            "GB/s per direction per accelerator",
            pub,
            _src("field", "PCIe Gen5 x16 ~63 GB/s theoretical, ~50 GB/s practical"),
        ),
        "weight_bytes_per_param": Input(2, "bytes (bf16)", asm, "bf16 weights for sampling"),
        "trainer_state_bytes_per_param": Input(16, "bytes", pub, _src("zero")),
        "vllm_gpu_memory_utilization": Input(0.9, "of HBM held by a vLLM process", pub, _src("vllm_docs")),
        "trainer_footprint_fraction": Input(
            0.9, "of HBM held by a trainer process", pub, _src("llmd_guide", "'trainer checkpoint ~ full GPU allocation'")
        ),
        # ---- reference design
        "probe_drain_s": Input(2.82, "s", pub, _src("llmd_guide", "'drained in 2.82s'")),
        "operation_poll_s": Input(1.0, "s", pub, _src("field", "orchestrator polls agent operations every 1 s")),
        "ckpt_process_start_s": Input(
            2.7, "s per cuda-checkpoint call", pub, _src("field", "~2.7 s of process start per call unless a helper stays up")
        ),
        "ckpt_fixed_s": Input(
            1.0,
            "s per checkpoint/restore besides moving bytes",
            pub,
            _src("field", "cuda-checkpoint ~1-3 s resume for small models (low end taken)"),
        ),
        # ---- vLLM level-1 sleep/wake
        "vllm_sleep_fixed_s": Input(0.9, "s", pub, _src("llmd_guide", "0.97 s for Qwen2.5-0.5B (~1 GB) less its bytes")),
        "vllm_wake_fixed_s": Input(0.05, "s", pub, _src("llmd_guide", "'vLLM woke in 0.05s' (0.5B)")),
        "vllm_sleep_wake_gbps": Input(15, "GB/s per accelerator", pub, _src("llmd_guide", "'~1 s per 15 GB'")),
        # ---- this project, measured by --mode real (defaults: the run DEFAULT_REAL_RUN on this machine, 2 cores)
        "ts_drain_s": Input(
            0.0015,
            "s (publish DRAINING + drain barrier, nothing in flight)",
            meas,
            "orchestrator switch_phase_seconds{publish_draining,drain}, --mode real",
        ),
        "ts_sleep_control_s": Input(
            0.149,
            "s (sidecar: idle check, /sleep, /is_sleeping + metric verification)",
            meas,
            "switch_phase_seconds{sleep} on vLLM-CPU, where sleep moves no bytes, --mode real",
        ),
        "ts_wake_control_s": Input(
            0.176,
            "s (sidecar wake + verification incl. probe completion, publish SERVING)",
            meas,
            "switch_phase_seconds{wake} on vLLM-CPU, --mode real",
        ),
        "ts_release_s": Input(0.0042, "s (Yield RPC)", meas, "client release() wall time, --mode real"),
        "ts_grant_s": Input(
            0.069, "s (publish ASLEEP, grant, Acquire reply)", meas, "acquire wall time less its measured phases, --mode real"
        ),
        # ---- trainer-state checksum (as implemented: torch reductions on the device)
        "device_checksum_gbps": Input(
            1300,
            "GB/s per accelerator (bytes covered per second by the on-device checksum)",
            asm,
            _src(
                "torch_offload",
                "two memory-bound reads of every byte at ~80% of H100 HBM3's 3.35 TB/s [h100]; "
                "not measured on an accelerator here",
            ),
        ),
        "device_checksum_fixed_s": Input(
            0.15,
            "s per checksum of one rank's state (per-tensor launches and host syncs)",
            asm,
            _src(
                "torch_offload",
                "~1,700 state tensors per rank (FSDP2 shards of Qwen2.5-7B's 339 parameters: "
                "parameter, gradient, Adam exp_avg / exp_avg_sq / step) x ~90 us (~10 torch ops + 2 host syncs); "
                "taken as constant across model sizes",
            ),
        ),
        "cpu_checksum_gbps": Input(
            5.78,
            "GB/s (state_checksum over ~1 GB of trainer state on this machine's CPU)",
            meas,
            "rl_real.py bulk_state_rates(), --mode real; CPU, no accelerator: used only as a "
            "floor of device_checksum_gbps in the sensitivity",
        ),
        # ---- the second traffic class (benchmarks.priorities; group settings of docs/group-settings.md)
        "eval_rps": Input(1.0, "requests/s to one job's sampler pool", asm, "issue 26: eval traffic at 1 rps"),
        "eval_hold_deadline_s": Input(5.0, "s (the eval band's hold deadline)", asm, "issue 26: eval, 5 s deadline"),
        "eval_max_hold_s": Input(120.0, "s (the eval band's longest hold)", asm, "the gate's default max_hold_s"),
        "eval_service_s": Input(
            0.5, "s per eval request on an awake sampler", asm, "a short completion; also the drain before it sleeps again"
        ),
        "yield_request_fraction": Input(
            0.5, "of the hold deadline", asm, "GroupSettings.yield_request_fraction default (docs/group-settings.md)"
        ),
        "min_training_s": Input(10.0, "s", asm, "GroupSettings.min_training_s default (docs/group-settings.md)"),
        "train_step_s": Input(
            2.0,
            "s of compute between the trainer's safe points (step boundaries)",
            asm,
            "a yield waits for the next step boundary (phase-callback integration); swept 0.5..7.5",
        ),
        "heartbeat_period_s": Input(
            1.0,
            "s between lease heartbeats (the holder learns a yield request on the next answer)",
            asm,
            "the client renews every lease_ttl_s / 3: a group with lease_ttl_s = 3",
        ),
        "hold_pressure_period_s": Input(
            0.25, "s between the gate's hold-pressure reports", asm, "the gate's HoldPressure cadence (issue 26 contract)"
        ),
        "host_blake2b_gbps": Input(
            1.0,
            "GB/s per rank (BLAKE2b over the host copy, one core)",
            pub,
            _src(
                "blake2",
                "historical variant only: the offloader before the device "
                "checksum hashed every byte on offload and again on restore",
            ),
        ),
    }


def with_measured(inputs: dict[str, Input], real: dict | None) -> dict[str, Input]:
    """Replace the ``measured here`` defaults with the figures of a real run (``rl_real.json``)."""
    if not real:
        return inputs
    out = dict(inputs)
    measured = real.get("model_inputs", {})
    for key, val in measured.items():
        if key in out and out[key].kind == "measured here" and val.get("value") is not None:
            out[key] = replace(
                out[key], value=float(val["value"]), source=f"{out[key].source} ({real.get('run_id', 'rl_real.json')})"
            )
    return out
