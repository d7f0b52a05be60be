"""Benchmarks: storage-engine bandwidth (:mod:`gds_offload.bench.io_bench`) and training runs."""
