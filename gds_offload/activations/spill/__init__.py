"""Where offloaded activations go: each rank's directories, and the drive nearest each GPU (the spill files themselves are :mod:`gds_offload.io.spill`'s)."""
