"""Our fixtures and configs agree with the recorded upstream facts (issue 37 §7; tools/upstream_facts.py).

Reads tests/fixtures/upstream-facts.json and our repository only: no network, no snapshots. Refresh the record with
``.venv/bin/python tools/upstream_facts.py record --mirror-root /work/.mirror`` (docs/upstream.md).
"""

from __future__ import annotations

import copy
import re

import pytest
from typer.testing import CliRunner

from tools.upstream_facts import FACTS, app, difference, load_record, proto_signature

RECORD = load_record()

#: Differences known and tracked elsewhere: fact id -> why. Each must still differ (else remove it here), so the list
#: never hides a fact that has come back into line, nor a new difference.
KNOWN_DRIFT: dict[str, str] = {}


@pytest.mark.parametrize("entry", RECORD, ids=[e["id"] for e in RECORD])
def test_our_repository_agrees_with_the_recorded_upstream_fact(entry):
    line = difference(entry)
    if entry["id"] in KNOWN_DRIFT:
        assert line is not None, f"{entry['id']} agrees now: remove it from KNOWN_DRIFT ({KNOWN_DRIFT[entry['id']]})"
    else:
        assert line is None, line


def test_the_record_holds_every_fact_of_the_table_with_its_source():
    assert [e["id"] for e in RECORD] == [f.id for f in FACTS], "refresh: tools/upstream_facts.py record"
    for entry, fact in zip(RECORD, FACTS, strict=True):
        assert entry["ours"] == [fact.ours[0], fact.ours[1]] and entry["compare"] == fact.compare, entry["id"]
        assert entry["repo"] == fact.repo and entry["paths"] == list(fact.paths), entry["id"]
        assert re.fullmatch(r"[0-9a-f]{40}", entry["commit"]), entry["id"]
        assert entry["value"], f"{entry['id']}: empty upstream value"
    assert set(KNOWN_DRIFT) <= {f.id for f in FACTS}


def test_a_difference_is_one_line_naming_the_fact_and_both_values():
    (legacy,) = [e for e in RECORD if e["id"] == "inferenceobjective.legacy.group-version"]
    moved = dict(legacy, value="inference.networking.x-k8s.io/v1beta1")
    line = difference(moved)
    assert "\n" not in line and line.startswith("inferenceobjective.legacy.group-version: upstream ")
    assert '"inference.networking.x-k8s.io/v1beta1"' in line and '"inference.networking.x-k8s.io/v1alpha2"' in line
    assert "llmd_timeslice/domain/objectives.py" in line
    (types,) = [e for e in RECORD if e["id"] == "epp.plugin-types"]
    gone = dict(types, value=[t for t in types["value"] if t != "queue-scorer"])
    assert difference(gone).endswith('lacks ["queue-scorer"], which ours (manifests/families/flow_control.py) uses')


def test_a_proto_whose_upstream_moved_a_field_differs_on_that_field():
    (snap,) = [e for e in RECORD if e["id"] == "proto.snapshot-agent"]
    moved = copy.deepcopy(snap)
    line = next(x for x in moved["value"] if x.startswith("message SnapshotRequest: 1 "))
    moved["value"][moved["value"].index(line)] = line.replace(": 1 ", ": 9 ")
    got = difference(moved)
    assert got is not None and "message SnapshotRequest: 9 " in got and "\n" not in got
    text = (
        "syntax = 'proto3';\npackage p;\nmessage M { int64 a = 1; repeated string b = 2; }\n"
        "service S { rpc R(M) returns (stream M); }"
    )
    assert proto_signature(text) == [
        "message M: 1 a int64",
        "message M: 2 b repeated string",
        "package p",
        "rpc S.R(M) returns (stream M)",
    ]


@pytest.mark.parametrize("args", [["--help"], ["record", "--help"], ["check", "--help"], ["list", "--help"]])
def test_the_tools_help_is_complete(args):
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    if args == ["--help"]:
        assert all(c in result.output for c in ("record", "check", "list"))
    if args[0] == "record":
        assert "--mirror-root" in result.output and "--snapshot" in result.output


def test_check_prints_the_known_drift_and_exits_1_while_there_is_one():
    result = CliRunner().invoke(app, ["check"])
    lines = result.output.strip().splitlines()
    assert result.exit_code == (1 if KNOWN_DRIFT else 0)
    assert sorted(x.split(":")[0] for x in lines if ": upstream " in x) == sorted(KNOWN_DRIFT)
    if not KNOWN_DRIFT:
        assert lines == ["our repository agrees with every recorded upstream fact"], lines
