"""Benchmarks that need an NVIDIA GPU (each exits cleanly with a message where CUDA is absent)."""
