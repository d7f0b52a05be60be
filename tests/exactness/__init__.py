"""Exactness suite: every case run plain and attached, compared bit for bit (see :mod:`helpers.exact`).

A package, so that its ``conftest.py`` is imported as ``exactness.conftest`` and not as a
second top-level ``conftest`` beside ``tests/conftest.py``.
"""
