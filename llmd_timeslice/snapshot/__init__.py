"""Per-pod snapshot sidecar: puts engines to sleep, wakes them, verifies each step."""
