"""Turn the user's own model-server Deployment into a time-sliced sampler (``llmd-timeslice k8s modelserver``).

Input: the manifests of the model server as the user runs it (``kubectl get deploy NAME -o yaml``, ``kubectl get
... -o yaml`` giving a ``List``, or a guide's rendered manifests, ``kubectl kustomize <guide overlay>``; multi-document
YAML). Output: the same documents with, on the one model-server Deployment, and nothing else changed:

* the snapshot sidecar container ``timeslice-sidecar`` (:func:`sidecar_container`, the same container as the guide's
  ``modelserver/sampler/sidecar-patch.yaml``; a test keeps the two equal) and its token and ``/tmp`` volumes;
* on the model-server container: ``VLLM_SERVER_DEV_MODE=1`` (vLLM serves ``/sleep``, ``/wake_up``, ``/is_sleeping``
  only then: vLLM 0.32.0 ``vllm/entrypoints/serve/dev/``) and ``--enable-sleep-mode`` (vLLM 0.32.0 ``vllm/engine/arg_utils.py``);
* the pod labels and annotation the orchestrator and the gates agree on (``timeslice.io/role=sampler``,
  ``timeslice.io/serving=true``, ``timeslice.io/group``, annotation ``timeslice.io/pool``); the selector, being
  immutable, is left alone (the labels only go on the pod template);
* the group's shared DRA claim in place of the device plugin's ``nvidia.com/gpu`` (container ``resources.claims``,
  pod ``resourceClaims``), and the ``ResourceClaim`` itself (``resource.k8s.io/v1``) as one more document, with as
  many devices as the engine uses: ``--tensor-parallel-size`` x ``--pipeline-parallel-size`` x
  ``--data-parallel-size`` (or ``--data-parallel-size-local``) from its arguments (vLLM 0.32.0
  ``vllm/engine/arg_utils.py``: one engine's world size is TP x PP, each data-parallel rank of this pod is one
  more), else the container's
  ``nvidia.com/gpu`` request; both given and different, or neither: refused.

Refused with a one-line :class:`ValueError` naming the input: no model-server Deployment, more than one (``--name``
picks), a model server started through a shell (its flags cannot be added safely), more than one replica (every pod
that references the claim gets all of its devices, so two replicas would be two engines on the same devices; pass
``replicas=1`` to scale it down, or give each sampler its own group).
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterable
from dataclasses import dataclass

import yaml

from llmd_timeslice import yaml_files

MODELSERVER_CONTAINER = "modelserver"
"""The model-server container of the llm-d guides (llm-d/llm-d guides/optimized-baseline/modelserver/gpu/vllm)."""
SIDECAR_CONTAINER = "timeslice-sidecar"
TOKEN_SECRET = "llmd-timeslice-token"
TOKEN_DIR = "/var/run/secrets/llmd-timeslice"
GPU_RESOURCE = "nvidia.com/gpu"
CLAIM_REF_NAME = "accelerators"
SLEEP_FLAG = "--enable-sleep-mode"
DEV_MODE_ENV = "VLLM_SERVER_DEV_MODE"
SHELLS = {"sh", "bash", "/bin/sh", "/bin/bash", "/usr/bin/bash", "/usr/bin/env"}


@dataclass(frozen=True)
class SamplerSettings:
    """What the transform adds (the guide's ``settings.yaml``: ``image``, ``group``, ``pool``, ``device_class``)."""

    image: str = "registry.invalid/llmd-timeslice:0.1.0"
    group: str = "rollout-0"
    pool: str = "optimized-baseline"
    device_class: str = "gpu.nvidia.com"
    engine_port: int = 8000

    @property
    def claim_name(self) -> str:
        return f"{self.group}-accelerators"


def sidecar_container(s: SamplerSettings) -> dict:
    """The snapshot sidecar container (as in ``modelserver/sampler/sidecar-patch.yaml``)."""
    return {
        "name": SIDECAR_CONTAINER,
        "image": s.image,
        "imagePullPolicy": "IfNotPresent",
        "command": ["llmd-timeslice"],
        "args": [
            "sidecar",
            "--job-id=$(POD_NAME)",
            f"--engine-url=http://127.0.0.1:{s.engine_port}",
            "--host=0.0.0.0",
            "--port=9001",
            f"--token-file={TOKEN_DIR}/token",
            "--metrics-port=9095",
            "--log-level=info",
        ],
        "env": [{"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}],
        "ports": [
            {"name": "ts-grpc", "containerPort": 9001, "protocol": "TCP"},
            {"name": "ts-metrics", "containerPort": 9095, "protocol": "TCP"},
        ],
        "readinessProbe": {"grpc": {"port": 9001}, "periodSeconds": 5},
        "livenessProbe": {"grpc": {"port": 9001}, "periodSeconds": 10, "timeoutSeconds": 2, "failureThreshold": 3},
        "resources": {"requests": {"cpu": "50m", "memory": "64Mi"}, "limits": {"memory": "256Mi"}},
        "securityContext": restricted_security_context(),
        "volumeMounts": token_and_tmp_mounts(),
    }


def restricted_security_context() -> dict:
    """The container ``securityContext`` of every llmd-timeslice container (sidecar, gate): non-root (65532), no
    privilege escalation, read-only root, no capabilities, the runtime's seccomp profile (Pod Security "restricted")."""
    return {
        "runAsNonRoot": True,
        "runAsUser": 65532,
        "runAsGroup": 65532,
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "privileged": False,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def token_and_tmp_mounts() -> list[dict]:
    """Mounts of :func:`sidecar_volumes`: the control-plane token (read-only) and a writable ``/tmp``."""
    return [
        {"name": "llmd-timeslice-token", "mountPath": TOKEN_DIR, "readOnly": True},
        {"name": "llmd-timeslice-tmp", "mountPath": "/tmp"},
    ]


def sidecar_volumes() -> list[dict]:
    """The sidecar's volumes: the token (0444: the model server's pod sets no fsGroup) and its ``/tmp``."""
    return [
        {"name": "llmd-timeslice-token", "secret": {"secretName": TOKEN_SECRET, "defaultMode": 0o444}},
        {"name": "llmd-timeslice-tmp", "emptyDir": {"sizeLimit": "64Mi"}},
    ]


def resource_claim(s: SamplerSettings, count: int, namespace: str | None) -> dict:
    """The group's ResourceClaim: ``count`` devices of ``device_class``, shared by the sampler and the trainer."""
    meta: dict = {
        "name": s.claim_name,
        "labels": {"app.kubernetes.io/part-of": "llmd-timeslice", "timeslice.io/group": s.group},
    }
    if namespace:
        meta["namespace"] = namespace
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": meta,
        "spec": {
            "devices": {
                "requests": [
                    {
                        "name": CLAIM_REF_NAME,
                        "exactly": {"deviceClassName": s.device_class, "allocationMode": "ExactCount", "count": count},
                    }
                ]
            }
        },
    }


def _flag(where: str, args: list[str], *names: str) -> int | None:
    """The integer value of the last of ``names`` in ``args`` (``--x=N`` or ``--x N``); None when absent."""
    found = None
    for i, a in enumerate(args):
        for n in names:
            if a == n and i + 1 < len(args):
                found = args[i + 1]
            elif a.startswith(n + "="):
                found = a.split("=", 1)[1]
    if found is None:
        return None
    if not re.fullmatch(r"[1-9][0-9]*", found):
        raise ValueError(f"{where}: {names[0]} {found!r} is not a positive integer")
    return int(found)


def accelerator_count(container: dict, where: str) -> int:
    """Devices the engine of ``container`` uses: TP x PP x local DP from its arguments, else its GPU request.

    Raises:
        ValueError: the arguments and the GPU request disagree, or neither says.
    """
    args = [str(a) for a in [*(container.get("command") or []), *(container.get("args") or [])]]
    tp = _flag(where, args, "--tensor-parallel-size", "-tp")
    pp = _flag(where, args, "--pipeline-parallel-size", "-pp")
    dp_local = _flag(where, args, "--data-parallel-size-local", "-dpl")
    dp = dp_local if dp_local is not None else _flag(where, args, "--data-parallel-size", "-dp")
    from_args = None if (tp, pp, dp) == (None, None, None) else (tp or 1) * (pp or 1) * (dp or 1)
    res = container.get("resources") or {}
    requested = {str((res.get(k) or {}).get(GPU_RESOURCE)) for k in ("limits", "requests") if GPU_RESOURCE in (res.get(k) or {})}
    if len(requested) > 1:
        raise ValueError(f"{where}: {GPU_RESOURCE} limits and requests differ ({sorted(requested)})")
    from_request = int(requested.pop()) if requested else None
    if from_args is not None and from_request is not None and from_args != from_request:
        raise ValueError(
            f"{where}: the engine uses {from_args} accelerators (tensor x pipeline x data parallel) but the container "
            f"requests {from_request} {GPU_RESOURCE}: make them agree first"
        )
    count = from_args if from_args is not None else from_request
    if count is None:
        raise ValueError(
            f"{where}: cannot tell how many accelerators the engine uses: no --tensor-parallel-size/"
            f"--data-parallel-size argument and no {GPU_RESOURCE} request"
        )
    return count


def _deployments(docs: list) -> Iterable[dict]:
    for d in docs:
        if not isinstance(d, dict):
            continue
        if d.get("kind") == "List":
            yield from _deployments(d.get("items") or [])
        elif d.get("kind") == "Deployment":
            yield d


def _modelserver(dep: dict, container_name: str) -> dict | None:
    containers = ((dep.get("spec") or {}).get("template") or {}).get("spec", {}).get("containers") or []
    return next((c for c in containers if c.get("name") == container_name), None)


def _set_env(container: dict, name: str, value: str) -> None:
    env = container.setdefault("env", [])
    for e in env:
        if e.get("name") == name:
            e.pop("valueFrom", None)
            e["value"] = value
            return
    env.append({"name": name, "value": value})


def _merge_by_name(items: list, new: list[dict], what: str, where: str) -> list:
    names = {i.get("name") for i in items}
    for n in new:
        if n["name"] in names:
            raise ValueError(f"{where}: already has a {what} named {n['name']!r} (transformed twice?)")
    return [*items, *new]


def transform(
    text: str,
    s: SamplerSettings,
    *,
    name: str | None = None,
    container_name: str = MODELSERVER_CONTAINER,
    replicas: int | None = None,
    claim: bool = True,
    source: str = "input",
) -> tuple[str, int]:
    """Return (the documents of ``text`` with the model-server Deployment time-sliced + the ResourceClaim, devices).

    ``name``: the Deployment to change when the input has several model servers; ``replicas``: set the Deployment's
    replicas (only 1 is accepted: see the module docstring); ``claim`` False: no DRA (the device plugin's
    ``nvidia.com/gpu`` request stays, no ResourceClaim, any replica count); ``source``: the input's name for errors.

    Raises:
        ValueError: bad YAML shape or a refusal (module docstring), the message naming ``source`` and the Deployment.
    """
    try:
        docs = [d for d in yaml_files.load_all(text) if d is not None]
    except yaml_files.DuplicateKeyError as exc:
        raise ValueError(f"{source}: {exc}") from None
    except yaml.YAMLError as exc:
        raise ValueError(f"{source}: not YAML: {str(exc).splitlines()[0]}") from None
    if replicas is not None and replicas != 1:
        raise ValueError(f"--replicas {replicas}: a sampler sharing its group's claim runs one replica")
    deps = [d for d in _deployments(docs) if _modelserver(d, container_name) is not None]
    if name is not None:
        deps = [d for d in deps if (d.get("metadata") or {}).get("name") == name]
    if not deps:
        what = f"Deployment {name!r} with" if name else "Deployment with"
        raise ValueError(f"{source}: no {what} a container named {container_name!r} (--container, --name)")
    if len(deps) > 1:
        names = sorted(str((d.get("metadata") or {}).get("name")) for d in deps)
        raise ValueError(f"{source}: {len(deps)} model-server Deployments ({', '.join(names)}): pick one with --name")
    (dep,) = deps
    meta = dep.get("metadata") or {}
    where = f"{source}: Deployment {meta.get('name')}"
    spec = dep["spec"]
    if replicas is not None:
        spec["replicas"] = replicas
    if claim and spec.get("replicas", 1) != 1:
        raise ValueError(
            f"{where}: replicas {spec['replicas']}: every pod of it would get the group's devices (one claim); "
            "pass --replicas 1, or give each sampler its own group"
        )
    pod = spec["template"].setdefault("spec", {})
    ms = _modelserver(dep, container_name)
    assert ms is not None
    cmd = [str(c) for c in ms.get("command") or []]
    if cmd and (cmd[0] in SHELLS or cmd[-1] == "-c"):
        raise ValueError(
            f"{where}: container {container_name} starts vLLM through a shell ({' '.join(cmd)}): "
            f"add {SLEEP_FLAG} to its script and use `vllm serve` with an args list"
        )
    count = accelerator_count(ms, f"{where}, container {container_name}")
    # Sleep mode and vLLM's dev endpoints.
    args = ms.setdefault("args", [])
    if SLEEP_FLAG not in args and SLEEP_FLAG not in cmd:
        args.append(SLEEP_FLAG)
    _set_env(ms, DEV_MODE_ENV, "1")
    # The shared claim instead of the device plugin's grant.
    if claim:
        _claim_instead_of_gpus(ms, pod, s, where)
    # The sidecar.
    pod["containers"] = _merge_by_name(pod["containers"], [sidecar_container(s)], "container", where)
    pod["volumes"] = _merge_by_name(pod.get("volumes") or [], sidecar_volumes(), "volume", where)
    tmeta = spec["template"].setdefault("metadata", {})
    tmeta.setdefault("labels", {}).update(
        {"timeslice.io/role": "sampler", "timeslice.io/serving": "true", "timeslice.io/group": s.group}
    )
    tmeta.setdefault("annotations", {})["timeslice.io/pool"] = s.pool
    extra = [resource_claim(s, count, meta.get("namespace"))] if claim else []
    out = yaml.safe_dump_all([*docs, *extra], sort_keys=False, default_flow_style=False)
    return out, count


def _claim_instead_of_gpus(ms: dict, pod: dict, s: SamplerSettings, where: str) -> None:
    """The group's claim on the container and the pod; the device plugin's ``nvidia.com/gpu`` taken out."""
    res = ms.setdefault("resources", {})
    for k in ("limits", "requests"):
        if k in res and isinstance(res[k], dict):
            res[k].pop(GPU_RESOURCE, None)
            if not res[k]:
                del res[k]
    res["claims"] = _merge_by_name(res.get("claims") or [], [{"name": CLAIM_REF_NAME}], "resource claim", where)
    pod["resourceClaims"] = _merge_by_name(
        pod.get("resourceClaims") or [],
        [{"name": CLAIM_REF_NAME, "resourceClaimName": s.claim_name}],
        "pod resource claim",
        where,
    )


def load_sampler_settings(text: str, source: str) -> SamplerSettings:
    """``image``, ``group``, ``pool``, ``device_class`` from a guide ``settings.yaml`` (other keys ignored)."""
    try:
        data = yaml_files.load(text) or {}
    except yaml.YAMLError as exc:
        raise ValueError(f"{source}: {yaml_files.error_text(exc)}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{source}: expected a mapping of settings")
    fields = {k: data[k] for k in ("image", "group", "pool", "device_class") if k in data}
    for k, v in fields.items():
        if not isinstance(v, str) or not v:
            raise ValueError(f"{source}: {k} must be a non-empty string, got {v!r}")
    return SamplerSettings(**fields)


def copy_settings(s: SamplerSettings, **changes) -> SamplerSettings:
    """``s`` with the non-None ``changes``."""
    base = copy.copy(s.__dict__)
    base.update({k: v for k, v in changes.items() if v is not None})
    return SamplerSettings(**base)


SERVER_SET_METADATA = ("resourceVersion", "uid", "creationTimestamp", "generation", "managedFields", "selfLink")
"""Metadata the API server sets (``kubectl get -o yaml`` shows them; a ``kubectl replace`` must not carry them)."""


def restorable(text: str, source: str = "input") -> str:
    """The objects of a ``kubectl get -o yaml`` backup as ``kubectl replace -f -`` puts them back: every field as it
    was, less the server-set metadata (:data:`SERVER_SET_METADATA`) and ``status``. The clean-up replaces the
    time-sliced model server with exactly the Deployment the backup holds (Deployments accept an update without
    ``resourceVersion``: Kubernetes ``AllowUnconditionalUpdate``).

    Raises:
        ValueError: not YAML, or nothing in it.
    """
    try:
        docs = [d for d in yaml_files.load_all(text) if d is not None]
    except yaml_files.DuplicateKeyError as exc:
        raise ValueError(f"{source}: {exc}") from None
    except yaml.YAMLError as exc:
        raise ValueError(f"{source}: not YAML: {str(exc).splitlines()[0]}") from None
    if not docs:
        raise ValueError(f"{source}: no object in it")

    def clean(d):
        if not isinstance(d, dict):
            return d
        d = copy.deepcopy(d)
        if d.get("kind") == "List":
            d["items"] = [clean(i) for i in d.get("items") or []]
            d.pop("metadata", None)
            return d
        for k in SERVER_SET_METADATA:
            (d.get("metadata") or {}).pop(k, None)
        d.pop("status", None)
        return d

    return yaml.safe_dump_all([clean(d) for d in docs], sort_keys=False, default_flow_style=False)
