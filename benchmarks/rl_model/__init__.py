"""Discrete-event model (simpy) of GRPO jobs on one 8-accelerator node: dedicated vs time-slicing.

What the model counts
    *Duty cycle* = accelerator-seconds spent in useful work (a rollout phase generating, or a
    training phase computing) / (accelerators provisioned x wall time), over a steady-state window
    of whole iterations. Switching, draining, sleeping, waking, checkpointing, verifying and idling
    all count as not busy.

The workload
    A GRPO job iterates: rollout (its sampler, vLLM TP4, generates a batch on a group of 4
    accelerators) -> reward + rollout-buffer processing on CPU -> training step (its trainer,
    FSDP over a group of 4 accelerators) -> weight sync. Each phase keeps the same number of
    accelerators in every strategy, so phase durations are the same everywhere and every
    difference comes from waiting and from switch costs.

The strategies (same workload, same phase durations)
    * ``dedicated``: disaggregated; every job owns 4 sampler + 4 trainer accelerators (llm-d's
      standalone baseline); nothing ever switches. Two jobs use 16 accelerators.
    * time-slicing, *two-job case*: two jobs share one node's 8 accelerators. Layout
      ``interleaved`` (default, llm-d's two-job measurement): both jobs' samplers share group 0,
      both trainers share group 1, so while job A trains, job B rolls out. A group passes from one
      worker to another through a FIFO lock; a handover costs "suspend the resident worker" +
      "resume the incoming one", paid on the group (not busy) and on the incoming job's path.
      - ``reference``: llm-d's first design: drain by readiness probe + metric polling, each
        agent operation observed by a 1 s poll, process-level checkpoint (cuda-checkpoint) of
        the whole device footprint for samplers and trainers.
      - ``llmd_timeslice``: this project as implemented: router drain barrier (gate in-flight
        counts, events), vLLM level-1 sleep/wake verified, event-driven operations (no poll),
        trainer state offload/restore with reused pinned host buffers, verified by the checksum
        ``TorchStateOffloader`` computes with torch reductions on the tensor's own device (before
        the copy-out, and again after the copy-in), i.e. at device memory bandwidth.
      - ``llmd_timeslice_host_blake2b`` (historical variant): the same with the verification the
        offloader performed before the change: BLAKE2b over every byte of the host copy on one
        host core, on offload and again on restore. Kept to show what the device checksum buys.
      - ``reference_vllm_sleep`` (variant): the reference with vLLM sleep/wake for samplers
        (llm-d's batch-interleaving guide) instead of checkpointing them.
      - ``ceiling``: the same schedule with zero switch costs.

Each input carries its kind (``published`` with its source, ``measured here`` by
``--mode real``, or ``assumption``); the JSON lists them all.

The package, one concept a module (every name is also offered here): ``inputs`` (the figures and their sources),
``costs`` (workload and strategies), ``schedule`` (the schedule, analytic checks, experiments), ``eval_traffic`` (the
second traffic class), ``report`` (``rl_model.json``) and ``plots`` (``rl_model.png``). The command line is
``python -m benchmarks.rl_rollout --mode model``.
"""

from __future__ import annotations

from benchmarks.rl_model.costs import (
    STRATEGIES,
    VARIANTS,
    Bytes,
    Component,
    Strategy,
    Workload,
    _poll,
    make_strategy,
    make_workload,
)
from benchmarks.rl_model.eval_traffic import EVAL_RUNS, EvalClass, _next_tick, eval_class, eval_tradeoff, run_eval, simulate_eval
from benchmarks.rl_model.inputs import SOURCES, Input, _src, default_inputs, with_measured
from benchmarks.rl_model.plots import CATEGORIES, COLORS, LABELS, _category, plot_model
from benchmarks.rl_model.report import (
    DEFAULT_CPU_STATE_RATES,
    DEFAULT_REAL_RUN,
    PUBLISHED_POINTS,
    TARGET,
    _round,
    _strip,
    build_report,
    cpu_state_rates,
    print_report,
)
from benchmarks.rl_model.schedule import (
    SWEEP_NAMES,
    _Group,
    _overlap,
    _placement,
    _request_fractions,
    analytic_ceiling,
    analytic_dedicated,
    gap_for_dedicated_duty,
    run_config,
    simulate,
    sweep,
    winner,
)

__all__ = [
    "CATEGORIES",
    "COLORS",
    "DEFAULT_CPU_STATE_RATES",
    "DEFAULT_REAL_RUN",
    "EVAL_RUNS",
    "LABELS",
    "PUBLISHED_POINTS",
    "SOURCES",
    "STRATEGIES",
    "SWEEP_NAMES",
    "TARGET",
    "VARIANTS",
    "Bytes",
    "Component",
    "EvalClass",
    "Input",
    "Strategy",
    "Workload",
    "_Group",
    "_category",
    "_next_tick",
    "_overlap",
    "_placement",
    "_poll",
    "_request_fractions",
    "_round",
    "_src",
    "_strip",
    "analytic_ceiling",
    "analytic_dedicated",
    "build_report",
    "cpu_state_rates",
    "default_inputs",
    "eval_class",
    "eval_tradeoff",
    "gap_for_dedicated_duty",
    "make_strategy",
    "make_workload",
    "plot_model",
    "print_report",
    "run_config",
    "run_eval",
    "simulate",
    "simulate_eval",
    "sweep",
    "winner",
    "with_measured",
]
