"""Probes of this machine that print nothing: GPUs, the cuFile stack, spill directories, topology, the verdict."""
