"""A small EPP-protocol endpoint picker for set-ups without the llm-d EPP (local, Slurm, tests)."""
