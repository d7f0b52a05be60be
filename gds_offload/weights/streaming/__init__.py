"""A streamed layer's bytes into a ring slot, and the hook object that binds them to the layer
for its forward (:class:`~gds_offload.weights.streaming.hooks.LayerStreamer`): the ring and its
fills, which layer fills which slot next, one forward at a time, a team of micro-batches sharing
each load, and backward finding the weights it saved."""
