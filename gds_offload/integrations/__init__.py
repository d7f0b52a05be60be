"""Integrations with training frameworks: :mod:`gds_offload.integrations.transformers` (Hugging Face ``Trainer``)."""
