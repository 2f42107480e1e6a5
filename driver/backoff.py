"""Delays between retries: exponential, capped, jittered. Pure: no clock, no sleeping.

Every daemon loop that retries after a failure (a watch that broke, a write the server
refused) takes its delays from here, so none retries in a tight loop and a fleet of nodes that
lost the API server together does not come back in step: each delay is drawn between half
and all of the current step.
"""

from __future__ import annotations

import random


def jittered(step_s: float, rng: random.Random | None = None) -> float:
    """A delay drawn uniformly from [half, all] of ``step_s``: for a caller that keeps its own
    failure count (one per queued item) and so needs no Backoff object."""
    return step_s * (rng or _RNG).uniform(0.5, 1.0)


_RNG = random.Random()


class Backoff:
    """``next()`` gives the delay before the next retry: ``first_s``, doubling up to
    ``cap_s``, each drawn uniformly from [half, all] of that step; ``reset()`` after a
    success starts over. ``next(cap_s=...)`` caps one delay lower (a failure that calls for
    a quick retry) without slowing the growth for later ones."""

    def __init__(self, first_s: float, cap_s: float, rng: random.Random | None = None) -> None:
        if not 0 < first_s <= cap_s:
            raise ValueError(f"first_s {first_s} and cap_s {cap_s}: need 0 < first_s <= cap_s")
        self.first_s = first_s
        self.cap_s = cap_s
        self._rng = rng or random.Random()
        self._step = first_s
        self.failures = 0

    def reset(self) -> None:
        self._step = self.first_s
        self.failures = 0

    def next(self, cap_s: float | None = None) -> float:
        delay = min(self._step, self.cap_s if cap_s is None else cap_s)
        self._step = min(self._step * 2, self.cap_s)
        self.failures += 1
        return jittered(delay, self._rng)
