"""llmd-timeslice: time-slice accelerators between vLLM samplers and trainers behind the llm-d router.

Control plane and node side: orchestrator, snapshot sidecar, TimeSlice client, discovery, gRPC API.
"""

import os as _os

# The project forks only to exec (Envoy, vLLM, components); gRPC's fork handlers are not needed and,
# with other threads inside gRPC, are a known source of crashes. Set before grpc is first imported.
_os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

__version__ = "0.1.0"
