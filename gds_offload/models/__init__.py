"""Models the examples and benchmarks train: the demo GPT (:mod:`gds_offload.models.gpt`)."""
