"""The activation half: what autograd saves in forward, offloaded to NVMe and read back for backward."""
