"""Placement planner."""
