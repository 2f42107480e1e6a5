"""The slice publisher's retry delays: short while the apiserver cannot be reached (so slices
return seconds after it is back), long when it answers with an error, always jittered."""

from __future__ import annotations

import random

import urllib3
from kubernetes import client

from kubelet_plugin.slice_publisher import (
    FIRST_RETRY_S,
    MAX_BACKOFF_S,
    UNREACHABLE_RETRY_CAP_S,
    Backoff,
    unreachable,
)

REFUSED = urllib3.exceptions.MaxRetryError(None, "/apis", reason=ConnectionRefusedError())


def test_errors_that_mean_the_server_is_away() -> None:
    assert unreachable(REFUSED)
    assert unreachable(ConnectionResetError())
    assert unreachable(urllib3.exceptions.ReadTimeoutError(None, "/apis", "timed out"))
    for status in (0, 429, 500, 503, 504):
        assert unreachable(client.ApiException(status=status)), status
    for status in (400, 403, 404, 409, 422):
        assert not unreachable(client.ApiException(status=status)), status
    assert not unreachable(KeyError("a bug"))


def test_retries_stay_short_while_the_server_is_away() -> None:
    backoff = Backoff(random.Random(1))
    delays = [backoff.next(REFUSED) for _ in range(50)]
    assert max(delays) <= UNREACHABLE_RETRY_CAP_S
    assert FIRST_RETRY_S / 2 <= delays[0] <= FIRST_RETRY_S
    assert sum(delays[-10:]) / 10 > UNREACHABLE_RETRY_CAP_S / 2  # it does back off
    assert backoff.failures == 50


def test_refusals_back_off_further_and_a_success_starts_over() -> None:
    backoff = Backoff(random.Random(2))
    delays = [backoff.next(client.ApiException(status=403)) for _ in range(12)]
    assert max(delays) <= MAX_BACKOFF_S and max(delays) > UNREACHABLE_RETRY_CAP_S
    backoff.reset()
    assert backoff.failures == 0
    assert backoff.next(REFUSED) <= FIRST_RETRY_S


def test_delays_are_jittered() -> None:
    backoff = [Backoff(random.Random(seed)) for seed in range(20)]
    firsts = {round(b.next(REFUSED), 6) for b in backoff}
    assert len(firsts) > 10
