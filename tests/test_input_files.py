"""What a new user feeds the CLI (issue 27): the files the project writes check OK, every file the project reads
refuses a key given twice in one line, one ``host:port`` parser answers for every flag and setting, a missing token
file names its setting, the examples find the stack one way. All in this process (tests/support/cli.py)."""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
from pathlib import Path

import pytest
import yaml

from llmd_timeslice import yaml_files
from llmd_timeslice.addresses import HostPort, parse_host_port
from tests.support.cli import run_cli

REPO = Path(__file__).resolve().parents[1]
DUP = "max_hold_s: 5\nmax_held: 3\nmax_hold_s: 120\n"


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for k in list(os.environ):
        if k.startswith("LLMD_TIMESLICE_") or k == "TIMESLICE_ORCH_ADDR":
            monkeypatch.delenv(k)


def _one_line(r, code: int = 2) -> str:
    lines = r.stderr.strip().splitlines()
    assert r.returncode == code and len(lines) == 1 and "Traceback" not in r.stderr, (r.returncode, r.stderr)
    return lines[0]


# ---------------------------------------------------------------- 1. config check accepts what the project writes
# The inventory the demo writes: tests/local/test_stack_commands.py (the demo's stack is started by `up`'s launcher).


def test_config_check_accepts_the_inventory_up_writes(tmp_path):
    from llmd_timeslice.local.stack_file import load_stack_file

    sf = load_stack_file(REPO / "examples" / "cpu-stack.yaml")
    inv = tmp_path / "inventory.yaml"
    inv.write_text(yaml.safe_dump(sf.inventory().model_dump(mode="json"), sort_keys=False))  # as Stack.prepare
    r = run_cli("config", "check", str(inv))
    assert r.returncode == 0 and r.stdout.startswith(f"OK {inv}: inventory"), r.stdout + r.stderr


def test_orchestrator_inventory_with_a_typo_is_one_line_with_did_you_mean(tmp_path):
    inv = tmp_path / "inv.yaml"
    inv.write_text("groups:\n  - group_id: g\n    drain_timout_s: 5\n")
    line = _one_line(run_cli("orchestrator", "--inventory", str(inv), "--port", "0"))
    assert line.endswith("groups[0].drain_timout_s: unknown key (did you mean groups[0].drain_timeout_s?)"), line
    assert "pydantic" not in line and "http" not in line
    assert _one_line(run_cli("config", "check", str(inv))).endswith("(did you mean groups[0].drain_timeout_s?)")


@pytest.mark.parametrize("text", ["", "# nothing yet\n", "{}\n"])
def test_an_empty_file_is_refused_alike_by_config_check_and_up(tmp_path, text):
    f = tmp_path / "empty.yaml"
    f.write_text(text)
    check, up = _one_line(run_cli("config", "check", str(f))), _one_line(run_cli("up", "-f", str(f)))
    assert check == up == f"{f}: the file is empty: nothing to check or start (see examples/cpu-stack.yaml)"


def test_a_binary_file_is_one_line_naming_it_and_its_first_bad_byte(tmp_path):
    f = tmp_path / "model.safetensors"  # a file given by mistake
    f.write_bytes(b"\x89PNG\r\n\x1a\n\xff\x00")
    want = f"{f}: not a text file (UTF-8): byte 0x89 at offset 0"
    for args in (["config", "check", str(f)], ["up", "-f", str(f)], ["status", "-f", str(f)], ["down", "-f", str(f)]):
        assert _one_line(run_cli(*args)) == want, args


@pytest.mark.parametrize(
    ("text", "first"),
    [
        ("foo: 1\n", "foo: unknown key"),
        ("- stack\n- engines\n", "expected a mapping of sections (gate, picker, orchestrator, sidecar), got list"),
    ],
)
def test_a_file_of_no_known_kind_is_told_which_kinds_config_check_reads(tmp_path, text, first):
    """A new user's finding: ``foo: 1`` answered only ``foo: unknown key``, and a list only named a component
    configuration's sections, whatever the user meant the file to be."""
    f = tmp_path / "what.yaml"
    f.write_text(text)
    r = run_cli("config", "check", str(f))
    assert r.returncode == 2 and r.stderr.splitlines() == [
        f"{f}: {first}",
        f"{f}: config check reads a component configuration (top-level gate, picker, orchestrator, sidecar), a stack "
        "file of `up` (stack, pools, groups, engines, ...) or a static inventory (groups)",
    ], r.stderr


def test_a_misspelled_section_gets_its_did_you_mean_and_no_list_of_kinds(tmp_path):
    f = tmp_path / "gate.yaml"
    f.write_text("gatee: {}\n")
    assert _one_line(run_cli("config", "check", str(f))) == f"{f}: gatee: unknown key (did you mean gate?)"


@pytest.mark.parametrize(
    ("old", "new", "line"),
    [
        ("engines:", "enignes:", "enignes: unknown key (did you mean engines?)"),
        ("  - name: sampler-0", "  - nmae: sampler-0", "engines[0].nmae: unknown key (did you mean engines[0].name?)"),
    ],
)
def test_a_misspelled_required_key_is_one_did_you_mean_line_not_also_required(tmp_path, old, new, line):
    """A new user's finding: ``enignes:`` answered ``engines: required`` first, then the ``did you mean``."""
    text = (REPO / "examples" / "cpu-stack.yaml").read_text()
    assert old in text
    f = tmp_path / "stack.yaml"
    f.write_text(text.replace(old, new, 1))
    assert _one_line(run_cli("config", "check", str(f))) == f"{f}: {line}"


# ---------------------------------------------------------------- 2. one loader, duplicate keys refused
def test_loader_refuses_a_duplicate_key_naming_it_and_both_lines():
    with pytest.raises(yaml_files.DuplicateKeyError) as err:
        yaml_files.load("gate:\n  " + DUP.replace("\n", "\n  "))
    assert str(err.value) == "duplicate key 'max_hold_s' (line 2 and line 4); keep one"
    with pytest.raises(yaml_files.DuplicateKeyError, match="line 1 and line 1"):
        yaml_files.load('{"a": 1, "a": 2}')  # JSON too
    # Not duplicates: a merge key's keys overridden next to it, equal values under different keys, 1 vs "1".
    assert yaml_files.load("b: &b {a: 1}\nc:\n  <<: *b\n  a: 2\n") == {"b": {"a": 1}, "c": {"a": 2}}
    assert yaml_files.load('1: x\n"1": y\n') == {1: "x", "1": "y"}


@pytest.mark.parametrize(
    "args,text,line",
    [
        (("config", "check"), "gate:\n  " + DUP.replace("\n", "\n  "), "line 2 and line 4"),
        (("gate", "--config"), "gate:\n  " + DUP.replace("\n", "\n  "), "line 2 and line 4"),
        (("orchestrator", "--inventory"), "groups:\n  - group_id: g\n    group_id: h\n", "line 2 and line 3"),
        (("up", "-f"), "stack: {}\nengines: []\nstack: {}\n", "line 1 and line 3"),
        (("k8s", "modelserver"), "kind: Deployment\nkind: Deployment\n", "line 1 and line 2"),
    ],
)
def test_every_file_the_cli_reads_refuses_a_duplicate_key_in_one_line(tmp_path, args, text, line):
    f = tmp_path / "f.yaml"
    f.write_text(text)
    got = _one_line(run_cli(*args, str(f)))
    assert "duplicate key" in got and line in got and str(f) in got, got


def test_job_tokens_and_guide_settings_refuse_a_duplicate_key(tmp_path):
    from llmd_timeslice.auth import load_job_tokens
    from manifests.generate import load_settings

    f = tmp_path / "tokens.yaml"
    f.write_text("trainer-0: aaa\nsampler-0: bbb\ntrainer-0: ccc\n")
    with pytest.raises(ValueError, match=r"duplicate key 'trainer-0' \(line 1 and line 3\)"):
        load_job_tokens(f)
    f.write_text("namespace: a\nnamespace: b\n")
    with pytest.raises(ValueError, match=r"duplicate key 'namespace' \(line 1 and line 2\)"):
        load_settings(f)


def test_no_reader_bypasses_the_one_loader():
    """Every YAML read of the package, the router side and the manifests generator goes through yaml_files."""
    offenders = []
    for root in ("llmd_timeslice", "epp_plugin", "manifests"):
        for p in (REPO / root).rglob("*.py"):
            if p.name == "yaml_files.py":
                continue
            text = p.read_text()
            for call in ("yaml.safe_load(", "yaml.safe_load_all(", "yaml.load(", "yaml.load_all(", "yaml.full_load("):
                if call in text:
                    offenders.append(f"{p.relative_to(REPO)}: {call}")
    # The CRD schema extractor (a maintainer's tool) reads upstream's CRDs, not a user's file.
    assert set(offenders) <= {"manifests/crd-schemas/extract.py: yaml.safe_load_all("}, offenders


# ---------------------------------------------------------------- 3. one host:port parser
@pytest.mark.parametrize(
    "value,problem",
    [
        ("127.0.0.1:99999", "port 99999 is out of 1..65535"),
        ("127.0.0.1:0", "port 0 is out of 1..65535"),
        ("127.0.0.1", "no port"),
        ("127.0.0.1:", "no port"),
        (":50051", "no host"),
        ("host:http", "port 'http' is not a number"),
        ("::1:50051", "an IPv6 address goes in brackets, e.g. [::1]:50051"),
        ("[::1", "an IPv6 address in [ ] is not closed"),
        ("[nope]:1", "'nope' in [ ] is not an IPv6 address"),
        ("http://127.0.0.1:50051/", "a URL, not an address: give host:port without the scheme, e.g. '127.0.0.1:50051'"),
    ],
)
def test_status_and_gate_refuse_the_same_bad_address_in_one_line(value, problem):
    expected = f"expected host:port, got {value!r}: {problem}"
    with pytest.raises(ValueError) as err:
        parse_host_port(value)
    assert str(err.value) == expected
    for args in (("status", "--orchestrator", value), ("status", "--gate", value), ("gate", "--orchestrator", value)):
        r = run_cli(*args)
        errors = [ln for ln in r.stderr.splitlines() if ln.startswith("Error:")]
        assert r.returncode == 2 and errors == [f"Error: Invalid value for '{args[1]}': {expected}"], (args, r.stderr)


def test_addresses_accepted_including_ipv6_in_brackets():
    assert parse_host_port("[::1]:50051") == HostPort("::1", 50051) and str(HostPort("::1", 50051)) == "[::1]:50051"
    assert parse_host_port("orchestrator.ns.svc:50051") == HostPort("orchestrator.ns.svc", 50051)
    from llmd_timeslice.config import GateSettings

    assert GateSettings(orchestrator="[::1]:50051").orchestrator == "[::1]:50051"
    from epp_plugin.gate.endpoint_discovery import _split

    assert _split("[fd00::1]:8000") == ("fd00::1", 8000) and _split("10.0.0.1:99999") is None


# ---------------------------------------------------------------- 5. token files name their setting
@pytest.mark.parametrize(
    "args,env,setting",
    [
        (("status", "--token-file", "{missing}"), {}, "--token-file"),
        (("status",), {"LLMD_TIMESLICE_TOKEN_FILE": "{missing}"}, "$LLMD_TIMESLICE_TOKEN_FILE"),
        (("gate", "--token-file", "{missing}"), {}, "--token-file"),
        (("gate",), {"LLMD_TIMESLICE_GATE__TOKEN_FILE": "{missing}"}, "$LLMD_TIMESLICE_GATE__TOKEN_FILE"),
        (("gate", "--config", "{config}"), {}, "{config}: token_file"),
        (("orchestrator", "--inventory", "{inv}"), {"LLMD_TIMESLICE_TOKEN_FILE": "{missing}"}, "$LLMD_TIMESLICE_TOKEN_FILE"),
    ],
)
def test_missing_token_file_names_its_setting_and_path(tmp_path, args, env, setting):
    names = {"missing": str(tmp_path / "no-such-token"), "config": str(tmp_path / "c.yaml"), "inv": str(tmp_path / "i.yaml")}
    Path(names["config"]).write_text(f"token_file: {names['missing']}\n")
    Path(names["inv"]).write_text("groups:\n  - group_id: g\n")
    r = run_cli(*(a.format(**names) for a in args), env={k: v.format(**names) for k, v in env.items()})
    line = _one_line(r)
    assert f"{setting.format(**names)} {names['missing']}: cannot read the control-plane token file: No such file" in line
    assert "Errno" not in line


# ---------------------------------------------------------------- 4. the examples find the stack one way
def _example(name: str):
    spec = importlib.util.spec_from_file_location(f"examples_{name}", REPO / "examples" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


EXPORT = {
    "LLMD_TIMESLICE_ROUTER_URL": "http://127.0.0.1:41234",
    "TIMESLICE_ORCH_ADDR": "127.0.0.1:41235",
    "LLMD_TIMESLICE_TOKEN_FILE": "/tmp/stack-token",
}


@pytest.mark.parametrize("name,extra", [("verifiers_grpo", ["--model-dir", "m"]), ("trl_grpo_remote", ["--model-dir", "m"])])
def test_examples_take_the_router_from_the_export_line_up_prints(monkeypatch, tmp_path, name, extra):
    mod = _example(name)
    seen: dict = {}

    def fake_run(router, *a, **k):
        seen.update(router=router, orch=os.environ.get("TIMESLICE_ORCH_ADDR"), tok=os.environ.get("LLMD_TIMESLICE_TOKEN_FILE"))
        if name == "verifiers_grpo":

            async def done():
                return {"ok": True, "failed_requests": 0, "below_requested": 0}

            return done()
        return {"steps": 2, "failed": 0, "below_requested": 0}

    monkeypatch.setattr(mod, "run", fake_run)
    for k, v in EXPORT.items():
        monkeypatch.setenv(k, v)
    with contextlib.redirect_stdout(open(os.devnull, "w")):
        assert mod.main(["--stack", str(tmp_path / "none.yaml"), *extra]) == 0
    assert seen == {
        "router": EXPORT["LLMD_TIMESLICE_ROUTER_URL"],
        "orch": EXPORT["TIMESLICE_ORCH_ADDR"],
        "tok": "/tmp/stack-token",
    }


@pytest.mark.parametrize(
    "serving,pending,rejected,on_disk,expected",
    [
        (0, 0, 0, [], (0, 1)),  # a new group, an empty weights folder
        (2, 0, 0, ["v1", "v2"], (2, 3)),  # the same command run again after publishing 1 and 2
        (0, 0, 0, ["v1", "v2", "notes", "vx"], (0, 3)),  # the group forgot (a new stack), the folder did not
        (2, 4, 3, ["v1", "v2"], (2, 5)),  # a pending and a rejected version are newer than the folder's
    ],
)
def test_rl_loop_publishes_above_every_version_the_group_or_its_weights_folder_knows(
    tmp_path, serving, pending, rejected, on_disk, expected
):
    """Why rl_loop.py can run again with the same weights folder (published versions are immutable, and the
    orchestrator refuses a version that is not newer than its latest); its first run is end to end in the `up` test."""
    from llmd_timeslice.api.llmd_timeslice.v1alpha1 import weights_pb2

    mod = _example("rl_loop")
    for name in on_disk:
        (tmp_path / name).mkdir()
    status = weights_pb2.WeightVersionStatus(
        group_id="g",
        serving_version=serving,
        pending=weights_pb2.WeightUpdate(version=pending),
        rejected=weights_pb2.RejectedWeightVersion(version=rejected),
    )

    class Client:  # the one call _versions makes, as TimeSliceOrchestratorClient answers it
        def weight_status(self, group_id):
            assert group_id == "g"
            return status

    assert mod._versions(Client(), "g", tmp_path) == expected


@pytest.mark.parametrize("name", ["rl_loop", "verifiers_grpo", "trl_grpo_remote"])
def test_examples_stop_rather_than_guess_a_port(tmp_path, capsys, name):
    mod = _example(name)
    extra = [] if name == "rl_loop" else ["--model-dir", "m"]
    assert mod.main(["--stack", str(tmp_path / "none.yaml"), *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"{name}: no --router, --orchestrator, --token-file: no stack runs from"), err
    assert "LLMD_TIMESLICE_ROUTER_URL" in err and "127.0.0.1:8080" not in err


def test_find_stack_flag_over_variable_over_running_stack(monkeypatch, tmp_path):
    from llmd_timeslice.local import find_stack

    monkeypatch.setattr(
        find_stack,
        "running_stack_endpoints",
        lambda stack: {"router": "http://r", "orchestrator": "o:1", "token_file": "/t"},
    )
    monkeypatch.setenv("TIMESLICE_ORCH_ADDR", "env:2")
    ap = argparse.ArgumentParser()
    find_stack.add_arguments(ap, tmp_path / "s.yaml")
    eps = find_stack.from_args(ap.parse_args(["--token-file", "/flag"]))
    assert (eps.router, eps.orchestrator, eps.token_file) == ("http://r", "env:2", "/flag")
    with pytest.raises(ValueError, match=r"expected the orchestrator as host:port, got 'h:99999': port 99999 is out of 1..65535"):
        find_stack.from_args(ap.parse_args(["--orchestrator", "h:99999"]))


# ---------------------------------------------------------------- 5. the docs name the metrics' real labels
_METRIC_MODULES = (
    "epp_plugin.gate.metrics",
    "epp_plugin.gate.subscription",
    "epp_plugin.picker.server",
    "llmd_timeslice.auth",
    "llmd_timeslice.discovery.kubernetes",
    "llmd_timeslice.discovery.reconcile",
    "llmd_timeslice.orchestrator.gate_hub",
    "llmd_timeslice.orchestrator.service",
    "llmd_timeslice.snapshot.server",
)
DOCS = [*sorted((REPO / "docs").rglob("*.md")), REPO / "README.md", *sorted((REPO / "manifests").rglob("README.md"))]


def _metric_labels() -> dict[str, set[str]]:
    """Every metric the components export -> its label names: the registered ones, and the gate's scrape-time
    families (epp_plugin/gate/metrics.py PoolCollector) read from a pool with one endpoint."""
    import importlib

    from prometheus_client import REGISTRY

    from epp_plugin.gate.metrics import PoolCollector
    from epp_plugin.gate.pool_state import EndpointState, PoolState

    for m in _METRIC_MODULES:
        importlib.import_module(m)
    out: dict[str, set[str]] = {}
    for name, collector in REGISTRY._names_to_collectors.items():
        out[name] = set(getattr(collector, "_labelnames", ()))
    pool = PoolState("p")
    pool.set_states([("10.0.0.1:8000", EndpointState.SERVING, None)])
    pool.set_states([("10.0.0.2:8000", EndpointState.ASLEEP, None)])
    pool.set_states([("10.0.0.2:8000", EndpointState.SERVING, None)])  # off the table: its counter has a series
    collector = PoolCollector()
    collector.pool_maps.append({"p": pool})
    placement = _placement_collector()
    for family in [*collector.collect(), *placement.collect()]:
        for sample in family.samples:
            out.setdefault(sample.name, set()).update(sample.labels)
            out.setdefault(family.name, set()).update(sample.labels)
    return out


def _placement_collector():
    """The orchestrator's placement families (orchestrator/placement_watch.py, scrape-time) over one watch that saw a
    job's whole iteration and made one check."""
    from llmd_timeslice.orchestrator.placement_watch import PlacementWatch, _Metrics
    from llmd_timeslice.placement.profile import PhaseKind
    from llmd_timeslice.placement.recorder import Hints
    from llmd_timeslice.placement.replan import Check

    watch = PlacementWatch()
    r = watch.recorder
    for t, kind in ((0.0, PhaseKind.ROLLOUT), (2.0, PhaseKind.TRAIN), (4.0, PhaseKind.ROLLOUT)):
        r.acquired("job", "g", Hints(kind), at=t)
        r.granted("job", "g", at=t)
        r.released("job", "g", waiters=False, at=t + 1)
    watch.last = Check("plan.json", 0.0, 0.5, 0.4, -0.2, 0.6, 0.2, True, measured_slowdowns={"job": 0.1})
    metrics = _Metrics()
    metrics.watches.append(watch)
    return metrics


def test_every_metric_the_docs_name_exists_with_the_labels_they_name():
    import re

    labels = _metric_labels()
    wrong = []
    for doc in DOCS:
        for m in re.finditer(r"(llmd_timeslice_[a-z_]+)\{([a-z_,]+)\}", doc.read_text()):
            name, named = m.group(1), set(m.group(2).split(","))
            have = labels.get(name)
            if have is None:
                wrong.append(f"{doc.relative_to(REPO)}: {name} is not a metric")
            elif named != have:
                wrong.append(f"{doc.relative_to(REPO)}: {name}{{{m.group(2)}}}: its labels are {sorted(have)}")
    assert not wrong, wrong


def test_every_istio_parameters_apply_in_the_docs_names_the_namespace():
    """`generate.py --istio-parameters none` prints a ConfigMap without a namespace: applied without `-n` it lands in
    the context's namespace, not the Gateway's, and the Gateway never sees it."""
    import re

    found = []
    for doc in DOCS:
        text = doc.read_text().replace("\\\n", " ").replace("\n  | ", " | ").replace("\n  ", " ")
        for m in re.finditer(
            r"(generate\.py --istio-parameters [^|`]*\\?\| kubectl apply[^`\n]*|kubectl patch gateway[^`\n]*)", text
        ):
            found.append((doc.relative_to(REPO), m.group(1)))
    assert len(found) >= 4, found  # the guide's two applies and its patch, the operations runbook's apply
    missing = [f"{d}: {cmd}" for d, cmd in found if not re.search(r" -n \$\{NAMESPACE\}", cmd)]
    assert not missing, missing


def test_the_phase_callbacks_orchestrator_variable_goes_through_the_same_parser():
    from llmd_timeslice.client.integrations.phase_callback import TimeSliceConfigError, _Config

    with pytest.raises(TimeSliceConfigError, match=r"expected TIMESLICE_ORCH_ADDR as host:port, got '[^']+': port 99999 is out"):
        _Config("job-a", "127.0.0.1:99999", "g", "g")
    assert _Config("job-a", "[::1]:50051", "g", "g").orch_addr == "[::1]:50051"


def test_no_doc_tells_a_user_to_pip_install_the_project_by_name_from_an_index():
    """llmd-timeslice is not published: `pip install "llmd-timeslice[...]"` would fetch nothing, or someone else's
    package of that name. The docs install it from a checkout (a path) or a wheel built from one."""
    import re

    wrong = [
        f"{doc.relative_to(REPO)}: {m.group(0)}"
        for doc in DOCS
        for m in re.finditer(r"pip install [\"']?llmd[-_]timeslice\b[^\s\"'`]*", doc.read_text())
    ]
    assert not wrong, wrong
