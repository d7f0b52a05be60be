"""The activation benchmark: runs, their child processes, workloads, the recompute-offload-keep sweep, ranks."""
