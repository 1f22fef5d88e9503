"""Who reaches the orchestrator's ports in the guide: the NetworkPolicy that keeps upstream's tokenless port to trainer
pods (docs/security.md), read with the rules of networking.k8s.io/v1 (an ingress rule without ``from`` admits every
source; a ``podSelector`` without ``namespaceSelector`` selects pods of the policy's namespace; a port may be a
container port's name)."""

from __future__ import annotations

import pytest

from tests.manifests.support import GATEWAYS, built, find

ORCHESTRATOR = "llmd-timeslice-orchestrator"


def _matches(selector: dict, labels: dict) -> bool:
    assert set(selector) <= {"matchLabels"}, f"only matchLabels is evaluated here: {selector}"
    return all(labels.get(k) == v for k, v in (selector.get("matchLabels") or {}).items())


def admits(policy: dict, pod_labels: dict, same_namespace: bool, port_name: str) -> bool:
    """Whether ``policy`` lets a pod with ``pod_labels`` reach the selected pods' container port ``port_name``."""
    for rule in policy["spec"].get("ingress") or []:
        if not any(p["port"] == port_name for p in rule.get("ports") or []) and rule.get("ports"):
            continue
        peers = rule.get("from")
        if not peers:
            return True
        for peer in peers:
            assert set(peer) <= {"podSelector"}, f"only same-namespace podSelector peers are evaluated here: {peer}"
            if same_namespace and _matches(peer["podSelector"], pod_labels):
                return True
    return False


def _orchestrator(docs) -> tuple[dict, dict, dict]:
    dep = find(docs, "Deployment", ORCHESTRATOR)
    return dep, dep["spec"]["template"]["spec"]["containers"][0], find(docs, "NetworkPolicy", ORCHESTRATOR)


@pytest.mark.parametrize("overlay", ["base", *GATEWAYS])
def test_only_trainer_pods_reach_the_tokenless_upstream_port_and_the_token_ports_stay_open(overlay):
    dep, container, policy = _orchestrator(built(overlay))
    assert _matches(policy["spec"]["podSelector"], dep["spec"]["template"]["metadata"]["labels"]), "selects the orchestrator"
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert f"--upstream-compat-port={ports['grpc-upstream']}" in container["args"]
    assert f"--port={ports['grpc']}" in container["args"] and any(a.startswith("--token-file=") for a in container["args"])
    trainer = {"timeslice.io/role": "trainer", "timeslice.io/group": "g"}
    sampler = {"timeslice.io/role": "sampler", "timeslice.io/group": "g", "llm-d.ai/guide": "x"}
    gate = {"app.kubernetes.io/name": "llmd-timeslice", "app.kubernetes.io/component": "gate"}
    assert admits(policy, trainer, True, "grpc-upstream")
    for who, labels, same_ns in (("a sampler", sampler, True), ("a gate", gate, True), ("a trainer elsewhere", trainer, False)):
        assert not admits(policy, labels, same_ns, "grpc-upstream"), f"{who} reaches the tokenless port"
    # Every other port is reachable as before the policy (the token guards grpc; metrics is read-only), so no
    # gate, operator or Prometheus lost its way in; and every container port is named by the policy.
    for name in set(ports) - {"grpc-upstream"}:
        assert admits(policy, gate, True, name) and admits(policy, {}, False, name), name
    named = {p["port"] for r in policy["spec"]["ingress"] for p in r["ports"]}
    assert named == set(ports), f"ports in the policy {named} vs the container's {set(ports)}"
    service = find(built(overlay), "Service", ORCHESTRATOR)
    assert {p["targetPort"] for p in service["spec"]["ports"]} == set(ports)


def test_the_trainer_component_labels_trainer_pods_so_the_policy_admits_them():
    job = find(built("modelserver/example"), "Job")
    policy = find(built("base"), "NetworkPolicy", ORCHESTRATOR)
    assert admits(policy, job["spec"]["template"]["metadata"]["labels"], True, "grpc-upstream")
    sampler = find(built("modelserver/example"), "Deployment")
    assert not admits(policy, sampler["spec"]["template"]["metadata"]["labels"], True, "grpc-upstream")
