"""The saved-tensor hooks' machinery: a saved storage's life (entry), the shared state, writes, reads, forwards."""
