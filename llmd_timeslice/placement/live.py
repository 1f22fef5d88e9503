"""A live orchestrator as the planner's source: its recorded profiles, measured switch costs and current holders
(``OrchestratorInfoService.ListProfiles``, ``TimeSliceOrchestratorService.GetGroupStatus``; blocking gRPC)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import grpc

from llmd_timeslice import auth, tls
from llmd_timeslice.api.llmd_timeslice.v1alpha1 import orchestrator_info_pb2 as info_pb
from llmd_timeslice.api.llmd_timeslice.v1alpha1 import orchestrator_info_pb2_grpc as info_grpc
from llmd_timeslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2 as pb
from llmd_timeslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2_grpc as pb_grpc
from llmd_timeslice.placement.evaluate import SwitchCosts
from llmd_timeslice.placement.profile import JobProfile
from llmd_timeslice.placement.wire import profile_of, switch_costs_of


class LiveUnavailable(RuntimeError):
    """The orchestrator could not be asked; the message is one line naming it and why."""


@dataclass
class LiveState:
    """What the orchestrator knows: profiles, measured switch costs (None: none yet), holders (group -> job)."""

    profiles: list[JobProfile]
    switch_costs: SwitchCosts | None
    holders: dict[str, str] = field(default_factory=dict)
    placement: info_pb.PlacementCheck | None = None


def fetch(orchestrator: str, token_file: Path | None = None, timeout_s: float = 10.0) -> LiveState:
    """Ask ``orchestrator`` (``host:port``) for its profiles, switch costs and holders.

    Raises:
        LiveUnavailable: unreachable, refused (token), or an orchestrator without ``ListProfiles``.
    """
    try:
        md = auth.call_metadata(auth.load_token(token_file))
    except (OSError, ValueError) as exc:
        raise LiveUnavailable(f"orchestrator {orchestrator}: token: {exc}") from None
    channel = tls.channel(orchestrator, tls.from_env())
    try:
        info = info_grpc.OrchestratorInfoServiceStub(channel)
        resp = info.ListProfiles(info_pb.ListProfilesRequest(), timeout=timeout_s, metadata=md)
        orch = pb_grpc.TimeSliceOrchestratorServiceStub(channel)
        holders = {}
        for gid in orch.ListGroups(pb.ListGroupsRequest(), timeout=timeout_s, metadata=md).group_ids:
            st = orch.GetGroupStatus(pb.GetGroupStatusRequest(group_id=gid), timeout=timeout_s, metadata=md).group
            if st.locking_job:
                holders[gid] = st.locking_job
    except grpc.RpcError as exc:
        code = exc.code()
        why = "it has no ListProfiles (an older orchestrator)" if code == grpc.StatusCode.UNIMPLEMENTED else exc.details()
        raise LiveUnavailable(f"orchestrator {orchestrator}: {code.name}: {why}") from None
    finally:
        channel.close()
    return LiveState(
        [profile_of(p) for p in resp.profiles],
        switch_costs_of(resp.switch_costs),
        holders,
        resp.placement if resp.HasField("placement") else None,
    )
