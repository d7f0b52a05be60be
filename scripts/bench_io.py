#!/usr/bin/env python
"""Engine bandwidth against the drive's raw O_DIRECT bandwidth: same as ``gds-offload bench-io``.

Example: ``.venv/bin/python scripts/bench_io.py --path /mnt/nvme/spill --size 2GiB --json results/io.json``
"""
import sys

from gds_offload.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench-io", *sys.argv[1:]]))
