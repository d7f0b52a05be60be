"""``gds-check``: can this node offload activations to NVMe through GPUDirect Storage?

:mod:`gds_offload.check.probes` holds the probes and the decision (shared with the
offloader's ``mode="auto"``), :mod:`gds_offload.check.report` the JSON document and the
rich renderer, :mod:`gds_offload.check.cli` the command. Importing this package imports
neither torch nor KvikIO.
"""
from gds_offload.check.probes import CheckResult, Probes, Verdict, default_spill_dir, node_verdict

__all__ = ["CheckResult", "Probes", "Verdict", "default_spill_dir", "node_verdict"]
