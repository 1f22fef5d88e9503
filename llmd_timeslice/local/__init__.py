"""``llmd-timeslice up``: the whole stack on one machine (workstation, Slurm allocation, bare-metal node),
supervised, from one stack file (:mod:`.stack_file`, :mod:`.supervisor`, :mod:`.up`)."""
