"""When a watch loop reopens: at once after a watch that ran its course, after a growing,
jittered delay after one that failed or ended early, never before the server's Retry-After."""

from __future__ import annotations

import random

from flexgpu.kubelet_plugin.api.watch_pacing import MAX_RETRY_AFTER_S, WatchPacer


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _pacer(clock: Clock) -> WatchPacer:
    return WatchPacer(first_s=1.0, cap_s=8.0, min_watch_s=10.0, clock=clock, rng=random.Random(7))


def test_early_ends_back_off_doubling_within_the_jitter_and_a_full_watch_resets() -> None:
    clock = Clock()
    pacer = _pacer(clock)
    delays = []
    for _ in range(5):
        pacer.opened()
        clock.now += 0.1  # ended at once
        delays.append(pacer.ended())
    for delay, step in zip(delays, [1, 2, 4, 8, 8], strict=True):
        assert step / 2 <= delay <= step
    assert pacer.failures == 5
    pacer.opened()
    clock.now += 300  # the server's own end
    assert pacer.ended() == 0.0
    assert pacer.failures == 0
    pacer.opened()
    clock.now += 0.1
    assert 0.5 <= pacer.ended() <= 1.0  # started over


def test_failures_wait_at_least_the_servers_retry_after_within_a_cap() -> None:
    clock = Clock()
    pacer = _pacer(clock)
    assert pacer.failed(retry_after_s=5.0) == 5.0
    assert pacer.failed(retry_after_s=3600.0) == MAX_RETRY_AFTER_S
    assert 2.0 <= pacer.failed() <= 4.0  # the third step, no Retry-After


def test_a_lower_cap_for_one_failure_keeps_the_growth() -> None:
    pacer = _pacer(Clock())
    for _ in range(3):
        pacer.failed()
    assert pacer.failed(cap_s=1.0) <= 1.0  # the server unreachable: try again soon
    assert 4.0 <= pacer.failed() <= 8.0  # the step went on growing meanwhile
