"""Snapshot backends, chosen by name through :data:`llmd_timeslice.snapshot.backends.registry.SNAPSHOT_BACKENDS`."""
