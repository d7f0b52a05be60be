"""Where offloaded bytes live: the spill store, and each rank's directories."""
