"""The DeviceTaintRules of a feature that is turned off, deleted once by each new leader.

GPU clearing's and node steering's rules outlive the process on purpose (a new leader takes
them over). When an admin turns a feature off, nothing takes its rules over any more: without
this sweep they would keep the devices they name steered for ever, which is the opposite of
what turning it off means. So the leader lists the rules of each feature that is off and
deletes them. The chart grants list and delete on DeviceTaintRules whatever is turned on,
and its admission policy lets the controller delete only rules labelled as its own.

A listing or delete that fails (an API server that refuses, an older chart without the
right) is logged and tried again after ``retry_s``; nothing else waits on it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Final, Protocol

from flexgpu.controller.taint_rules import RuleInfo, SteeringRule

log = logging.getLogger(__name__)

RETRY_S: Final = 600.0


class LeftoverRuleStore(Protocol):
    # list_steering first: below ``list`` the name is the method, not the builtin.
    def list_steering(self) -> list[SteeringRule]: ...
    def list(self) -> list[RuleInfo]: ...
    def delete(self, name: str) -> None: ...


class LeftoverRules:
    def __init__(
        self,
        rules: LeftoverRuleStore,
        *,
        clearing_on: bool,
        steering_on: bool,
        retry_s: float = RETRY_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._rules = rules
        self._clearing_on = clearing_on
        self._steering_on = steering_on
        self._retry_s = retry_s
        self._clock = clock
        self._done = clearing_on and steering_on  # nothing of either can be left over
        self._next_try = 0.0
        self.deleted = 0

    def forget(self) -> None:
        """Leadership lost: the next leadership sweeps again (another leader with the
        feature on may have made rules in between)."""
        self._done = self._clearing_on and self._steering_on
        self._next_try = 0.0

    def run_pass(self) -> None:
        if self._done or self._clock() < self._next_try:
            return
        try:
            found: list[tuple[str, str]] = []
            if not self._clearing_on:
                found += [(r.name, f"GPU clearing (GPU {r.gpu})") for r in self._rules.list()]
            if not self._steering_on:
                found += [
                    (r.name, f"node steering (node {r.node})") for r in self._rules.list_steering()
                ]
            for name, what in found:
                self._rules.delete(name)
                self.deleted += 1
                log.info("deleted DeviceTaintRule %s of %s, which is turned off", name, what)
        except Exception as err:  # the API server's answer, whatever it is: try again later
            self._next_try = self._clock() + self._retry_s
            log.warning(
                "cannot delete the DeviceTaintRules of features turned off (%s); trying again "
                "in %.0f s",
                err,
                self._retry_s,
            )
            return
        self._done = True
