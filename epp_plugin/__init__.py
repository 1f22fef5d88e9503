"""Router side of llmd-timeslice: Envoy ext_proc services (time-slice gate, EPP-protocol picker)."""

import os as _os

# Same as llmd_timeslice: no gRPC fork handlers (the project forks only to exec).
_os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
