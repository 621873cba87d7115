"""SLURM launch specs, submission and requeue. Arrives with a later issue; nothing here yet."""
