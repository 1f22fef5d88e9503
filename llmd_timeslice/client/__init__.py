"""The trainer side: what runs inside the RL job (docs/architecture.md, "Where each process's code lives").

This package is the TimeSlice client of the orchestrator (``acquire`` / ``release`` and ``on_accelerators``,
:mod:`~llmd_timeslice.client.client`); beside it, the trainer's state offload
(:mod:`~llmd_timeslice.client.torch_offload`), WorkloadChannel's workload side (:mod:`~llmd_timeslice.client.workload`)
and the RL-framework integrations (:mod:`~llmd_timeslice.client.integrations`).
"""

from llmd_timeslice.client.client import *  # noqa: F403 - the client's public names (client.__all__)
from llmd_timeslice.client.client import __all__ as __all__
