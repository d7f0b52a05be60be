"""Benchmarks: storage-engine bandwidth (:mod:`gds_offload.bench.io`) and training runs."""
