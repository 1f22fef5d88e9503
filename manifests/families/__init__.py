"""The manifest families manifests/generate.py renders, one module each (common: the settings and helpers)."""
