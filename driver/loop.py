"""A background loop on a thread of its own, for the daemons' periodic work.

``Loop(name, step, interval_s)`` runs ``step()`` on a daemon thread: again ``interval_s``
after it returns (or the number of seconds it returns), at once when ``poke()`` is called, and
after an exception once a growing, jittered delay has passed (``driver.backoff``), so a step
that keeps failing never spins and nodes that fail together do not retry in step. ``stop()``
ends the loop and waits for a step in progress. No I/O of its own: what ``step`` does is the
caller's business.

Two knobs for a step whose retries must not be cut short (the slice publisher, whose every
own write comes back as a watch event that pokes it): ``pokes_end_backoff=False`` waits out
a failure's delay whatever pokes arrive, and ``hold(seconds)`` from inside a step puts a
pause of that length, deaf to pokes, before the next ordinary wait. ``retry_cap_s(err)``
caps one retry's delay by the kind of error (a server that is away is retried sooner).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from flexgpu.driver.backoff import Backoff

log = logging.getLogger(__name__)


class Loop:
    def __init__(
        self,
        name: str,
        step: Callable[[], float | None],
        interval_s: float,
        *,
        backoff: Backoff | None = None,
        first_run_s: float = 0.0,
        retry_cap_s: Callable[[Exception], float | None] | None = None,
        pokes_end_backoff: bool = True,
    ) -> None:
        self.name = name
        self._step = step
        self._interval_s = interval_s
        self._backoff = backoff or Backoff(1.0, 30.0)
        self._first_run_s = first_run_s
        self._retry_cap_s = retry_cap_s
        self._pokes_end_backoff = pokes_end_backoff
        self._hold_s = 0.0
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.last_error: str | None = None
        self.passes = 0  # steps that returned normally
        self.failures = 0  # steps that raised, in all

    def start(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self._thread.start()

    def poke(self) -> None:
        """Run the next step now (or right after the one in progress)."""
        self._wake.set()

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def hold(self, seconds: float) -> None:
        """From a step: pause ``seconds`` before the next ordinary wait, pokes or not (stop
        still ends it); a poke that came meanwhile runs the step when the pause is over."""
        self._hold_s = seconds

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _run(self) -> None:
        wait, hold = self._first_run_s, 0.0
        while not (hold > 0 and self._stop.wait(hold)) and not self._sleep(wait):
            try:
                asked = self._step()
            except Exception as err:  # a failing step retries later; the loop never dies
                delay = self._backoff.next(self._retry_cap_s(err) if self._retry_cap_s else None)
                self.last_error = str(err)
                self.failures += 1
                self._hold_s = 0.0  # a hold asked by a step that then failed: the delay rules
                log.warning(
                    "%s failed, retrying in %.1fs: %s",
                    self.name,
                    delay,
                    err,
                    exc_info=log.isEnabledFor(logging.DEBUG),
                )
                wait, hold = (delay, 0.0) if self._pokes_end_backoff else (0.0, delay)
                continue
            if self._backoff.failures:
                log.info("%s works again after %d failure(s)", self.name, self._backoff.failures)
            self._backoff.reset()
            self.last_error = None
            self.passes += 1
            wait = self._interval_s if asked is None else asked
            hold, self._hold_s = self._hold_s, 0.0

    def _sleep(self, seconds: float) -> bool:
        """Wait up to ``seconds`` or until poked; True when the loop is to stop."""
        if seconds > 0:
            self._wake.wait(seconds)
        self._wake.clear()
        return self._stop.is_set()
