"""Where groups, samplers and gates come from: a static inventory file (local, Slurm) or Kubernetes labels."""
