"""The guide's kustomize components: the samplers and the trainer of one accelerator group, their shared ResourceClaim,
and the gate reading InferenceObjectives from Kubernetes."""

from __future__ import annotations

from manifests.families.common import (
    SAMPLER_TARGET_KIND,
    GuideSettings,
    _component,
    _dump,
    _images,
    _json_patch,
)

# ------------------------------------------------------------------------------ model servers


def _sampler_target(s: GuideSettings) -> dict:
    return {"group": "apps", "version": "v1", "kind": SAMPLER_TARGET_KIND, "labelSelector": f"llm-d.ai/guide={s.guide}"}


TRAINER_TARGET = {"group": "batch", "version": "v1", "kind": "Job", "labelSelector": "timeslice.io/role=trainer"}


def sampler_component(s: GuideSettings) -> dict:
    labels = {
        "apiVersion": "apps/v1",
        "kind": SAMPLER_TARGET_KIND,
        "metadata": {"name": "timeslice-sampler"},
        "spec": {
            "template": {"metadata": {"labels": {"timeslice.io/group": s.group}, "annotations": {"timeslice.io/pool": s.pool}}}
        },
    }
    return _component(
        images=_images(s),
        patches=[
            {"path": "sidecar-patch.yaml", "target": _sampler_target(s)},
            {"path": "sleep-mode-patch.yaml", "target": _sampler_target(s)},
            {"patch": _dump(labels), "target": _sampler_target(s)},
        ],
    )


def trainer_component(s: GuideSettings) -> dict:
    labels = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": "timeslice-trainer"},
        "spec": {"template": {"metadata": {"labels": {"timeslice.io/group": s.group}}}},
    }
    return _component(
        patches=[
            {"path": "trainer-patch.yaml", "target": TRAINER_TARGET},
            {"patch": _dump(labels), "target": TRAINER_TARGET},
        ]
    )


def claim_name(s: GuideSettings) -> str:
    return f"{s.group}-accelerators"


def resource_claim(s: GuideSettings) -> dict:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {
            "name": claim_name(s),
            "labels": {"app.kubernetes.io/part-of": "llmd-timeslice", "timeslice.io/group": s.group},
        },
        "spec": {
            "devices": {
                "requests": [
                    {
                        "name": "accelerators",
                        "exactly": {"deviceClassName": s.device_class, "allocationMode": "ExactCount", "count": s.accelerators},
                    }
                ]
            }
        },
    }


def shared_accelerator_component(s: GuideSettings) -> dict:
    def pod_patch(api: str, kind: str, container: str, extra_spec: dict | None = None) -> str:
        return _dump(
            {
                "apiVersion": api,
                "kind": kind,
                "metadata": {"name": "shared-accelerator"},
                "spec": {
                    **(extra_spec or {}),
                    "template": {
                        "spec": {
                            "containers": [
                                {
                                    "name": container,
                                    "resources": {
                                        # null deletes the device-plugin request: its grants are exclusive, so the sampler and the
                                        # trainer could never get the same device.
                                        "limits": {"nvidia.com/gpu": None},
                                        "requests": {"nvidia.com/gpu": None},
                                        "claims": [{"name": "accelerators"}],
                                    },
                                }
                            ],
                            "resourceClaims": [{"name": "accelerators", "resourceClaimName": claim_name(s)}],
                        }
                    },
                },
            }
        )

    return _component(
        resources=["resourceclaim.yaml"],
        patches=[
            # One sampler pod per claim: every pod referencing a ResourceClaim gets all of its devices.
            {"patch": pod_patch("apps/v1", SAMPLER_TARGET_KIND, "modelserver", {"replicas": 1}), "target": _sampler_target(s)},
            {"patch": pod_patch("batch/v1", "Job", "trainer"), "target": TRAINER_TARGET},
        ],
    )


GATE_SERVICE_ACCOUNT = "llmd-timeslice-gate"
INFERENCE_OBJECTIVE_GROUPS = ["llm-d.ai", "inference.networking.x-k8s.io"]
"""The groups that serve InferenceObjective (llmd_timeslice.domain.objectives.GROUPS; a test keeps them equal)."""


def gate_objectives_rbac() -> list[dict]:
    """Role + RoleBinding: ``get``/``list``/``watch`` on ``inferenceobjectives`` only (both groups that serve them),
    for the gate's ServiceAccount."""
    labels = {"app.kubernetes.io/name": "llmd-timeslice", "app.kubernetes.io/component": "gate"}
    return [
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": {"name": "llmd-timeslice-gate-objectives", "labels": labels},
            "rules": [
                {
                    "apiGroups": list(INFERENCE_OBJECTIVE_GROUPS),
                    "resources": ["inferenceobjectives"],
                    "verbs": ["get", "list", "watch"],
                }
            ],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": {"name": "llmd-timeslice-gate-objectives", "labels": labels},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "llmd-timeslice-gate-objectives"},
            "subjects": [{"kind": "ServiceAccount", "name": GATE_SERVICE_ACCOUNT}],
        },
    ]


def gate_objectives_component() -> dict:
    """The gate Deployment with ``--objectives-from-kubernetes`` and a ServiceAccount token (it calls the API now)."""
    return _component(
        resources=["rbac.yaml"],
        patches=[
            {
                "target": {"group": "apps", "version": "v1", "kind": "Deployment", "name": "llmd-timeslice-gate"},
                "patch": _json_patch(
                    [
                        {"op": "add", "path": "/spec/template/spec/containers/0/args/-", "value": "--objectives-from-kubernetes"},
                        {"op": "replace", "path": "/spec/template/spec/automountServiceAccountToken", "value": True},
                    ]
                ),
            }
        ],
    )
