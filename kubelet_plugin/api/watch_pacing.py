"""When a watch loop may open its next watch.

The API server ends a healthy watch after the timeoutSeconds asked for (minutes); one that
ends within seconds, cleanly or not, means something between us and the server (a proxy, a
load balancer, an overloaded apiserver) is cutting it. Reopening at once would turn that into
hundreds of requests a second from every node, so, as client-go's reflector does, a watch that
failed or ended early is followed by an exponential, jittered delay, and the delay starts over
only after a watch that ran long enough. A 429's or 503's Retry-After is waited out as well.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import Final

from flexgpu.driver.backoff import Backoff

# client-go's reflector: 800 ms doubling up to 30 s.
FIRST_DELAY_S: Final = 0.8
MAX_DELAY_S: Final = 30.0
# A watch shorter than this ended early (the server's own end comes after minutes).
MIN_WATCH_S: Final = 10.0
# The most of a server's Retry-After that is waited before one watch (then the usual growth).
MAX_RETRY_AFTER_S: Final = 60.0


class WatchPacer:
    """One per watch loop: opened() as a watch (or its list) starts; ended() or failed() when
    it stops give the seconds to wait before the next one."""

    def __init__(
        self,
        *,
        first_s: float = FIRST_DELAY_S,
        cap_s: float = MAX_DELAY_S,
        min_watch_s: float = MIN_WATCH_S,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
    ) -> None:
        self._backoff = Backoff(first_s, cap_s, rng)
        self._min_watch_s = min_watch_s
        self._clock = clock
        self._opened_at = clock()

    @property
    def failures(self) -> int:
        """Watches in a row that failed or ended early."""
        return self._backoff.failures

    def opened(self) -> None:
        self._opened_at = self._clock()

    def ended(self) -> float:
        """A watch ended without an error: at once after a full one, else a delay."""
        if self._clock() - self._opened_at >= self._min_watch_s:
            self._backoff.reset()
            return 0.0
        return self._backoff.next()

    def failed(self, retry_after_s: float | None = None, cap_s: float | None = None) -> float:
        """A list or watch failed: the next delay, at least the server's Retry-After.
        cap_s caps this one delay lower (the server unreachable: try again soon)."""
        delay = self._backoff.next(cap_s)
        if retry_after_s is not None:
            delay = max(delay, min(retry_after_s, MAX_RETRY_AFTER_S))
        return delay
