"""``gds-check``: can this node offload activations to NVMe through GPUDirect Storage?

The probes (:mod:`~gds_offload.node.system`, :mod:`~gds_offload.node.kvikio_child`,
:mod:`~gds_offload.io.cufile_config`, :mod:`~gds_offload.node.paths`,
:mod:`~gds_offload.node.topology`) are run once by :mod:`~gds_offload.node.collect`;
:mod:`~gds_offload.node.findings` turns the facts into checks and
:mod:`~gds_offload.node.verdict` into a verdict (shared with the offloader's
``mode="auto"``). :mod:`gds_offload.node.probes` re-exports all of it under one name.
:mod:`gds_offload.check.report` holds the JSON document and the rich renderer,
:mod:`gds_offload.check.cli` the command. Importing this package imports neither torch
nor KvikIO.
"""
from gds_offload.node.collect import Probes
from gds_offload.node.findings import CheckResult
from gds_offload.node.paths import default_spill_dir
from gds_offload.node.verdict import Verdict, node_verdict

__all__ = ["CheckResult", "Probes", "Verdict", "default_spill_dir", "node_verdict"]
