"""Retry delays double up to their cap, are jittered, and start over after a success."""

from __future__ import annotations

import random

import pytest

from flexgpu.driver.backoff import Backoff, jittered


def test_delays_double_up_to_the_cap_within_half_and_all_of_each_step() -> None:
    backoff = Backoff(0.5, 4.0, random.Random(3))
    steps = [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]
    for step in steps:
        assert step / 2 <= backoff.next() <= step
    assert backoff.failures == len(steps)


def test_a_lower_cap_for_one_retry_does_not_stop_the_growth() -> None:
    backoff = Backoff(1.0, 30.0, random.Random(4))
    quick = [backoff.next(cap_s=2.0) for _ in range(6)]
    assert max(quick) <= 2.0
    assert backoff.next() > 2.0  # the step kept doubling underneath: 64 -> capped at 30


def test_reset_starts_over() -> None:
    backoff = Backoff(0.2, 30.0, random.Random(5))
    for _ in range(10):
        backoff.next()
    backoff.reset()
    assert backoff.failures == 0
    assert backoff.next() <= 0.2


def test_delays_are_jittered() -> None:
    firsts = {round(Backoff(1.0, 8.0, random.Random(seed)).next(), 6) for seed in range(20)}
    assert len(firsts) > 10


def test_first_delay_must_be_positive_and_within_the_cap() -> None:
    with pytest.raises(ValueError, match="first_s 0"):
        Backoff(0, 1.0)
    with pytest.raises(ValueError, match="need 0 < first_s <= cap_s"):
        Backoff(2.0, 1.0)


def test_a_single_jittered_delay_lies_within_half_and_all_of_its_step() -> None:
    rng = random.Random(6)
    delays = [jittered(4.0, rng) for _ in range(200)]
    assert all(2.0 <= d <= 4.0 for d in delays)
    assert max(delays) - min(delays) > 1.0
