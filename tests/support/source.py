"""Parsing the project's own source in tests."""

from __future__ import annotations

import ast
import gc
from pathlib import Path


def parse_source(path: Path) -> ast.Module:
    """``ast.parse`` of one file with the garbage collector paused.

    CPython 3.11.7 (the interpreter here and in CI) can raise ``SystemError: AST constructor recursion depth
    mismatch`` from ``ast.parse`` (python/cpython#106905): its AST-to-object converter keeps one depth counter per
    interpreter, and a collection during the conversion runs finalizers that can release the GIL (grpc.aio's shut
    its poller thread down under ``ast.parse``: tests/conftest.py). Seen once in a full CI run (2026-12-02).
    Raises what ``ast.parse`` raises."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        return ast.parse(path.read_text(), str(path))
    finally:
        if enabled:
            gc.enable()
