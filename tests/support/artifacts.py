"""Where tests keep what they leave behind (logs, built models): ``test-artifacts/`` at the repository root."""

from __future__ import annotations

from pathlib import Path

ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"
