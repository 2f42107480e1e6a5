"""flexgpu.driver.loop: steps repeat on their interval and at once when poked, a failing step is
retried after a jittered, growing delay without killing the loop, and stop() ends it."""

from __future__ import annotations

import random
import threading

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
