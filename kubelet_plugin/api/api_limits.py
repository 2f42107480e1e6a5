"""How the plugin's API client paces itself: a client-side rate limit, which answers it
retries and after how long, and how much of a response it reads.

The same manners as client-go's REST client, which every Go plugin on the node has: a token
bucket in front of every request (watches included); 429 (the server did not take the request)
retried for any verb and 5xx for idempotent ones only, after the server's Retry-After or an
exponential, jittered delay; bodies read up to a bound, so a broken or hostile server cannot
make the plugin buffer without end.
"""

from __future__ import annotations

import email.utils
import http.client
import threading
import time
from collections.abc import Callable, Mapping
from typing import Final

# kubelet's own client defaults (--kube-api-qps 50, --kube-api-burst 100): a node's plugin
# makes about one request per prepare, and a burst of pod starts must not queue behind 5/s.
DEFAULT_QPS: Final = 50.0
DEFAULT_BURST: Final = 100
# Requests that may be sent again without changing the outcome (RFC 9110, 9.2.2).
IDEMPOTENT: Final = frozenset({"GET", "HEAD", "PUT", "DELETE", "OPTIONS"})
# Answers worth sending again after a wait: 429 (throttled, not processed) for any verb;
# these 5xx for idempotent ones (a 5xx with Retry-After too).
RETRIED_5XX: Final = frozenset({502, 503, 504})
# At most this many retries of one request, and at most this long waiting between them: a
# prepare that waits on the API server must still answer the kubelet well within its deadline.
MAX_RETRIES: Final = 5
RETRY_BUDGET_S: Final = 15.0
RETRY_FIRST_S: Final = 0.2
RETRY_CAP_S: Final = 5.0
# A node's lists (its slices, its pods, one claim) are kilobytes to a few MiB.
MAX_BODY_BYTES: Final = 64 * 1024 * 1024
# One watch event carries one object (etcd's limit is 1.5 MiB by default).
MAX_EVENT_BYTES: Final = 16 * 1024 * 1024


class ResponseTooLarge(Exception):
    """The server sent more than the client reads for one response or event."""


class RateLimiter:
    """A token bucket: ``burst`` requests at once, then ``qps`` per second. Thread-safe;
    each caller reserves its slot and sleeps outside the lock, so waits are first come,
    first served (as golang.org/x/time/rate reserves)."""

    def __init__(
        self,
        qps: float,
        burst: int,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if not qps > 0:
            raise ValueError(f"qps {qps!r}: allowed: a number greater than 0")
        if burst < 1:
            raise ValueError(f"burst {burst!r}: allowed: a whole number of at least 1")
        self.qps = qps
        self.burst = burst
        self._clock = clock
        self._sleep = sleep
        self._tokens = float(burst)
        self._last = clock()
        self._lock = threading.Lock()

    def acquire(self) -> float:
        """Takes one token, waiting for it if need be; returns the seconds waited."""
        with self._lock:
            now = self._clock()
            self._tokens = min(self.burst, self._tokens + (now - self._last) * self.qps)
            self._last = now
            self._tokens -= 1
            wait = -self._tokens / self.qps if self._tokens < 0 else 0.0
        if wait > 0:
            self._sleep(wait)
        return wait


def retry_after_s(headers: Mapping[str, str] | http.client.HTTPMessage) -> float | None:
    """Retry-After as seconds (delta-seconds or an HTTP date); None when absent or unreadable."""
    value = headers.get("Retry-After")
    if value is None:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


def retriable_status(status: int, method: str, retry_after: float | None) -> bool:
    """Whether an error answer may be sent again (after a wait)."""
    if status == 429:
        return True
    if status >= 500 and method in IDEMPOTENT:
        return status in RETRIED_5XX or retry_after is not None
    return False


def read_bounded(response: http.client.HTTPResponse, limit: int | None = None) -> bytes:
    """The whole body, refusing one over ``limit`` (default MAX_BODY_BYTES) bytes, as
    announced or as read."""
    limit = MAX_BODY_BYTES if limit is None else limit
    length = response.getheader("Content-Length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise ResponseTooLarge(
            f"response of {int(length)} bytes is over the client's limit of {limit} bytes"
        )
    data = response.read(limit + 1)
    if len(data) > limit:
        raise ResponseTooLarge(f"response body is over the client's limit of {limit} bytes")
    return data
