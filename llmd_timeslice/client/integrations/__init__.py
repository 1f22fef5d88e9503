"""RL frameworks: upstream-compatible phase callbacks, and OpenAI-client rollouts through the router.

* :mod:`~llmd_timeslice.client.integrations.phase_callback`: ``TimesliceCallback`` (same names, phases, roles,
  environment contract and lock order as upstream's slime integration) and its asyncio variant;
* :mod:`~llmd_timeslice.client.integrations.rollouts`: ``TimeSliceRollouts``, ``openai`` SDK clients that ask the gate
  for a weight version, ride out its refusals (and the llm-d EPP's "wait" answers) and report the version that
  served each rollout; :mod:`~llmd_timeslice.client.integrations.refusals`: who refused a request and why;
* :mod:`~llmd_timeslice.client.integrations.verifiers`: the same for ``verifiers`` environments.

See docs/integrations.md.
"""

from llmd_timeslice.client.integrations import phase_callback
from llmd_timeslice.client.integrations.phase_callback import *  # noqa: F403 - the phase callbacks' public names
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
    "DROPPED_REASON_HEADER",
    "RETRYABLE_REASONS",
    "ROUTER_RETRYABLE_REASONS",
    "GateRetryPolicy",
    "Refusal",
    "RolloutRecord",
    "RolloutScope",
    "TimeSliceRollouts",
    "refusal_of",
]
__all__ += phase_callback.__all__
