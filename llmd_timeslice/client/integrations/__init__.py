"""RL frameworks: upstream-compatible phase callbacks, and OpenAI-client rollouts through the router.

* :mod:`~llmd_timeslice.client.integrations.phase_callback`: ``TimesliceCallback`` (same names, phases, roles,
  environment contract and lock order as upstream's slime integration) and its asyncio variant;
* :mod:`~llmd_timeslice.client.integrations.rollouts`: ``TimeSliceRollouts``, ``openai`` SDK clients that ask the gate
  for a weight version, ride out its refusals (and the llm-d EPP's "wait" answers) and report the version that
  served each rollout; :mod:`~llmd_timeslice.client.integrations.refusals`: who refused a request and why;
* :mod:`~llmd_timeslice.client.integrations.verifiers`: the same for ``verifiers`` environments.

See docs/integrations.md.
"""

from llmd_timeslice.client.integrations.phase_callback import (
    BOTH,
    ENV_JOB_ID,
    ENV_ORCH_ADDR,
    ENV_SAMPLER_GROUP,
    ENV_TRAINER_GROUP,
    ENV_WEIGHTS_DIR,
    PHASES,
    ROLES,
    SAMPLER,
    TRAINER,
    AsyncRoleLocks,
    AsyncTimesliceCallback,
    LockOrderError,
    LockOrderViolation,
    PhaseCallback,
    RoleLocks,
    TimesliceCallback,
    TimeSliceConfigError,
    TimesliceConfigError,
    UnknownPhase,
    UnknownRole,
    phase,
)
from llmd_timeslice.client.integrations.refusals import (
    DROPPED_REASON_HEADER,
    ROUTER_RETRYABLE_REASONS,
    Refusal,
    refusal_of,
)
from llmd_timeslice.client.integrations.rollouts import (
    RETRYABLE_REASONS,
    GateRetryPolicy,
    RolloutRecord,
    RolloutScope,
    TimeSliceRollouts,
)

__all__ = [
    "BOTH",
    "DROPPED_REASON_HEADER",
    "ENV_JOB_ID",
    "ENV_ORCH_ADDR",
    "ENV_SAMPLER_GROUP",
    "ENV_TRAINER_GROUP",
    "ENV_WEIGHTS_DIR",
    "PHASES",
    "RETRYABLE_REASONS",
    "ROLES",
    "ROUTER_RETRYABLE_REASONS",
    "SAMPLER",
    "TRAINER",
    "AsyncRoleLocks",
    "AsyncTimesliceCallback",
    "GateRetryPolicy",
    "LockOrderError",
    "LockOrderViolation",
    "PhaseCallback",
    "Refusal",
    "RoleLocks",
    "RolloutRecord",
    "RolloutScope",
    "TimeSliceConfigError",
    "TimeSliceRollouts",
    "TimesliceCallback",
    "TimesliceConfigError",
    "UnknownPhase",
    "UnknownRole",
    "phase",
    "refusal_of",
]
