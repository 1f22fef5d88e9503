"""The waiter policies moved to :mod:`llmd_timeslice.domain.waiter_policy` (the placement planner's simulation picks
waiters with the same code as the orchestrator, and must not import the orchestrator); every name is re-exported."""

from llmd_timeslice.domain.waiter_policy import WAITER_POLICIES, Fifo, Priority, RoundRobin, WaiterPolicy, Waiting, waiter_policy

__all__ = ["WAITER_POLICIES", "Fifo", "Priority", "RoundRobin", "WaiterPolicy", "Waiting", "waiter_policy"]
