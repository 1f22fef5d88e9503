"""Router side of llmd-timeslice: Envoy ext_proc services (time-slice gate, EPP-protocol picker)."""
