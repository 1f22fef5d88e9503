"""Which group versions the API server serves for InferenceObjective, asked through the Kubernetes discovery API.

The gate asks what the EPP asks (llm-d/llm-d-router ``pkg/epp/server/controller_config.go`` at commit ebab687927f5,
``gvkExists``): ``GET /apis/<group>/<version>`` (an ``APIResourceList``, the ``kubernetes`` client's
``CustomObjectsApi.get_api_resources``) for each candidate of
:data:`llmd_timeslice.domain.objectives.GROUP_VERSIONS`, and a group version serves the kind when its list names
``kind: InferenceObjective``. A 404 means the group version is not served (no CRD). Unlike the EPP, which reads any
error as "absent", a refusal (401/403) or an unreachable API server is raised, so the gate can say which it is.

RBAC: none beyond the cluster's defaults. The discovery paths (``/apis``, ``/apis/*``) are granted by the ClusterRole
``system:discovery``, bound to every authenticated user (``system:authenticated``) by Kubernetes' bootstrap policy
(kubernetes/kubernetes ``plugin/pkg/auth/authorizer/rbac/bootstrappolicy/policy.go``, ``ClusterRoles`` and
``ClusterRoleBindings``); a ServiceAccount token is authenticated.
"""

from __future__ import annotations

from llmd_timeslice.domain.objectives import GROUP_VERSIONS, KIND

DISCOVERY_TIMEOUT_S = (5.0, 10.0)
"""(connect, read) timeout of one discovery request, seconds."""


class DiscoveryError(RuntimeError):
    """The discovery API did not answer whether a group version is served: ``status`` is the HTTP status (401, 403,
    5xx) or None when the API server could not be reached; the message names the path and the cause."""

    def __init__(self, message: str, status: int | None) -> None:
        super().__init__(message)
        self.status = status


def group_version(group: str, version: str) -> str:
    """``group/version``, as ``apiVersion`` spells it."""
    return f"{group}/{version}"


def served_group_versions(api_client, candidates: tuple[tuple[str, str], ...] = GROUP_VERSIONS) -> list[str]:
    """The ``group/version`` strings of ``candidates`` whose discovery document names the kind InferenceObjective,
    in the order of ``candidates`` (the first is the one the EPP reads). ``api_client``: a
    ``kubernetes.client.ApiClient``. Blocking (call it in a thread).

    Raises:
        DiscoveryError: a discovery request was refused (401, 403), failed (5xx) or the API server is unreachable.
    """
    from kubernetes import client

    api = client.CustomObjectsApi(api_client)
    served = []
    for group, version in candidates:
        path = f"/apis/{group}/{version}"
        try:
            resources = api.get_api_resources(group, version, _request_timeout=DISCOVERY_TIMEOUT_S)
        except Exception as exc:
            status = getattr(exc, "status", None) or None  # the client reports an unreachable server as status 0
            if status == 404:
                continue
            if status is None:
                raise DiscoveryError(f"GET {path}: {type(exc).__name__}: {exc}", None) from exc
            reason = getattr(exc, "reason", "") or ""
            raise DiscoveryError(f"GET {path}: {status} {reason}".rstrip(), status) from exc
        if any(r.kind == KIND for r in resources.resources or []):
            served.append(group_version(group, version))
    return served
