"""Inference engines as this machine runs them: the vLLM server launcher and the tiny test model."""
