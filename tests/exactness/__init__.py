"""Exactness suite: every case run plain and attached, compared bit for bit (see exact_harness).

A package, so that its ``conftest.py`` is imported as ``exactness.conftest`` and does not
shadow ``tests/conftest.py`` for the ``from conftest import ...`` of the other test modules.
"""
