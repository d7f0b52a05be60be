"""KvikIO and cuFile: the ``gds`` and ``compat`` engines, and what ``cufile.json`` and cuFile's
compat fallback say (read without the driver, for ``gds-check``)."""
