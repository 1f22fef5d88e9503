"""``llmd-timeslice k8s modelserver``: the user's own model-server Deployment, time-sliced, nothing else changed.

Issue 25 defects 2 and 3: the guide used to apply a pinned remote overlay of an upstream guide over the user's
model server (another model, other labels, an immutable selector), and its claim held one device whatever the
engine's parallelism. The fixtures are upstream-shaped Deployments of two llm-d guide commits (each cited in its
header, tests/fixtures/modelserver): the transform must add exactly the sidecar, sleep mode, the sampler labels and
the shared claim with as many devices as the engine uses, and leave every other field as it was.
"""

from __future__ import annotations

import copy
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from llmd_timeslice.k8s_modelserver import SamplerSettings, sidecar_container, sidecar_volumes, transform
from tests.support.cli import run_cli

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures" / "modelserver"
TP2 = FIXTURES / "optimized-baseline-ae9f98f12658.yaml"
LISTED = FIXTURES / "optimized-baseline-05b03f75739f.yaml"
SAMPLER = REPO / "manifests" / "guides" / "time-slicing" / "modelserver" / "sampler"
K8S_VERSION = "1.34.0"
S = SamplerSettings(image="registry.example/llmd-timeslice:0.1.0", group="g1", pool="optimized-baseline")


def _docs(text: str) -> list[dict]:
    return [d for d in yaml.safe_load_all(text) if d is not None]


def _deployment(docs: list[dict]) -> dict:
    for d in docs:
        if d["kind"] == "List":
            return next(i for i in d["items"] if i["kind"] == "Deployment")
        if d["kind"] == "Deployment":
            return d
    raise AssertionError("no Deployment")


def _without_ours(dep: dict) -> dict:
    """``dep`` with exactly what the transform adds taken out again (and the GPU request put back by the caller)."""
    dep = copy.deepcopy(dep)
    tmpl = dep["spec"]["template"]
    for k in ("timeslice.io/role", "timeslice.io/serving", "timeslice.io/group"):
        tmpl["metadata"]["labels"].pop(k)
    tmpl["metadata"]["annotations"].pop("timeslice.io/pool")
    if not tmpl["metadata"]["annotations"]:
        del tmpl["metadata"]["annotations"]
    pod = tmpl["spec"]
    pod["containers"] = [c for c in pod["containers"] if c["name"] != "timeslice-sidecar"]
    ours = {v["name"] for v in sidecar_volumes()}
    pod["volumes"] = [v for v in pod["volumes"] if v["name"] not in ours]
    assert pod.pop("resourceClaims") == [{"name": "accelerators", "resourceClaimName": "g1-accelerators"}]
    ms = next(c for c in pod["containers"] if c["name"] == "modelserver")
    assert ms["args"].pop() == "--enable-sleep-mode"
    ms["env"] = [e for e in ms["env"] if e["name"] != "VLLM_SERVER_DEV_MODE"]
    if not ms["env"]:
        del ms["env"]
    assert ms["resources"].pop("claims") == [{"name": "accelerators"}]
    return dep


def _put_back_gpus(dep: dict, n) -> dict:
    dep = copy.deepcopy(dep)
    ms = next(c for c in dep["spec"]["template"]["spec"]["containers"] if c["name"] == "modelserver")
    for k in ("limits", "requests"):
        ms["resources"][k]["nvidia.com/gpu"] = n
    return dep


def test_a_tp2_guide_deployment_gets_a_two_device_claim_and_keeps_every_other_field():
    src = TP2.read_text()
    out, count = transform(src, S, replicas=1, source=TP2.name)
    before, after = _docs(src), _docs(out)
    assert count == 2
    claim = after[-1]
    assert claim["kind"] == "ResourceClaim" and claim["metadata"] == {
        "name": "g1-accelerators",
        "labels": {"app.kubernetes.io/part-of": "llmd-timeslice", "timeslice.io/group": "g1"},
        "namespace": "default",
    }
    assert claim["spec"]["devices"]["requests"] == [
        {
            "name": "accelerators",
            "exactly": {"deviceClassName": "gpu.nvidia.com", "allocationMode": "ExactCount", "count": 2},
        }
    ]
    dep = _deployment(after)
    expected = copy.deepcopy(before[0])
    expected["spec"]["replicas"] = 1  # asked for: one pod per claim
    assert _put_back_gpus(_without_ours(dep), 2) == expected
    pod = dep["spec"]["template"]["spec"]
    assert [c["name"] for c in pod["containers"]] == ["modelserver", "timeslice-sidecar"]
    assert "nvidia.com/gpu" not in pod["containers"][0]["resources"]["limits"]
    assert {"name": "VLLM_SERVER_DEV_MODE", "value": "1"} in pod["containers"][0]["env"]
    assert dep["spec"]["selector"] == before[0]["spec"]["selector"], "the immutable selector is untouched"
    for d in (dep, claim):
        kubernetes_validate.validate(d, K8S_VERSION, strict=True)


def test_a_kubectl_get_list_of_another_guide_version_keeps_its_list_env_and_server_fields():
    src = LISTED.read_text()
    out, count = transform(src, S, replicas=1, source=LISTED.name)
    before, after = _docs(src), _docs(out)
    assert count == 1
    assert len(after) == 2 and after[0]["kind"] == "List" and after[1]["kind"] == "ResourceClaim"
    assert after[1]["metadata"]["namespace"] == "llm-d-optimized-baseline"
    dep = _deployment(after)
    expected = copy.deepcopy(before[0]["items"][0])
    expected["spec"]["replicas"] = 1
    assert _put_back_gpus(_without_ours(dep), "1") == expected
    env = dep["spec"]["template"]["spec"]["containers"][0]["env"]
    assert env[0]["name"] == "HF_TOKEN" and env[-1] == {"name": "VLLM_SERVER_DEV_MODE", "value": "1"}
    assert dep["status"] == before[0]["items"][0]["status"]


@pytest.mark.parametrize("fixture", [TP2, LISTED], ids=lambda p: p.stem)
def test_more_than_one_replica_is_refused_by_name(fixture):
    with pytest.raises(
        ValueError, match=r"Deployment optimized-baseline-nvidia-gpu-vllm-decode: replicas (10|2): .*--replicas 1"
    ):
        transform(fixture.read_text(), S, source=fixture.name)


def _one(container_patch: dict, replicas: int = 1) -> str:
    dep = yaml.safe_load(TP2.read_text())
    dep["spec"]["replicas"] = replicas
    ms = dep["spec"]["template"]["spec"]["containers"][0]
    ms.update(container_patch)
    return yaml.safe_dump(dep)


@pytest.mark.parametrize(
    ("patch", "count"),
    [
        ({"args": ["m", "--tensor-parallel-size", "4"], "resources": {}}, 4),
        ({"args": ["m", "-tp", "2", "--data-parallel-size=2"], "resources": {"limits": {"nvidia.com/gpu": 4}}}, 4),
        ({"args": ["m", "--tensor-parallel-size=2", "--pipeline-parallel-size=2"], "resources": {}}, 4),
        ({"args": ["m", "-tp=2", "-dp=4", "--data-parallel-size-local=1"], "resources": {}}, 2),
        ({"args": ["m"], "resources": {"limits": {"nvidia.com/gpu": 8}, "requests": {"nvidia.com/gpu": 8}}}, 8),
    ],
)
def test_the_claim_follows_the_engines_parallelism_or_the_gpu_request(patch, count):
    out, n = transform(_one(patch), S)
    assert n == count and _docs(out)[-1]["spec"]["devices"]["requests"][0]["exactly"]["count"] == count


@pytest.mark.parametrize(
    ("patch", "message"),
    [
        (
            {"args": ["m", "--tensor-parallel-size=2"], "resources": {"limits": {"nvidia.com/gpu": 1}}},
            "uses 2 accelerators .* requests 1",
        ),
        ({"args": ["m"], "resources": {}}, "cannot tell how many accelerators"),
        ({"args": ["m", "--tensor-parallel-size=two"]}, "--tensor-parallel-size 'two' is not a positive integer"),
        ({"resources": {"limits": {"nvidia.com/gpu": 2}, "requests": {"nvidia.com/gpu": 1}}}, "limits and requests differ"),
        ({"command": ["/bin/sh", "-c"], "args": ["vllm serve m --tensor-parallel-size=2"]}, "through a shell"),
        ({"name": "vllm"}, "no Deployment with a container named 'modelserver'"),
    ],
)
def test_each_kind_of_bad_model_server_is_refused_with_one_line(patch, message):
    with pytest.raises(ValueError, match=message) as err:
        transform(_one(patch), S, source="dep.yaml")
    assert "\n" not in str(err.value) and str(err.value).startswith("dep.yaml"), str(err.value)


def test_two_model_servers_need_a_name_and_a_transformed_one_is_not_transformed_again():
    a = yaml.safe_load(_one({}))
    b = copy.deepcopy(a)
    b["metadata"]["name"] = "other-decode"
    two = yaml.safe_dump_all([a, b])
    with pytest.raises(
        ValueError, match=r"2 model-server Deployments \(optimized-baseline-nvidia-gpu-vllm-decode, other-decode\)"
    ):
        transform(two, S)
    out, _ = transform(two, S, name="other-decode")
    docs = _docs(out)
    assert docs[0] == a and [c["name"] for c in docs[1]["spec"]["template"]["spec"]["containers"]][-1] == "timeslice-sidecar"
    with pytest.raises(ValueError, match=r"already has a .* named"):
        transform(yaml.safe_dump(docs[1]), S)
    with pytest.raises(ValueError, match="not YAML"):
        transform("a: [", S, source="x")


def test_the_sidecar_is_the_sampler_components_sidecar():
    """One sidecar: the CLI's and the kustomize component's (modelserver/sampler/sidecar-patch.yaml) are equal."""
    patch = yaml.safe_load((SAMPLER / "sidecar-patch.yaml").read_text())
    pod = patch["spec"]["template"]["spec"]
    (theirs,) = [c for c in pod["containers"] if c["name"] == "timeslice-sidecar"]
    ours = sidecar_container(SamplerSettings(image=theirs["image"]))
    assert ours == theirs
    assert sidecar_volumes() == pod["volumes"]
    assert [e for c in pod["containers"] if c["name"] == "modelserver" for e in c["env"]] == [
        {"name": "VLLM_SERVER_DEV_MODE", "value": "1"}
    ]


def test_the_cli_reads_stdin_or_a_file_and_settings(tmp_path):
    settings = tmp_path / "settings.yaml"
    settings.write_text("group: g9\nimage: r.example/ts:1\npool: p\ndevice_class: gpu.example.com\nguide: x\n")
    r = run_cli("k8s", "modelserver", str(TP2), "--settings", str(settings), "--replicas", "1")
    assert r.returncode == 0, r.stderr
    docs = _docs(r.stdout)
    assert docs[-1]["metadata"]["name"] == "g9-accelerators"
    assert docs[-1]["spec"]["devices"]["requests"][0]["exactly"]["deviceClassName"] == "gpu.example.com"
    assert "claim g9-accelerators: 2 device(s)" in r.stderr
    bad = run_cli("k8s", "modelserver", str(TP2))
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "replicas 10" in bad.stderr, bad.stderr


def test_the_cli_reads_stdin(monkeypatch):
    import io
    import sys

    monkeypatch.setattr(sys, "stdin", io.StringIO(TP2.read_text()))
    r = run_cli("k8s", "modelserver", "-", "--replicas", "1", "--group", "g2")
    assert r.returncode == 0, r.stderr
    assert _docs(r.stdout)[-1]["metadata"]["name"] == "g2-accelerators"


def test_without_dra_the_gpu_request_stays_and_no_claim_is_printed():
    out, count = transform(TP2.read_text(), S, claim=False)
    docs = _docs(out)
    assert count == 2 and len(docs) == 1
    pod = docs[0]["spec"]["template"]["spec"]
    assert pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 2 and "resourceClaims" not in pod
    assert docs[0]["spec"]["replicas"] == 10 and pod["containers"][-1]["name"] == "timeslice-sidecar"


def test_clean_up_puts_back_exactly_the_deployment_that_was_there(tmp_path):
    """Issue 25 defect 7: the clean-up re-applied the guide's overlay (another model, other labels). The install
    keeps a backup (``kubectl get -o yaml | tee``) and the clean-up replaces the time-sliced Deployment with it:
    what ``kubectl replace`` receives is the original object, field for field, less what the server sets."""
    from llmd_timeslice.k8s_modelserver import SERVER_SET_METADATA, restorable

    backup = LISTED.read_text()
    installed, _ = transform(backup, S, replicas=1)
    assert _deployment(_docs(installed)) != _deployment(_docs(backup))
    restored = _deployment(_docs(restorable(backup, "backup")))
    original = copy.deepcopy(_deployment(_docs(backup)))
    original.pop("status")
    for k in SERVER_SET_METADATA:
        original["metadata"].pop(k, None)
    assert restored == original
    kubernetes_validate.validate(restored, K8S_VERSION, strict=True)
    (tmp_path / "b.yaml").write_text(backup)
    r = run_cli("k8s", "restore", str(tmp_path / "b.yaml"))
    assert r.returncode == 0 and _docs(r.stdout)[0]["items"][0] == restored
    bad = run_cli("k8s", "restore", str(tmp_path / "missing.yaml"))
    assert bad.returncode == 2 and "missing.yaml" in bad.stderr
