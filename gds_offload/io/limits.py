"""A token bucket that caps an engine's bandwidth.

Used to imitate a slow drive (a GPU-to-SSD bandwidth ratio on a CPU machine) and to
leave bandwidth to other jobs on a shared drive. Shared by writes and reads.
"""
from __future__ import annotations

import threading
import time

__all__ = ["TokenBucket"]


class TokenBucket:
    """Allow ``rate_bytes_per_s`` on average, with bursts up to ``burst_bytes``.

    :meth:`acquire` blocks the calling (engine) thread until the bytes may go.
    """

    def __init__(self, rate_bytes_per_s: float, burst_bytes: int | None = None) -> None:
        if rate_bytes_per_s <= 0:
            raise ValueError(f"rate_bytes_per_s must be positive, got {rate_bytes_per_s}")
        self.rate = float(rate_bytes_per_s)
        self.burst = float(burst_bytes if burst_bytes is not None else max(rate_bytes_per_s * 0.05, 1 << 20))
        self._tokens = self.burst
        self._last = time.monotonic()
        self._lock = threading.Lock()

    def acquire(self, nbytes: int) -> None:
        # Reserve now, sleep off the debt outside the lock: concurrent callers queue fairly.
        with self._lock:
            now = time.monotonic()
            self._tokens = min(self.burst, self._tokens + (now - self._last) * self.rate)
            self._last = now
            self._tokens -= nbytes
            debt = -self._tokens
        if debt > 0:
            time.sleep(debt / self.rate)
