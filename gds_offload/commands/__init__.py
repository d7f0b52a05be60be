"""Subcommands of ``gds-offload`` (see :mod:`gds_offload.cli`)."""
