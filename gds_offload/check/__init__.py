"""``gds-check``: can this node offload activations to NVMe through GPUDirect Storage?

The probes and the verdict are the library's (:mod:`gds_offload.node`, shared with the
offloader's ``mode="auto"``); this package is the command: :mod:`gds_offload.check.cli`
probes, builds the typed report and exits with the verdict, :mod:`gds_offload.check.report`
holds the JSON document and the rich renderer, :mod:`gds_offload.check.rank_map` the
``--ranks`` table. Importing this package imports neither torch nor KvikIO.
"""
from gds_offload.node.collect import Probes
from gds_offload.node.findings import CheckResult
from gds_offload.node.paths import default_spill_dir
from gds_offload.node.verdict import Verdict, node_verdict

__all__ = ["CheckResult", "Probes", "Verdict", "default_spill_dir", "node_verdict"]
