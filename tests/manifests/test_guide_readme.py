"""The guide README's install: which edge each variant runs, one upgrade to the pinned release with backups, and a
clean-up that rolls back and restores them."""

from __future__ import annotations

import re

from tests.manifests.support import (
    GUIDE,
)

# ------------------------------------------------------------------ the README's install


def test_readme_says_which_edge_each_variant_runs_and_the_istio_install_folds_the_gate_into_the_recipe():
    text = (GUIDE / "README.md").read_text()
    table = text.split("| variant | edge |")[1].split("\n\n")[0]
    edges = {row.split("|")[1].strip(): row.split("|")[2].strip() for row in table.strip().splitlines()[2:]}
    assert set(edges) == {
        "standalone Envoy",
        "Istio",
        "Istio (`istio-ext-proc`)",
        "agentgateway",
        "Envoy Gateway",
        "label fallback",
    }
    assert edges["Istio"].startswith("**fast path**") and all(
        e.startswith("ext_proc") for v, e in edges.items() if v not in ("Istio", "label fallback")
    )
    for why in ("**Standalone Envoy: ext_proc**", "**Envoy Gateway: ext_proc.**", "**Envoy id**"):
        assert why in text, f"the README must say why: {why}"
    block = text.split("#### Istio (fast path")[1].split("####")[0]
    assert "-o yaml | tee ts-backup-gateway-parameters.yaml" in block, "the Gateway's parameters as they run, backed up"
    assert "| python3 manifests/generate.py --istio-parameters - | kubectl apply" in block
    assert re.search(r"kubectl apply -k \$\{TS\}/gateways/istio\s", block)


def test_readme_install_upgrades_once_to_the_pinned_release_and_backs_up_what_it_changes():
    """Issue 25 defect 5 kept the release's values (ours on top); issue 37 §4 pins the chart and the EPP image instead
    of following the release's -dev chart: one helm upgrade per variant, to the pinned release, values carried over
    with --reset-then-reuse-values. The order of the steps: tests/manifests/test_guide_steps.py."""
    text = (GUIDE / "README.md").read_text()
    block = text.split("<!-- install:start -->")[1].split("<!-- install:end -->")[0]
    variants = re.split(r"^#### ", block, flags=re.M)[1:]
    assert len(variants) == 6
    for variant in variants:
        title, body = variant.split("\n", 1)
        code = "\n".join(re.findall(r"```bash\n(.*?)```", body, flags=re.S))
        upgrades = re.findall(r"^helm upgrade .*?(?:\n(?=\S)|\Z)", code, flags=re.M | re.S)
        assert len(upgrades) == 1, f"{title}: one helm upgrade"
        assert "--version v0.10.0" in upgrades[0] and "--reset-then-reuse-values" in upgrades[0], title
        assert "-f ${REPO_ROOT}" not in upgrades[0], "the release's own values are carried over, not re-given"
        assert "| tee ts-backup-modelserver.yaml" in code and "llmd-timeslice k8s modelserver -" in code, title
    head = block.split("#### ")[0]
    assert "export TS_ROUTER_REVISION=$(helm history " in head
    for pin in ("v0.9.0", "v0.10.0", "v1.5.0", "v1.5.1", "1.29.2", "v1.1.0", "v1.9.0"):
        assert pin in text, f"README must pin {pin}"


def test_readme_clean_up_rolls_back_and_restores_the_backups():
    """Issue 25 defect 7: the clean-up re-installed the router with the guide's values files only (its --set flags,
    httpRoute.* among them, were lost: gateway mode with no route) and re-applied the guide's overlay as the model
    server. It now rolls the release back to the recorded revision and replaces each object with its backup."""
    block = (GUIDE / "README.md").read_text().split("## Clean up")[1]
    code = "\n".join(re.findall(r"```bash\n(.*?)```", block, flags=re.S))
    assert code.splitlines()[0].startswith("helm rollback ${GUIDE_NAME} ${TS_ROUTER_REVISION}"), "router first"
    assert "helm upgrade" not in code
    for backup in ("ts-backup-modelserver.yaml", "ts-backup-gateway-parameters.yaml"):
        assert f"llmd-timeslice k8s restore {backup} | kubectl replace -f -" in code, backup
    assert "${REPO_ROOT}" not in code, "nothing of the upstream guide is re-applied over what the user ran"
