"""The slice publisher's retry delays: short while the apiserver cannot be reached (so slices
return seconds after it is back), long when it answers with an error, always jittered."""

from __future__ import annotations

import http.client
import random

from flexgpu.kubelet_plugin.api.kube_api import ApiError
from flexgpu.kubelet_plugin.devices.slice_publisher import (
    FIRST_RETRY_S,
    MAX_BACKOFF_S,
    UNREACHABLE_RETRY_CAP_S,
    new_backoff,
    retry_delay,
    unreachable,
)

REFUSED = ConnectionRefusedError()


def _answered(status: int) -> ApiError:
    return ApiError(status, "Reason", "message")


def test_errors_that_mean_the_server_is_away() -> None:
    assert unreachable(REFUSED)
    assert unreachable(ConnectionResetError())
    assert unreachable(TimeoutError("timed out"))
    assert unreachable(http.client.RemoteDisconnected("closed"))
    assert unreachable(http.client.IncompleteRead(b""))
    for status in (408, 429, 500, 503, 504):
        assert unreachable(_answered(status)), status
    for status in (400, 403, 404, 409, 422):
        assert not unreachable(_answered(status)), status
    assert not unreachable(KeyError("a bug"))


def test_retries_stay_short_while_the_server_is_away() -> None:
    backoff = new_backoff(random.Random(1))
    delays = [retry_delay(backoff, REFUSED) for _ in range(50)]
    assert max(delays) <= UNREACHABLE_RETRY_CAP_S
    assert FIRST_RETRY_S / 2 <= delays[0] <= FIRST_RETRY_S
    assert sum(delays[-10:]) / 10 > UNREACHABLE_RETRY_CAP_S / 2  # it does back off
    assert backoff.failures == 50


def test_refusals_back_off_further_and_a_success_starts_over() -> None:
    backoff = new_backoff(random.Random(2))
    delays = [retry_delay(backoff, _answered(403)) for _ in range(12)]
    assert max(delays) <= MAX_BACKOFF_S and max(delays) > UNREACHABLE_RETRY_CAP_S
    backoff.reset()
    assert backoff.failures == 0
    assert retry_delay(backoff, REFUSED) <= FIRST_RETRY_S


def test_delays_are_jittered() -> None:
    firsts = {round(retry_delay(new_backoff(random.Random(s)), REFUSED), 6) for s in range(20)}
    assert len(firsts) > 10
