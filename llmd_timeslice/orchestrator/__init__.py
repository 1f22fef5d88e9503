"""Orchestrator: accelerator groups, FIFO locks, phase-switch state machine."""
