"""Closing a file descriptor that an object holds, so that it is never closed twice.

A descriptor number is reused by the next ``open``: closing a number a second time can close
another file's. ``os.close(obj.fd); obj.fd = -1`` leaves that window open when a signal's
exception (Ctrl-C) lands between the two statements: the object still names the closed number,
and whoever closes it next (a ``finally``, a ``close()`` that is meant to be idempotent) closes
it again. :func:`close_fd` takes the number out of the object first; an interrupt can then leak
the descriptor (until the process ends), never close another file's.
"""
from __future__ import annotations

import os
from typing import Any

__all__ = ["close_fd"]


def close_fd(holder: Any, attr: str = "fd") -> None:
    """Close the descriptor ``holder.<attr>`` and set it to ``-1``, in that order of effect: the
    attribute is ``-1`` before ``os.close`` runs. Nothing to do when it is already negative."""
    fd = getattr(holder, attr)
    if fd < 0:
        return
    setattr(holder, attr, -1)
    os.close(fd)
