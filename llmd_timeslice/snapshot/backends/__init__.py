"""Snapshot backends, chosen by name (see :func:`llmd_timeslice.snapshot.backends.base.create_backend`)."""
