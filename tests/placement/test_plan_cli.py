"""``llmd-timeslice plan`` as a user runs it: the files it writes, --apply, and bad input in one line each."""

from __future__ import annotations

import json

import pytest
import yaml

from llmd_timeslice.local.stack_file import load_stack_file
from llmd_timeslice.placement.apply import LABEL_GROUP, LABEL_JOB_ID, LABEL_ROLE, ApplyRefused, apply_to_stack, moved_holders
from llmd_timeslice.placement.plan_file import load_plan
from tests.support.cli import run_cli as run

JOBS = """profiles:
  - {job_id: env-a, rollout_s: [9, 10, 11], train_s: 8, cpu_gap_s: 30, weight_sync_s: 1, accelerators: 4, state_bytes: 8GiB}
  - {job_id: env-b, rollout_s: 10, train_s: [7, 8], cpu_gap_s: 32, weight_sync_s: 1, accelerators: 4, state_bytes: 8GiB}
  - {job_id: busy, rollout_s: 30, train_s: 30, cpu_gap_s: 1, weight_sync_s: 1, accelerators: 4, state_bytes: 8GiB}
"""
COSTS = "grant_s: 0.07\nrollout_switch_s: 1.0\ntrain_switch_s: 1.0\n"
STACK = """stack: {name: planned}
groups:
  - {group_id: rollout-group, sleep_level: 2, drain_timeout_s: 30}
engines:
  - {name: env-a-sampler, group: rollout-group, sidecar_port: 9101, url: "http://127.0.0.1:8001"}
  - {name: env-b-sampler, group: rollout-group, sidecar_port: 9102, url: "http://127.0.0.1:8002"}
  - {name: busy, group: rollout-group, sidecar_port: 9103, url: "http://127.0.0.1:8003"}
"""


@pytest.fixture
def inputs(tmp_path):
    (tmp_path / "jobs.yaml").write_text(JOBS)
    (tmp_path / "costs.yaml").write_text(COSTS)
    (tmp_path / "stack.yaml").write_text(STACK)
    return tmp_path


def test_plan_writes_the_plan_its_summary_and_picture_and_applies_to_a_stack_file(inputs):
    out = inputs / "out"
    r = run(
        "plan", "-p", str(inputs / "jobs.yaml"), "--offer", "2x8:64GiB", "--switch-costs", str(inputs / "costs.yaml"),
        "--out", str(out), "--apply", "--stack", str(inputs / "stack.yaml"),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr + r.stdout
    plan = load_plan(out / "plan.json")
    assert plan.budgets_met and plan.search.method == "exact" and plan.search.jobs == 3
    shared = [g for g in plan.groups if len(g.jobs) > 1]
    assert shared and set(shared[0].jobs) == {"env-a", "env-b"}, plan.groups
    assert all(j.slowdown <= j.slowdown_budget for j in plan.jobs)
    assert {a.name for a in plan.alternatives} == {"plan", "dedicated", "colocated_alone", "naive"}
    assert "predicted duty cycle" in r.stdout and (out / "plan.txt").read_text().splitlines()[0] in r.stdout
    assert (out / "plan.png").stat().st_size > 10_000
    stack = load_stack_file(out / "stack.yaml")  # what `up` reads
    engines = {e.name: e.group for e in stack.engines}
    assert engines["env-a-sampler"] == engines["env-b-sampler"] == plan.group_of("env-a", "rollout")
    assert engines["busy"] == plan.group_of("busy", "rollout") != engines["env-a-sampler"]
    assert all(g.sleep_level == 2 and g.drain_timeout_s == 30 for g in stack.groups)  # the old group's settings kept
    assert {g.group_id: str(g.policy) for g in stack.groups} == {g.group_id: g.policy for g in plan.groups}
    script = (out / "k8s-patch.sh").read_text()
    assert f"-l {LABEL_JOB_ID}=env-a,{LABEL_ROLE}=sampler {LABEL_GROUP}={plan.group_of('env-a', 'rollout')}" in script
    assert json.loads((out / "job-groups.json").read_text())["busy"]["TIMESLICE_TRAINER_GROUP"] == plan.group_of("busy", "train")


def test_apply_never_moves_a_job_that_holds_accelerators_silently(inputs):
    out = inputs / "out"
    costs = str(inputs / "costs.yaml")
    assert (
        run("plan", "-p", str(inputs / "jobs.yaml"), "--offer", "2x8", "--switch-costs", costs, "--out", str(out)).returncode == 0
    )
    plan = load_plan(out / "plan.json")
    holders = {"rollout-group": "env-a"}
    assert moved_holders(plan, holders) == [
        f"job env-a holds group rollout-group now; the plan moves it to {plan.group_of('env-a', 'rollout')} "
        "(apply once it yielded, or pass --move-holders)"
    ]
    data = yaml.safe_load(STACK)
    with pytest.raises(ApplyRefused, match="job env-a holds group rollout-group now"):
        apply_to_stack(data, plan, holders)
    apply_to_stack(data, plan, holders, move_holders=True)


def test_the_labels_the_patch_sets_are_the_ones_discovery_reads():
    from llmd_timeslice.discovery import pods

    assert (LABEL_GROUP, LABEL_ROLE, LABEL_JOB_ID) == (pods.LABEL_GROUP, pods.LABEL_ROLE, pods.LABEL_JOB_ID)


@pytest.mark.parametrize(
    ("name", "profiles", "offer", "code", "line"),
    [
        (
            "profile with no complete period",
            '{"profiles": [{"job_id": "half", "source": "measured", "phases": {"train": {"count": 3, "samples_s": [3, 3, 3]}}}]}',
            "1x8",
            2,
            "llmd-timeslice plan: job half: no complete period (saw train x3; a period needs a rollout and a train phase)",
        ),
        (
            "job that fits nowhere",
            "- {job_id: big-70b, rollout_s: 10, train_s: 10, accelerators: 16}\n",
            "1x8",
            2,
            "llmd-timeslice plan: job big-70b fits nowhere: needs 16 accelerators, pool pool0 has 8 (1 x 8)",
        ),
        (
            "budgets no plan meets",
            "".join(f"- {{job_id: busy-{i}, rollout_s: 10, train_s: 10, cpu_gap_s: 1, accelerators: 4}}\n" for i in range(3)),
            "1x4",
            3,
            "llmd-timeslice plan: no plan meets every slowdown budget on this offer; best found: duty cycle",
        ),
        (
            "host memory too small for a job's states",
            "- {job_id: a, rollout_s: 30, train_s: 10, accelerators: 8, state_bytes: 100GiB}\n",
            "1x8:10GiB",
            2,
            "llmd-timeslice plan: the offer (1 node x 8 accelerators, 10.0GiB host memory each) is too small for these "
            "jobs even with every one in one group; job a, colocated (all): its states need 100.0GiB of host memory "
            "per node, pool pool0's nodes have 10.0GiB",
        ),
        (
            "host memory too small for two jobs' states",
            "".join(f"- {{job_id: {j}, rollout_s: 30, train_s: 10, accelerators: 8, state_bytes: 5GiB}}\n" for j in "ab"),
            "1x8:6GiB",
            2,
            "is too small for these jobs even with every one in one group; jobs a, b, colocated (all): its states "
            "need 10.0GiB of host memory per node, pool pool0's nodes have 6.0GiB",
        ),
        ("unreadable profiles", "profiles: [\n", "1x8", 2, "llmd-timeslice plan: "),
        ("bad offer", "- {job_id: a, rollout_s: 1, train_s: 1}\n", "eight", 2, "expected COUNTxACCELERATORS"),
    ],
)
def test_bad_input_is_one_line(tmp_path, name, profiles, offer, code, line):
    f = tmp_path / "p.yaml"
    f.write_text(profiles)
    r = run("plan", "-p", str(f), "--offer", offer, "--out", str(tmp_path / "out"), "--no-picture")
    assert r.returncode == code, (name, r.stdout, r.stderr)
    errors = r.stderr.strip().splitlines()
    assert len(errors) == 1 and line in errors[0] and "Traceback" not in r.stderr, (name, r.stderr)


def test_help_names_every_option():
    r = run("plan", "--help")
    assert r.returncode == 0
    for opt in ("--profiles", "--orchestrator", "--file", "--offer", "--offer-file", "--switch-costs", "--budget",
                "--max-group-jobs", "--exact-max-jobs", "--tries-per-job", "--seed", "--out", "--apply", "--stack",
                "--engine", "--namespace", "--move-holders", "Exit codes"):  # fmt: skip
        assert opt in r.stdout, opt


def test_one_job_summary_is_singular_and_the_picture_has_a_legend(tmp_path, monkeypatch):
    """The fresh-clone trial: `1 jobs in 1 co-execution groups`, and a plan.png whose colours and hatching were
    explained nowhere in it. The summary counts in the singular; each panel has a legend naming its marks."""
    import matplotlib.figure

    saved: list = []
    save = matplotlib.figure.Figure.savefig
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda fig, *a, **k: (saved.append(fig), save(fig, *a, **k))[1])
    f = tmp_path / "p.yaml"
    f.write_text("- {job_id: solo, rollout_s: 30, train_s: 10, cpu_gap_s: 1, accelerators: 8, state_bytes: 1GiB}\n")
    r = run("plan", "-p", str(f), "--offer", "1x8:1TiB", "--out", str(tmp_path / "out"))
    assert r.returncode in (0, 3), r.stderr
    first = r.stdout.splitlines()[0]
    assert first.startswith("plan: 1 job in 1 co-execution group (1 lease group) on 8 of 8 accelerators;"), first
    assert "1 jobs" not in r.stdout and "1 accelerators" not in r.stdout and " 1 candidate groups" not in r.stdout
    (fig,) = saved
    timeline, bars = fig.axes
    assert [t.get_text() for t in timeline.get_legend().get_texts()] == [
        "job solo", "rollout (plain)", "train (hatched)", "handover (switch)",
    ]  # fmt: skip
    assert [t.get_text() for t in bars.get_legend().get_texts()] == ["this plan", "an alternative"]


def _doc_plan_commands() -> list[list[str]]:
    """The `llmd-timeslice plan` commands of docs/placement.md's first code block, continuation lines joined."""
    import re
    import shlex
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "placement.md").read_text()
    block = re.search(r"```bash\n(.*?)```", text, re.S)
    assert block, "docs/placement.md opens with a bash block of the commands"
    lines = block.group(1).replace("\\\n", " ").splitlines()
    return [shlex.split(ln.split("#")[0])[1:] for ln in lines if ln.startswith("llmd-timeslice plan ")]


def test_the_docs_plan_commands_work_from_a_fresh_clone(tmp_path, monkeypatch):
    """The fresh-clone trial: docs/placement.md's `plan -p jobs.yaml` named a file the repo does not ship, and its
    `plan -f examples/cpu-stack.yaml --apply` wrote no stack.yaml (the example's engines `sampler-N` are no job's
    name). The commands from profiles run as written, from the repository root (only --out moved to a temporary
    folder), and write the stack file `up` reads; the live one maps every engine of the example stack with --engine."""
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    commands = _doc_plan_commands()
    from_profiles = [c for c in commands if "-p" in c]
    live = [c for c in commands if "-f" in c]
    assert from_profiles and live, commands
    monkeypatch.chdir(repo)
    for i, args in enumerate(from_profiles):
        out = tmp_path / f"out-{i}"
        r = run(*args, "--out", str(out))
        assert r.returncode == 0, (args, r.stdout, r.stderr)
        assert (out / "plan.json").exists() and (out / "plan.png").exists()
        if "--apply" in args:
            stack = load_stack_file(out / "stack.yaml")  # what `up -f plan-out/stack.yaml` reads
            assert {e.group for e in stack.engines} <= {g.group_id for g in stack.groups}
    engines = {e.name for e in load_stack_file(repo / "examples" / "cpu-stack.yaml").engines}
    for args in live:
        mapped = {args[i + 1].split("=")[0] for i, a in enumerate(args) if a == "--engine"}
        assert "--apply" not in args or mapped == engines, (args, engines)
