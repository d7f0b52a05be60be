"""What the hooks of both halves need of the process: stop signals held and delivered where the
state is consistent (:mod:`~gds_offload.runtime.interrupts`), and glibc's allocator made
predictable where memory is planned (:mod:`~gds_offload.runtime.malloc`)."""
