"""Upstream's own Python client, unmodified: package ``timeslice`` (llm-d-incubation/llm-d-rl-time-slicing,
``pkg/client/python``; 0.2.1 at 6cf8e9b07c60), imported from a checkout given on the command line.

Usage: python upstream_package_client.py CLIENT_DIR TARGET SCENARIO; exits 0 and prints OK when every check holds.
Scenarios: ``acquire_yield`` (list the groups, acquire g0, read its status, release), ``unauthenticated`` (every call
refused with UNAUTHENTICATED, which this client surfaces as an ``OrchestratorError`` naming the status).
"""

import sys

sys.path.insert(0, sys.argv[1])
from timeslice import TimeSliceOrchestratorClient
from timeslice.orchestrator.exceptions import OrchestratorError


def check(cond, what):
    if not cond:
        print(f"FAILED: {what}")
        sys.exit(1)


def acquire_yield(client):
    groups = client.list_groups(timeout_sec=10)
    check("g0" in groups, f"list_groups {groups}")
    a = client.acquire(timeout_sec=60)
    check(a.success, f"acquire {a}")
    s = client.get_status(timeout_sec=10)
    check(s.group.locking_job == "trainer-0", f"status {s}")
    y = client.release(timeout_sec=10)
    check(y.success, f"release {y}")


def unauthenticated(client):
    for name, call in (("list_groups", client.list_groups), ("acquire", client.acquire), ("release", client.release)):
        try:
            call(timeout_sec=10)
            check(False, f"{name} accepted without a token")
        except OrchestratorError as err:
            check("UNAUTHENTICATED" in str(err), f"{name} -> {err}")


with TimeSliceOrchestratorClient(sys.argv[2], job_id="trainer-0", group_id="g0") as c:
    {"acquire_yield": acquire_yield, "unauthenticated": unauthenticated}[sys.argv[3]](c)
print("OK")
