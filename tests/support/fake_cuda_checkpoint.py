#!/usr/bin/env python3
"""A stand-in for NVIDIA's ``cuda-checkpoint`` CLI, for tests (no GPU or driver here).

Mimics the CLI of github.com/NVIDIA/cuda-checkpoint as documented in its README:
``--get-state --pid PID`` prints the state (``running`` / ``locked`` / ``checkpointed``);
``--toggle --pid PID`` flips running <-> checkpointed (the original release); with
``FAKE_CUDA_CHECKPOINT_API=action`` it also lists and accepts ``--action lock|checkpoint|restore|unlock
--pid PID [--timeout MS]`` (newer releases), refusing steps out of order (checkpoint needs locked,
unlock needs a restored lock) like the real tool. A pid that does not exist is an error (exit 1).

Knobs (environment): ``FAKE_CUDA_CHECKPOINT_STATE_DIR`` (required: one file per pid holds its
state), ``FAKE_CUDA_CHECKPOINT_FAIL=driver`` (print the driver error and exit 1, like a node
without the NVIDIA driver), ``FAKE_CUDA_CHECKPOINT_HANG=SECONDS`` (sleep before acting),
``FAKE_CUDA_CHECKPOINT_LIE=1`` (exit 0 on toggle/checkpoint without changing the state),
``FAKE_CUDA_CHECKPOINT_FAIL_PID=PID`` (the checkpoint of that pid fails as the driver does on an unsupported
allocation, leaving it where it was: ``locked`` with the action CLI), ``FAKE_CUDA_CHECKPOINT_HANG_GET_STATE=SECONDS``
(only ``--get-state`` sleeps, as it hangs reading one process while another is locked: NVIDIA/cuda-checkpoint#45).
"""

import os
import sys
import time
from pathlib import Path

USAGE_TOGGLE = "usage: cuda-checkpoint --toggle --pid PID | --get-state --pid PID"
USAGE_ACTION = USAGE_TOGGLE + " | --action {lock,checkpoint,restore,unlock} --pid PID [--timeout MS]"


def main(argv: list[str]) -> int:
    api = os.environ.get("FAKE_CUDA_CHECKPOINT_API", "toggle")
    if "--help" in argv or not argv:
        print(USAGE_ACTION if api == "action" else USAGE_TOGGLE)
        return 0
    if os.environ.get("FAKE_CUDA_CHECKPOINT_FAIL") == "driver":
        print(
            "cuda-checkpoint: Could not initialize the NVIDIA driver (libcuda.so.1: cannot open shared object file)",
            file=sys.stderr,
        )
        return 1
    time.sleep(float(os.environ.get("FAKE_CUDA_CHECKPOINT_HANG", "0")))
    args = dict(zip(argv[::2], argv[1::2], strict=False)) if "--toggle" not in argv and "--get-state" not in argv else {}
    pid = argv[argv.index("--pid") + 1] if "--pid" in argv else None
    if pid is None:
        print("--pid is required", file=sys.stderr)
        return 2
    try:
        os.kill(int(pid), 0)
    except (ProcessLookupError, ValueError):
        print(f"Could not find process {pid}", file=sys.stderr)
        return 1
    f = Path(os.environ["FAKE_CUDA_CHECKPOINT_STATE_DIR"]) / pid
    state = f.read_text() if f.exists() else "running"
    lie = os.environ.get("FAKE_CUDA_CHECKPOINT_LIE") == "1"
    if "--get-state" in argv:
        time.sleep(float(os.environ.get("FAKE_CUDA_CHECKPOINT_HANG_GET_STATE", "0")))
        print(state)
        return 0
    checkpointing = ("--toggle" in argv and state == "running") or args.get("--action") == "checkpoint"
    if checkpointing and os.environ.get("FAKE_CUDA_CHECKPOINT_FAIL_PID") == pid:
        print(f"Could not checkpoint process {pid}: OS call failed or operation not supported on this OS", file=sys.stderr)
        return 1
    if "--toggle" in argv:
        new = {"running": "checkpointed", "checkpointed": "running"}.get(state)
        if new is None:
            print(f"cannot toggle a process in state {state}", file=sys.stderr)
            return 1
    elif "--action" in argv and api == "action":
        action = args.get("--action")
        allowed = {
            "lock": ("running", "locked"),
            "checkpoint": ("locked", "checkpointed"),
            "restore": ("checkpointed", "locked"),
            "unlock": ("locked", "running"),
        }
        if action not in allowed or state != allowed[action][0]:
            print(f"cannot {action} a process in state {state}", file=sys.stderr)
            return 1
        new = allowed[action][1]
    else:
        print(USAGE_ACTION if api == "action" else USAGE_TOGGLE, file=sys.stderr)
        return 2
    if not lie:
        f.write_text(new)
    with open(Path(os.environ["FAKE_CUDA_CHECKPOINT_STATE_DIR"]) / "calls.log", "a") as log:
        log.write(" ".join(argv) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
