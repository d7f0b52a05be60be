"""The shape of a run, chosen from a measured profile (no model runs here): the workload and
the profile as frozen values, the time and memory model, the choice under a memory limit, and
which layers stay resident under ``max_memory``."""
