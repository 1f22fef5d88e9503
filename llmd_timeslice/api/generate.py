"""Regenerate the Python stubs of the project's .proto files (``make protos``).

The generated ``*_pb2.py``/``*_pb2_grpc.py`` files are committed so that a plain
``pip install`` needs no code generation; run this after editing a .proto.
"""

from __future__ import annotations

import sys
from pathlib import Path

from grpc_tools import protoc

REPO = Path(__file__).resolve().parents[2]


def main() -> int:
    protos = sorted(str(p.relative_to(REPO)) for p in (REPO / "llmd_timeslice" / "api").rglob("*.proto"))
    include = Path(protoc.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{REPO}",
        f"-I{include}",
        f"--python_out={REPO}",
        f"--pyi_out={REPO}",
        f"--grpc_python_out={REPO}",
        *protos,
    ]
    rc = protoc.main(args)
    if rc != 0:
        print("protoc failed", file=sys.stderr)
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
