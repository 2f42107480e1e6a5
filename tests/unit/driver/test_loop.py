"""flexgpu.driver.loop: steps repeat on their interval and at once when poked, a failing step is
retried after a jittered, growing delay without killing the loop, and stop() ends it."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable

from flexgpu.driver.backoff import Backoff
from flexgpu.driver.loop import Loop
from tests.conftest import wait_for


def test_a_poke_runs_the_next_step_without_waiting_for_the_interval() -> None:
    ran = threading.Semaphore(0)
    loop = Loop("t", lambda: ran.release() and None, interval_s=3600)
    loop.start()
    try:
        assert ran.acquire(timeout=10)  # the first step runs at start
        loop.poke()
        assert ran.acquire(timeout=10)  # an hour early: the poke
        assert loop.passes >= 1 and loop.last_error is None
    finally:
        loop.stop()


def test_a_failing_step_is_retried_after_a_backoff_and_the_loop_survives() -> None:
    calls: list[int] = []

    def step() -> None:
        calls.append(1)
        if len(calls) <= 3:
            raise RuntimeError(f"failure {len(calls)}")

    backoff = Backoff(0.01, 0.05, random.Random(1))
    loop = Loop("t", step, interval_s=3600, backoff=backoff)
    loop.start()
    try:
        wait_for(lambda: loop.passes == 1, what="a step succeeding after three failures")
        assert len(calls) == 4 and loop.last_error is None
        assert backoff.failures == 0  # reset by the success
    finally:
        loop.stop()


def test_the_step_may_ask_for_its_next_run_and_stop_ends_the_loop() -> None:
    ran = threading.Semaphore(0)

    def step() -> float:
        ran.release()
        return 0.0  # run again at once

    loop = Loop("t", step, interval_s=3600)
    loop.start()
    for _ in range(3):
        assert ran.acquire(timeout=10)
    loop.stop()
    assert not loop.running  # stop() waited for the thread: no step can run any more


def _timed_calls(
    loop_box: list[Loop], first: Callable[[Loop], None]
) -> tuple[list[float], Callable[[], None]]:
    """A step that records when it runs and, on its first run, does ``first(loop)``."""
    times: list[float] = []

    def step() -> None:
        times.append(time.monotonic())
        if len(times) == 1:
            first(loop_box[0])

    return times, step


def test_pokes_do_not_cut_a_backoff_short_when_told_not_to() -> None:
    """The first step pokes its own loop, then fails: with pokes_end_backoff the retry comes
    at once, without it only after the (at least 1 s) delay."""

    def poke_then_fail(loop: Loop) -> None:
        loop.poke()
        raise RuntimeError("refused")

    gaps = {}
    for pokes_end_backoff in (True, False):
        box: list[Loop] = []
        times, step = _timed_calls(box, poke_then_fail)
        backoff = Backoff(2.0, 2.0, random.Random(3))
        box.append(Loop("t", step, 3600, backoff=backoff, pokes_end_backoff=pokes_end_backoff))
        box[0].start()
        try:
            wait_for(lambda: len(times) >= 2, what="the retry")  # noqa: B023
            assert box[0].failures == 1 and box[0].passes == 1
        finally:
            box[0].stop()
        gaps[pokes_end_backoff] = times[1] - times[0]
    assert gaps[True] < 1.0 <= gaps[False]


def test_a_hold_is_deaf_to_pokes_but_remembers_them() -> None:
    """A step that holds 0.3 s and is poked meanwhile runs again after the hold (not after its
    hour-long interval, and not at once)."""

    def hold_and_poke(loop: Loop) -> None:
        loop.hold(0.3)
        loop.poke()

    box: list[Loop] = []
    times, step = _timed_calls(box, hold_and_poke)
    box.append(Loop("t", step, 3600))
    box[0].start()
    try:
        wait_for(lambda: len(times) >= 2, what="the step after the hold")
    finally:
        box[0].stop()
    assert times[1] - times[0] >= 0.3


def test_retry_cap_shortens_a_delay_by_the_kind_of_error() -> None:
    """An hour-long backoff capped to 10 ms for this error: the retry comes promptly."""
    calls: list[int] = []

    def step() -> None:
        calls.append(1)
        if len(calls) == 1:
            raise ConnectionRefusedError("away")

    def cap(err: Exception) -> float | None:
        return 0.01 if isinstance(err, ConnectionError) else None

    loop = Loop("t", step, 3600, backoff=Backoff(3600, 3600), retry_cap_s=cap)
    loop.start()
    try:
        wait_for(lambda: loop.passes == 1, what="the capped retry")
        assert loop.failures == 1
    finally:
        loop.stop()


def test_stop_ends_a_hold_and_a_backoff_promptly() -> None:
    def fail() -> None:
        raise RuntimeError("always")

    loop = Loop("t", fail, 3600, backoff=Backoff(3600, 3600), pokes_end_backoff=False)
    loop.start()
    wait_for(lambda: loop.failures == 1, what="the first failure")
    started = time.monotonic()
    loop.stop()
    assert not loop.running and time.monotonic() - started < 5
