"""The domain model shared by the control path and its configuration sources: a group's settings, its sampler
endpoints, the records of a phase switch, and the priority objectives of held traffic (no I/O here)."""
