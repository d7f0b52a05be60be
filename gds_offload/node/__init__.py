"""Probes of this machine that print nothing, and never raise: one truth for ``gds-check`` and ``mode="auto"``.

Each probe is a function over a *root* directory (``/`` on a real node; a fake tree in the
tests): :mod:`~gds_offload.node.system` (GPUs, libcufile, nvidia-fs, containers),
:mod:`~gds_offload.node.kvikio_child` (KvikIO and the cuFile driver, in a child process),
:mod:`~gds_offload.node.paths` (spill directories), :mod:`~gds_offload.node.topology` (PCIe/NUMA
affinity), read through :mod:`~gds_offload.node.reader`. :mod:`~gds_offload.node.collect` runs them
once, :mod:`~gds_offload.node.findings` turns the facts into checks and
:mod:`~gds_offload.node.verdict` into a verdict; :mod:`~gds_offload.node.probes` re-exports them.
:mod:`~gds_offload.node.choice` resolves ``mode="auto"`` to an engine. Imports only :mod:`gds_offload.io`,
:mod:`gds_offload.errors` and :mod:`gds_offload.units` of the package; nothing but
:mod:`~gds_offload.node.choice` imports torch at module level.
"""
