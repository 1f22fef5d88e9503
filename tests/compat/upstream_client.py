"""An "existing llm-d client": uses only stubs generated from tests/compat/upstream_orchestrator.proto.

Runs in its own process (the project's own stubs define the same proto package, so both cannot share one
descriptor pool). Usage: python upstream_client.py STUBS_DIR TARGET SCENARIO; exits 0 when every check holds,
else prints what was seen and exits 1.
"""

import sys
import threading
import time

sys.path.insert(0, sys.argv[1])
import grpc
import upstream_orchestrator_pb2 as pb
import upstream_orchestrator_pb2_grpc as pb_grpc


def check(cond, what):
    if not cond:
        print(f"FAILED: {what}")
        sys.exit(1)


def basic(stub):
    check(list(stub.ListGroups(pb.ListGroupsRequest()).group_ids) == ["g0", "trainers"], "ListGroups")
    check(stub.Acquire(pb.AcquireRequest(job_id="trainer-0", group_id="g0"), timeout=10).success, "Acquire")
    s = stub.GetGroupStatus(pb.GetGroupStatusRequest(group_id="g0"))
    check(s.group.group_state == pb.GroupStatus.STATE_LOCKED and s.group.locking_job == "trainer-0", f"status {s}")
    check([a.job_id for a in s.agent_job_states] == ["sampler-0"], "agent_job_states")
    y = stub.Yield(pb.YieldRequest(job_id="trainer-0", group_id="g0"))
    check(y.success and y.pending_waiters == 0 and not y.snapshot_deferred, f"Yield {y}")
    stub.Acquire(pb.AcquireRequest(job_id="t", group_id="trainers"), timeout=10)
    check(stub.Yield(pb.YieldRequest(job_id="t", group_id="trainers")).snapshot_deferred, "deferred snapshot")
    s = stub.GetGroupStatus(pb.GetGroupStatusRequest(group_id="trainers"))
    check(s.group.group_state == pb.GroupStatus.STATE_IDLE_YIELDED and s.group.loaded_job == "t", f"status {s}")
    # The job whose snapshot was deferred takes the group back without a switch: nothing to restore (waited_ms is a
    # wall-clock figure, not a sign of a switch: on a loaded machine even this grant can take a millisecond).
    a = stub.Acquire(pb.AcquireRequest(job_id="t", group_id="trainers"), timeout=10)
    check(a.success and not a.context_restored, f"re-acquire {a}")
    s = stub.GetGroupStatus(pb.GetGroupStatusRequest(group_id="trainers"))
    check(s.group.group_state == pb.GroupStatus.STATE_LOCKED and s.group.locking_job == "t", f"re-acquire status {s}")
    try:
        stub.Acquire(pb.AcquireRequest(job_id="x", group_id="nope"), timeout=5)
        check(False, "unknown group accepted")
    except grpc.RpcError as err:
        check(err.code() == grpc.StatusCode.NOT_FOUND, f"unknown group -> {err.code()}")


def twenty(stub):
    order, lock = [], threading.Lock()
    stub.Acquire(pb.AcquireRequest(job_id="holder", group_id="g0"), timeout=10)

    def job(name):
        stub.Acquire(pb.AcquireRequest(job_id=name, group_id="g0"), timeout=60)
        with lock:
            order.append(name)
        time.sleep(0.01)
        stub.Yield(pb.YieldRequest(job_id=name, group_id="g0"))

    names = [f"job-{i:02d}" for i in range(20)]
    threads = []
    for i, name in enumerate(names):  # enqueue one by one so the FIFO order is known
        t = threading.Thread(target=job, args=(name,))
        t.start()
        threads.append(t)
        for _ in range(400):
            if stub.GetGroupStatus(pb.GetGroupStatusRequest(group_id="g0")).group.waiter_queue_depth == i + 1:
                break
            time.sleep(0.005)
    check(stub.GetGroupStatus(pb.GetGroupStatusRequest(group_id="g0")).group.waiter_queue_depth == 20, "20 waiting")
    stub.Yield(pb.YieldRequest(job_id="holder", group_id="g0"))
    for t in threads:
        t.join(30)
    check(order == names, f"grants were not FIFO: {order}")


def yield_requested(stub):
    """Acquire, then wait (a line on stdin) while the orchestrator asks this holder to yield; yield, acquire again.
    The Lease extension is not in this client's wire: nothing of the request may change what it sees."""
    a = stub.Acquire(pb.AcquireRequest(job_id="trainer-0", group_id="g0"), timeout=10)
    check(a.success, f"Acquire {a}")
    print("ACQUIRED", flush=True)
    check(sys.stdin.readline().strip() == "REQUESTED", "the test asked for a yield")
    s = stub.GetGroupStatus(pb.GetGroupStatusRequest(group_id="g0"))
    check(s.group.group_state == pb.GroupStatus.STATE_LOCKED and s.group.locking_job == "trainer-0", f"status {s}")
    y = stub.Yield(pb.YieldRequest(job_id="trainer-0", group_id="g0"))
    check(y.success and y.pending_waiters == 0, f"Yield {y}")
    a = stub.Acquire(pb.AcquireRequest(job_id="trainer-0", group_id="g0"), timeout=10)
    check(a.success, f"second Acquire {a}")
    check(stub.Yield(pb.YieldRequest(job_id="trainer-0", group_id="g0")).success, "second Yield")


def unauthenticated(stub):
    """The orchestrator's main port requires a bearer token, which this client never sends: every call is refused."""
    for name, call in (
        ("ListGroups", lambda: stub.ListGroups(pb.ListGroupsRequest(), timeout=10)),
        ("Acquire", lambda: stub.Acquire(pb.AcquireRequest(job_id="trainer-0", group_id="g0"), timeout=10)),
        ("Yield", lambda: stub.Yield(pb.YieldRequest(job_id="trainer-0", group_id="g0"), timeout=10)),
    ):
        try:
            call()
            check(False, f"{name} accepted without a token")
        except grpc.RpcError as err:
            check(err.code() == grpc.StatusCode.UNAUTHENTICATED, f"{name} -> {err.code()} {err.details()}")


# As upstream's client does (llm-d-rl-time-slicing 6cf8e9b07c60, pkg/client/python/timeslice/orchestrator/client.py):
# an insecure channel, no call credentials, no metadata.
with grpc.insecure_channel(sys.argv[2]) as channel:
    scenarios = {"basic": basic, "twenty": twenty, "yield_requested": yield_requested, "unauthenticated": unauthenticated}
    scenarios[sys.argv[3]](pb_grpc.TimeSliceOrchestratorServiceStub(channel))
print("OK")
