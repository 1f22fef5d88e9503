"""The time-slice gate: an Envoy ext_proc service in front of the EPP (hold / drain / steer / release)."""
